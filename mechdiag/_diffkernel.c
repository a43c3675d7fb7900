/* One fused pass over two dense tensors for mechdiag.displacement (optional; mechdiag falls back to torch).

   stats(buf_a, off_a, dt_a, buf_b, off_b, dt_b, n) -> (sum a^2, sum (b - a)^2, #changed, #|b - a| < ulp)
   buf_b None: only sum a^2. Buffers are anything with the buffer protocol (the checkpoint's mmap); elements are
   float32 (dt 0) or bfloat16 (dt 1), read at byte offsets off_a / off_b. The arithmetic is the torch path's:
   cast to float32, d = b - a in float32, squares summed in float64, ulp = 2^floor(log2|a|) * 2^-7 from the
   exponent bits, at least 2^-133 (zero and subnormal a). Eager torch needs a dozen passes for this; one pass
   keeps the work at the speed of reading the file pages. The GIL is released, so threads run tensors in parallel.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

typedef struct {
    double ref, dsq;
    int64_t changed, below;
} Sums;

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float load_bf16(const uint16_t *p, Py_ssize_t i) { return bits_f32((uint32_t)p[i] << 16); }

static inline float load_f32(const float *p, Py_ssize_t i) { return p[i]; }

/* Blocks of BLOCK elements, eight at a time in vector registers (GCC/Clang vector extensions, lowered to SSE
   or AVX2): float32 partial sums and int32 counts per block, the block totals then added in float64 (the
   rounding of the torch path's 256-element float32 blocks summed in float64). */
#define BLOCK 4096

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef double v8d __attribute__((vector_size(64)));

/* acc += x^2 in float64 (the square of a float32 is exact in float64). */
static inline __attribute__((always_inline)) void add_sq(v8d *acc, v8f x) {
    v8d dx = __builtin_convertvector(x, v8d);
    *acc += dx * dx;
}

static inline __attribute__((always_inline)) v8f load8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

static inline __attribute__((always_inline)) v8f load8_f32(const float *p) {
    v8f f;
    memcpy(&f, p, sizeof f);
    return f;
}

static inline float ulp_of(float x) {
    float ulp = bits_f32(f32_bits(x) & 0x7F800000u) * 0x1p-7f;
    return ulp < 0x1p-133f ? 0x1p-133f : ulp;
}

#define KERNEL(NAME, TA, LOADA, LOAD8A, TB, LOADB, LOAD8B)                                                  \
    CLONES static void NAME(const TA *a, const TB *b, Py_ssize_t n, Sums *out) {                            \
        const v8f tiny = {0x1p-133f, 0x1p-133f, 0x1p-133f, 0x1p-133f, 0x1p-133f, 0x1p-133f, 0x1p-133f,      \
                          0x1p-133f};                                                                       \
        for (Py_ssize_t start = 0; start < n; start += BLOCK) {                                             \
            Py_ssize_t stop = start + BLOCK < n ? start + BLOCK : n, i = start;                             \
            v8d rs = {0}, qs = {0};                                                                         \
            v8i ch = {0}, bl = {0};                                                                         \
            for (; i + 8 <= stop; i += 8) {                                                                 \
                v8f x = LOAD8A(a + i), y = LOAD8B(b + i), d = y - x;                                        \
                v8f ulp = (v8f)((v8u)x & 0x7F800000u) * 0x1p-7f;                                            \
                v8i small = ulp < tiny;                                                                     \
                ulp = (v8f)(((v8i)ulp & ~small) | ((v8i)tiny & small));                                     \
                add_sq(&rs, x);                                                                              \
                add_sq(&qs, d);                                                                              \
                ch -= d != 0.0f;                                                                            \
                bl -= (v8f)((v8u)d & 0x7FFFFFFFu) < ulp;                                                    \
            }                                                                                               \
            double r = 0, q = 0;                                                                            \
            int64_t c = 0, u = 0;                                                                           \
            for (int k = 0; k < 8; k++) {                                                                   \
                r += rs[k];                                                                                 \
                q += qs[k];                                                                                 \
                c += ch[k];                                                                                 \
                u += bl[k];                                                                                 \
            }                                                                                               \
            for (; i < stop; i++) {                                                                         \
                float x = LOADA(a, i), y = LOADB(b, i), d = y - x;                                          \
                r += (double)x * x;                                                                         \
                q += (double)d * d;                                                                         \
                c += d != 0.0f;                                                                             \
                u += (d < 0 ? -d : d) < ulp_of(x);                                                          \
            }                                                                                               \
            out->ref += r;                                                                                  \
            out->dsq += q;                                                                                  \
            out->changed += c;                                                                              \
            out->below += u;                                                                                \
        }                                                                                                   \
    }

KERNEL(pair_bf16_bf16, uint16_t, load_bf16, load8_bf16, uint16_t, load_bf16, load8_bf16)
KERNEL(pair_f32_f32, float, load_f32, load8_f32, float, load_f32, load8_f32)
KERNEL(pair_bf16_f32, uint16_t, load_bf16, load8_bf16, float, load_f32, load8_f32)
KERNEL(pair_f32_bf16, float, load_f32, load8_f32, uint16_t, load_bf16, load8_bf16)

#define SUMSQ(NAME, TA, LOADA, LOAD8A)                                                                      \
    CLONES static void NAME(const TA *a, Py_ssize_t n, Sums *out) {                                         \
        for (Py_ssize_t start = 0; start < n; start += BLOCK) {                                             \
            Py_ssize_t stop = start + BLOCK < n ? start + BLOCK : n, i = start;                             \
            v8d rs = {0};                                                                                   \
            for (; i + 8 <= stop; i += 8) {                                                                 \
                v8f x = LOAD8A(a + i);                                                                      \
                add_sq(&rs, x);                                                                              \
            }                                                                                               \
            double r = 0;                                                                                   \
            for (int k = 0; k < 8; k++) r += rs[k];                                                         \
            for (; i < stop; i++) {                                                                         \
                float x = LOADA(a, i);                                                                      \
                r += (double)x * x;                                                                         \
            }                                                                                               \
            out->ref += r;                                                                                  \
        }                                                                                                   \
    }

SUMSQ(sumsq_bf16, uint16_t, load_bf16, load8_bf16)
SUMSQ(sumsq_f32, float, load_f32, load8_f32)

static int get_span(PyObject *obj, Py_ssize_t off, int dt, Py_ssize_t n, Py_buffer *view, const char **ptr) {
    if (dt != 0 && dt != 1) {
        PyErr_SetString(PyExc_ValueError, "dtype code must be 0 (float32) or 1 (bfloat16)");
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t size = dt == 0 ? 4 : 2;
    if (off < 0 || off > view->len || n < 0 || n > (view->len - off) / size) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "span outside the buffer");
        return -1;
    }
    *ptr = (const char *)view->buf + off;
    return 0;
}

static PyObject *stats(PyObject *self, PyObject *args) {
    PyObject *obj_a, *obj_b;
    Py_ssize_t off_a, off_b, n;
    int dt_a, dt_b;
    if (!PyArg_ParseTuple(args, "OniOnin", &obj_a, &off_a, &dt_a, &obj_b, &off_b, &dt_b, &n)) return NULL;
    Py_buffer va, vb;
    const char *pa, *pb = NULL;
    if (get_span(obj_a, off_a, dt_a, n, &va, &pa) < 0) return NULL;
    int pair = obj_b != Py_None;
    if (pair && get_span(obj_b, off_b, dt_b, n, &vb, &pb) < 0) {
        PyBuffer_Release(&va);
        return NULL;
    }
    Sums s = {0.0, 0.0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    if (!pair) {
        if (dt_a == 1) sumsq_bf16((const uint16_t *)pa, n, &s);
        else sumsq_f32((const float *)pa, n, &s);
    } else if (dt_a == 1 && dt_b == 1) pair_bf16_bf16((const uint16_t *)pa, (const uint16_t *)pb, n, &s);
    else if (dt_a == 0 && dt_b == 0) pair_f32_f32((const float *)pa, (const float *)pb, n, &s);
    else if (dt_a == 1) pair_bf16_f32((const uint16_t *)pa, (const float *)pb, n, &s);
    else pair_f32_bf16((const float *)pa, (const uint16_t *)pb, n, &s);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&va);
    if (pair) PyBuffer_Release(&vb);
    return Py_BuildValue("ddLL", s.ref, s.dsq, (long long)s.changed, (long long)s.below);
}

static PyMethodDef methods[] = {
    {"stats", stats, METH_VARARGS, "stats(buf_a, off_a, dt_a, buf_b, off_b, dt_b, n) -> (ref_sq, delta_sq, changed, below)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_diffkernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__diffkernel(void) { return PyModule_Create(&module); }
