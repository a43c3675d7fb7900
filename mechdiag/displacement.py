"""Weight displacement (paper-notes §4): per-tensor norms of W - W_ref and the study's grouped WDisp.

Per tensor: ref_fro = ||W_ref||_F, delta_fro = ||W - W_ref||_F, rel_fro = delta_fro / ref_fro.
Grouped:    wdisp = sqrt(sum_g ||W_g - W_g_ref||_F^2) / sqrt(sum_g ||W_g_ref||_F^2 + delta_w)   (eq. 10/12)
Update mass of a group: its share of the total squared displacement.

Each side's tensor is dense + sum of LoRA terms s*B@A. Dense parts are streamed a row chunk at a time in float32
(cast before subtracting) with float64 accumulators; LoRA terms stay factors (field-notes identities):
    ||B A||_F^2 = sum((B^T B) * (A A^T)),   <W, B A>_F = sum((B^T W) * A),   svdvals(B A) = svdvals(R_B R_A^T).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import torch

from mechdiag import adapters
from mechdiag.console import note
from mechdiag.errors import UserError
from mechdiag.metrics import DELTA_W, update_mass, update_mass_size_normalised, wdisp
from mechdiag.parts import output_axis, output_parts
from mechdiag.weights import (
    ConcatRef,
    Entry,
    LoraFactor,
    SafeFiles,
    Side,
    architecture,
    embedding_names,
    expert_index,
    is_tied,
    lm_head_names,
    open_side,
    regroup,
    tensor_site,
    tied_embedding,
)

try:
    from mechdiag import _diffkernel
except ImportError:  # built without a C compiler: the torch path below computes the same numbers
    _diffkernel = None

CHUNK_ELEMS = 1 << 20  # rows per read chunk ~ 1M elements: 4 MB in float32, the passes stay in cache
ROW_COLUMNS = ["name", "layer", "module", "shape", "dtype", "numel", "ref_fro", "delta_fro", "rel_fro",
               "frac_unchanged", "frac_sub_ulp", "lora_rank", "nonfinite", "part_of", "expert"]
SPECTRAL_COLUMNS = ["sigma_1", "stable_rank", "effective_rank"]
GEOMETRY_COLUMNS = ["overlap_k", "subspace_overlap", "intruders"]  # with --spectral too, see update_geometry
INTRUDER_TOP, INTRUDER_COS = 10, 0.5  # the tuned weight's top 10 singular vectors; |cos| below 0.5 = intruder
DENSE_OVERLAP_DIV = 16  # dense delta: k = min(m, n) // 16 (LoRA: k = the update's rank)
_F64 = torch.float64


# --- low-rank algebra -------------------------------------------------------------------------------------------


def lowrank_factors(plus: Iterable, minus: Iterable = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stack sum(s B A for plus) - sum(s B A for minus) as one product Bc @ Ac (float64), or None if empty.
    Items are objects with .scale, .B (out x r), .A (r x in)."""
    Bs, As = [], []
    for sign, terms in ((1.0, plus), (-1.0, minus)):
        for t in terms:
            Bs.append(t.B.detach().to(_F64) * (sign * t.scale))
            As.append(t.A.detach().to(_F64))
    if not Bs:
        return None
    return torch.cat(Bs, dim=1), torch.cat(As, dim=0)


def lowrank_sumsq(B: torch.Tensor, A: torch.Tensor) -> float:
    """||B @ A||_F^2 without forming B @ A: O((out + in) r^2)."""
    return float(((B.T @ B) * (A @ A.T)).sum())


def lowrank_svdvals(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Singular values of B @ A from an r x r problem: B = Q_B R_B, A^T = Q_A R_A, svdvals(R_B R_A^T)."""
    _, RB = torch.linalg.qr(B)
    _, RA = torch.linalg.qr(A.T)
    return torch.linalg.svdvals(RB @ RA.T)


def spectral_stats(s: torch.Tensor, sumsq: float) -> dict:
    """sigma_1, stable rank ||D||_F^2 / sigma_1^2, effective rank exp(H(s / sum s)) (Roy & Vetterli)."""
    s = s.to(_F64)
    s = s[s > 0]
    if s.numel() == 0 or not math.isfinite(sumsq):
        return {"sigma_1": 0.0 if math.isfinite(sumsq) else math.nan, "stable_rank": 0.0, "effective_rank": 0.0}
    sigma_1 = float(s.max())
    p = s / s.sum()
    return {"sigma_1": sigma_1, "stable_rank": sumsq / sigma_1 ** 2,
            "effective_rank": float(torch.exp(-(p * p.log()).sum()))}


def rel_fro(delta_fro: float, ref_fro: float) -> float:
    """delta_fro / ref_fro; for a zero reference (e.g. Gemma's zero-offset norms) inf if it moved, 0 if not."""
    if ref_fro > 0:
        return delta_fro / ref_fro
    return 0.0 if delta_fro == 0 else math.inf


# --- one tensor -------------------------------------------------------------------------------------------------


def _sumsq(x: torch.Tensor) -> float:
    """sum(x^2) of a float32 tensor in float64, where each square is exact (the C kernel's arithmetic; one float32
    norm over millions of elements drifts by 1e-4). A float64 dot per 1M-element slice of a reused buffer."""
    flat, total = x.reshape(-1), 0.0
    for start in range(0, flat.numel(), CHUNK_ELEMS):
        part = flat[start:start + CHUNK_ELEMS]
        buf = _scratch(3, part.numel(), _F64).copy_(part)
        total += float(torch.dot(buf, buf))
    return total


def _pow2_floor(w: torch.Tensor) -> torch.Tensor:
    """2^floor(log2|w|) from the float32 exponent bits (one bf16 ULP is this times 2^-7); the smallest normal
    float at zero and subnormal weights, so that an unchanged entry always counts as below one ULP."""
    return (w.view(torch.int32) & 0x7F800000).view(torch.float32).clamp_min_(1.1754944e-38)


def _count(x: torch.Tensor) -> int:
    """Sum of a 0/1 float32 tensor; float32 sums of ones are exact below 2^24 elements."""
    total = float(x.sum() if x.numel() < (1 << 24) else x.sum(dtype=_F64))
    return int(total) if math.isfinite(total) else 0  # NaN weights: the row is flagged nonfinite anyway


def _change_counts(d: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(entries changed, entries with |d| < one bf16 ULP of w, zeros included); overwrites d. Each count is one
    comparison written as 0/1 float32 into a reused buffer and a float32 sum: on CPU, comparisons into bool and
    count_nonzero are 10x slower. ULP = 2^floor(log2|w|) * 2^-7 from the exponent bits (exact, see _pow2_floor)."""
    t = _scratch(2, d.numel()).view(d.shape)
    changed = _count(torch.ne(d, 0, out=t))
    x = d.abs_()
    torch.bitwise_and(w.view(torch.int32), 0x7F800000, out=t.view(torch.int32))  # 2^floor(log2|w|), see _pow2_floor
    ulp = t.mul_(2.0 ** -7).clamp_min_(2.0 ** -133)  # 2^-133: zero and subnormal w, as _pow2_floor's clamp
    below = _count(torch.lt(x, ulp, out=t))
    return changed, below


_TLS = threading.local()


def _scratch(slot: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer of n elements, one per (thread, slot), reused chunk after chunk: fresh allocations of megabytes
    cost page faults on every chunk."""
    bufs = getattr(_TLS, "bufs", None)
    if bufs is None:
        bufs = _TLS.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = bufs[slot] = torch.empty(max(n, CHUNK_ELEMS), dtype=dtype)
    return buf[:n]


def _as_f32(x: torch.Tensor, slot: int) -> torch.Tensor:
    if x.dtype == torch.float32:
        return x
    return _scratch(slot, x.numel()).view(x.shape).copy_(x)


_KERNEL_DTYPES = {"F32": 0, "BF16": 1}


def kernel_enabled() -> bool:
    """The fused C kernel is used when it was built and MECHDIAG_KERNEL is not 0."""
    return _diffkernel is not None and os.environ.get("MECHDIAG_KERNEL", "1") != "0"


def fused_stats(files: SafeFiles, ref_a, ref_b=None) -> tuple[float, float, int, int] | None:
    """(sum a^2, sum (b-a)^2, entries changed, entries with |b-a| below one bf16 ULP of a) in one pass over the
    file pages (mechdiag/_diffkernel.c), or None when the kernel is off or takes neither dtype. ref_b None: a only."""
    if not kernel_enabled() or not isinstance(files, SafeFiles):  # a part's view: rows gathered, not one span
        return None
    if isinstance(ref_a, ConcatRef) or isinstance(ref_b, ConcatRef):  # several tensors' rows, not one span
        return None
    if ref_b is not None and ref_a.transposed != ref_b.transposed:  # the spans would pair other entries
        return None
    buf_a, off_a, dt_a, n = files.span(ref_a)
    buf_b, off_b, dt_b = (None, 0, "F32") if ref_b is None else files.span(ref_b)[:3]
    if dt_a not in _KERNEL_DTYPES or dt_b not in _KERNEL_DTYPES:
        return None
    return _diffkernel.stats(buf_a, off_a, _KERNEL_DTYPES[dt_a], buf_b, off_b, _KERNEL_DTYPES[dt_b], n)


def tensor_row(files: SafeFiles, name: str, ea: Entry, eb: Entry, spectral: bool = False,
               chunk_elems: int | None = None, experts: bool = False) -> dict:
    """Metrics of one tensor: reference = ea (dense + LoRA), tuned = eb (dense + LoRA)."""
    shape = files.shape(ea.dense)
    shape_b = files.shape(eb.dense)
    if shape != shape_b:
        raise UserError(f"tensor {name}: shape {'x'.join(map(str, shape))} vs {'x'.join(map(str, shape_b))}")
    if ea.delta is not None or eb.delta is not None:
        return _delta_row(files, name, ea, eb, shape, spectral, chunk_elems, experts)
    numel = math.prod(shape)
    same_dense = ea.dense == eb.dense
    ref_lr = lowrank_factors(ea.lora)  # LoRA on the reference side (adapter vs adapter)
    delta_lr = lowrank_factors(eb.lora, ea.lora)  # tuned LoRA minus reference LoRA, rank r_a + r_b

    rows = shape[0] if shape else 1
    cols = numel // rows if rows else 0
    step = max(1, (chunk_elems or CHUNK_ELEMS) // max(cols, 1))
    ref_sq = dense_sq = 0.0
    n_changed = n_below = 0
    ref_cross = None if ref_lr is None else torch.zeros_like(ref_lr[1])  # B_ref^T W0_ref, accumulated by rows
    delta_cross = None if (delta_lr is None or same_dense) else torch.zeros_like(delta_lr[1])  # Bc^T D
    gram = None
    dense_chunks = []  # spectral on a wide dense delta: keep it (one tensor in float32) for D D^T
    need_dense_spectral = spectral and not same_dense and len(shape) == 2
    fused = None  # one C pass when no LoRA cross term or dense spectrum needs the chunks themselves
    if ref_lr is None and not need_dense_spectral and (same_dense or delta_lr is None):
        fused = fused_stats(files, ea.dense, None if same_dense else eb.dense)
    if fused is not None:
        ref_sq, dense_sq, n_changed, n_below = fused
    else:
        for start in range(0, max(rows, 1), step):
            stop = min(start + step, rows)
            a = _as_f32(files.read(ea.dense, start, stop), 0)  # a view of the file when it is float32: read only
            ref_sq += _sumsq(a)
            if ref_cross is not None:
                ref_cross += ref_lr[0][start:stop].T @ a.to(_F64)
            if same_dense:
                continue
            b = files.read(eb.dense, start, stop)
            d = _scratch(1, a.numel()).view(a.shape).copy_(b).sub_(a)  # float32: cast before subtracting
            dense_sq += _sumsq(d)
            if delta_cross is not None:
                delta_cross += delta_lr[0][start:stop].T @ d.to(_F64)
            if need_dense_spectral:
                dd = d.to(_F64) if delta_lr is None else d.to(_F64) + delta_lr[0][start:stop] @ delta_lr[1]
                if cols <= rows:
                    gram = dd.T @ dd if gram is None else gram.add_(dd.T @ dd)
                else:
                    dense_chunks.append(dd.to(torch.float32))
            if delta_lr is None:  # full fine-tune: unchanged entries, and changes below one bf16 ULP of the weight
                changed, below = _change_counts(d, a)
                n_changed += changed
                n_below += below

    if ref_lr is not None:
        ref_sq += 2.0 * float((ref_cross * ref_lr[1]).sum()) + lowrank_sumsq(*ref_lr)
    delta_sq = dense_sq
    if delta_lr is not None:
        delta_sq += lowrank_sumsq(*delta_lr)
        if delta_cross is not None:
            delta_sq += 2.0 * float((delta_cross * delta_lr[1]).sum())
    delta_sq = max(delta_sq, 0.0) if math.isfinite(delta_sq) else math.nan
    nonfinite = not (math.isfinite(ref_sq) and math.isfinite(delta_sq))
    ref_fro, delta_fro = math.sqrt(ref_sq) if math.isfinite(ref_sq) else math.nan, math.sqrt(delta_sq)
    full_finetune = not same_dense and delta_lr is None
    layer, module = tensor_site(name, experts)
    row = {
        "name": name, "layer": layer, "module": module, "shape": "x".join(map(str, shape)),
        "dtype": files.dtype(eb.dense), "numel": numel, "ref_fro": ref_fro, "delta_fro": delta_fro,
        "rel_fro": rel_fro(delta_fro, ref_fro),
        "frac_unchanged": (numel - n_changed) / numel if full_finetune and numel else None,
        "frac_sub_ulp": (n_below - (numel - n_changed)) / numel if full_finetune and numel else None,
        "lora_rank": int(delta_lr[1].shape[0]) if delta_lr is not None else None,
        "nonfinite": nonfinite, "part_of": None, "expert": expert_index(name),
    }
    if nonfinite:
        row["rel_fro"] = math.nan
    if spectral:
        row.update(_spectral(shape, same_dense, delta_lr, gram, dense_chunks, delta_sq, nonfinite))
        read_tuned = None if same_dense else (lambda start, stop: files.read(eb.dense, start, stop))
        row.update(_geometry(lambda start, stop: files.read(ea.dense, start, stop), read_tuned, shape, ref_lr,
                             delta_lr, delta_sq, nonfinite, chunk_elems))
    return row


def _side_rows(files, e: Entry, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored rows, their float64 additions: LoRA terms multiplied out for these rows and the form's delta)."""
    dense = files.read(e.dense, start, stop)
    extra = torch.zeros(dense.shape, dtype=_F64)
    for t in e.lora:
        extra += t.scale * (t.B[start:stop].to(_F64) @ t.A.to(_F64))
    if e.delta is not None:
        extra += e.delta.rows(start, stop)
    return dense, extra


def _delta_row(files, name: str, ea: Entry, eb: Entry, shape, spectral: bool, chunk_elems, experts: bool) -> dict:
    """tensor_row where a side's update is not low-rank (mechdiag.adapters): both sides' rows in float64, the
    difference of the stored values taken in float64 (exact) plus the difference of their float64 additions."""
    numel = math.prod(shape)
    rows = shape[0] if shape else 1
    cols = numel // rows if rows else 0
    step = max(1, (chunk_elems or CHUNK_ELEMS) // max(cols, 1))
    ref_sq = delta_sq = 0.0
    gram, kept = None, []
    for start in range(0, max(rows, 1), step):
        stop = min(start + step, rows)
        a, xa = _side_rows(files, ea, start, stop)
        b, xb = _side_rows(files, eb, start, stop)
        ref = a.to(_F64) + xa
        d = (b.to(_F64) - a.to(_F64)) + (xb - xa)
        ref_sq += float((ref * ref).sum())
        delta_sq += float((d * d).sum())
        if spectral and len(shape) == 2:
            if cols <= rows:
                gram = d.T @ d if gram is None else gram.add_(d.T @ d)
            else:
                kept.append(d)
    nonfinite = not (math.isfinite(ref_sq) and math.isfinite(delta_sq))
    ref_fro = math.sqrt(ref_sq) if math.isfinite(ref_sq) else math.nan
    delta_fro = math.sqrt(delta_sq) if math.isfinite(delta_sq) else math.nan
    layer, module = tensor_site(name, experts)
    row = {"name": name, "layer": layer, "module": module, "shape": "x".join(map(str, shape)),
           "dtype": files.dtype(eb.dense), "numel": numel, "ref_fro": ref_fro, "delta_fro": delta_fro,
           "rel_fro": math.nan if nonfinite else rel_fro(delta_fro, ref_fro), "frac_unchanged": None,
           "frac_sub_ulp": None, "lora_rank": None, "nonfinite": nonfinite, "part_of": None,
           "expert": expert_index(name)}
    if spectral:
        row.update(_spectral(shape, False, None, gram, [k.to(torch.float32) for k in kept], delta_sq, nonfinite))

        def read(e):
            return lambda start, stop: (lambda d, x: d.to(_F64) + x)(*_side_rows(files, e, start, stop))
        row.update(_geometry(read(ea), read(eb), shape, None, None, delta_sq, nonfinite, chunk_elems))
    return row


class _PartView:
    """The SafeFiles interface over one part of every tensor it reads: the output features `idx` on `axis`
    (rows of a Linear weight or a bias, columns of a Conv1D weight), gathered a chunk of part rows at a time."""

    def __init__(self, files: SafeFiles, idx: torch.Tensor, axis: int):
        self.files, self.idx, self.axis = files, idx, axis

    def shape(self, ref) -> tuple[int, ...]:
        shape = list(self.files.shape(ref))
        shape[self.axis] = len(self.idx)
        return tuple(shape)

    def dtype(self, ref) -> str:
        return self.files.dtype(ref)

    def read(self, ref, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        if self.axis == 1:
            return self.files.read(ref, start, stop)[:, self.idx]
        rows = self.idx[slice(start, stop)]
        if rows.numel() == 0:
            return self.files.read(ref, 0, 0)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        return self.files.read(ref, lo, hi)[rows - lo]


def restrict(terms, idx: torch.Tensor, axis: int) -> list[LoraFactor]:
    """LoRA terms of a part: the part's output features of s B A are B[idx] A (axis 0) or B A[:, idx] (axis 1,
    Conv1D's stored orientation), still factors."""
    return [LoraFactor(t.scale, t.B[idx], t.A) if axis == 0 else LoraFactor(t.scale, t.B, t.A[:, idx])
            for t in terms]


def _restricted(e: Entry, idx: torch.Tensor, axis: int) -> Entry:
    return Entry(e.dense, restrict(e.lora, idx, axis), None if e.delta is None else e.delta.restrict(idx, axis))


def part_rows(files: SafeFiles, name: str, ea: Entry, eb: Entry, config: dict, spectral: bool = False,
              experts: bool = False) -> list[dict]:
    """One row per logical part of a fused tensor (mechdiag.parts), every column computed as for a tensor, module
    MODULE.PART and part_of MODULE; [] when the tensor is not fused."""
    layer, module = tensor_site(name, experts)
    shape = files.shape(ea.dense)
    if len(shape) not in (1, 2):
        return []
    axis = output_axis(config, len(shape))
    out = []
    for part, idx in output_parts(module.rsplit(".", 1)[-1], shape[axis], config):
        view = _PartView(files, idx, axis)
        row = tensor_row(view, name, _restricted(ea, idx, axis), _restricted(eb, idx, axis), spectral,
                         experts=experts)
        out.append({**row, "name": f"{name}[{part}]", "module": f"{module}.{part}", "part_of": module})
    return out


def _geometry(read_ref, read_tuned, shape, ref_lr, delta_lr, delta_sq, nonfinite, chunk_elems) -> dict:
    """subspace_overlap and intruders (see update_geometry) from three p x p matrices, p = min(m, n), with the
    weight oriented tall as X (big x p): G = X^T X (reference), C = X^T D, H = D^T D. LoRA terms stay factors:
    D = dense part + Bx Ax gives C = X^T d + (X^T Bx) Ax and H = d^T d + (d^T Bx) Ax + (..)^T + Ax^T (Bx^T Bx) Ax;
    a reference with its own LoRA, X = a + Bc Ac, expands the same way. Its own pass over the tensor (a wide one
    is read whole, one tensor at a time): read_ref(start, stop) gives rows of the reference's dense part,
    read_tuned likewise for the tuned side, None when both sides share it (factors on CPU)."""
    same_dense = read_tuned is None
    if len(shape) != 2 or nonfinite or delta_sq == 0 or not math.isfinite(delta_sq):
        return dict.fromkeys(GEOMETRY_COLUMNS, None)
    m, n = shape
    tall = n <= m
    p = min(m, n)
    # factors in X's orientation: W = B A  ->  W^T = A^T B^T
    def orient(lr):
        return None if lr is None else (lr if tall else (lr[1].T, lr[0].T))
    ref_x, delta_x = orient(ref_lr), orient(delta_lr)
    G, C, H = (torch.zeros(p, p, dtype=_F64) for _ in range(3))  # from the dense parts: a^T a, a^T d, d^T d
    P = None if delta_x is None else torch.zeros(p, delta_x[0].shape[1], dtype=_F64)  # a^T Bx
    Q = None if delta_x is None or same_dense else torch.zeros_like(P)  # d^T Bx
    Ra = None if ref_x is None else torch.zeros(p, ref_x[0].shape[1], dtype=_F64)  # a^T Bc (the reference's own LoRA)
    Rd = None if ref_x is None or same_dense else torch.zeros_like(Ra)  # d^T Bc
    step = max(1, (chunk_elems or CHUNK_ELEMS) // n) if tall else m
    for start in range(0, m, step):
        stop = min(start + step, m)
        a32 = read_ref(start, stop).to(torch.float32)
        d = None if same_dense else (read_tuned(start, stop).to(torch.float32) - a32).to(_F64)  # as above
        a = a32.to(_F64)
        if not tall:
            a, d = a.T, (None if d is None else d.T)
        lo, hi = (start, stop) if tall else (0, n)
        G += a.T @ a
        if d is not None:
            C += a.T @ d
            H += d.T @ d
        for acc, left, lr in ((P, a, delta_x), (Q, d, delta_x), (Ra, a, ref_x), (Rd, d, ref_x)):
            if acc is not None:
                acc += left.T @ lr[0][lo:hi]
    if ref_x is not None:  # X = a + Bc Ac: expand X^T X, X^T d, X^T Bx without forming Bc Ac
        Bc, Ac = ref_x
        G += Ra @ Ac + Ac.T @ Ra.T + Ac.T @ ((Bc.T @ Bc) @ Ac)
        if Rd is not None:
            C += Ac.T @ Rd.T
        if P is not None:
            P += Ac.T @ (Bc.T @ delta_x[0])
    if delta_x is not None:  # D = d + Bx Ax
        Bx, Ax = delta_x
        C += P @ Ax
        H += Ax.T @ ((Bx.T @ Bx) @ Ax)
        if Q is not None:
            QA = Q @ Ax
            H += QA + QA.T
    k = int(delta_lr[1].shape[0]) if delta_lr is not None else max(1, p // DENSE_OVERLAP_DIV)
    return update_geometry(G, C, H, k, delta_sq)


def update_geometry(G: torch.Tensor, C: torch.Tensor, H: torch.Tensor, k: int, delta_sq: float) -> dict:
    """Update geometry from p x p float64 matrices of the tall-oriented reference X and update D (p = min(m, n)):
    G = X^T X, C = X^T D, H = D^T D.
    subspace_overlap = ||U_k^T D V_k||_F^2 / ||D||_F^2: the share of the update's squared norm inside the span of
    the reference's top-k left and right singular vectors (U_k = X V_k / s_k, so U_k^T D V_k = S_k^-1 V_k^T C V_k).
    intruders = how many of the tuned weight's top-10 singular vectors (small side; from eig of
    (X + D)^T (X + D) = G + C + C^T + H) have |cos| < 0.5 with every singular vector of the reference."""
    ev, V = torch.linalg.eigh(G)
    ev, V = ev.flip(0), V.flip(1)  # descending
    k = min(k, int((ev > ev[0] * 1e-24).sum())) if ev.numel() and ev[0] > 0 else 0
    overlap = None
    if k > 0 and delta_sq > 0:
        Vk, sk = V[:, :k], ev[:k].sqrt()
        M = (Vk.T @ C @ Vk) / sk[:, None]
        overlap = float((M * M).sum()) / delta_sq
    T = G + C + C.T + H
    _, Vt = torch.linalg.eigh((T + T.T) / 2)
    top = Vt.flip(1)[:, :INTRUDER_TOP]
    best_cos = (V.T @ top).abs().max(dim=0).values
    return {"overlap_k": k, "subspace_overlap": overlap, "intruders": int((best_cos < INTRUDER_COS).sum())}


def _spectral(shape, same_dense, delta_lr, gram, dense_chunks, delta_sq, nonfinite) -> dict:
    if len(shape) != 2 or nonfinite:
        return dict.fromkeys(SPECTRAL_COLUMNS, math.nan if nonfinite else None)
    if same_dense:
        s = lowrank_svdvals(*delta_lr) if delta_lr is not None else torch.zeros(0)
        return spectral_stats(s, delta_sq)
    if gram is None:  # wide matrix: D D^T from the kept chunks
        d = torch.cat(dense_chunks).to(_F64)
        gram = d @ d.T
    s = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    s = s[s > s.max() * 1e-7] if s.numel() else s  # eigenvalues of a Gram matrix below eps*sigma_1^2 are noise
    return spectral_stats(s, delta_sq)


# --- whole checkpoints ------------------------------------------------------------------------------------------


def pair_names(a: Side, b: Side) -> list[str]:
    """Names compared, in the reference's order. A tied lm_head is counted once (as the embedding); an untied head
    (tie_word_embeddings false) against a tied side is compared with that side's embedding, as an lm_head row."""
    arch_a, arch_b = architecture(a), architecture(b)
    if arch_a and arch_b and arch_a != arch_b:
        raise UserError(f"different architectures: {a.label} is {arch_a}, {b.label} is {arch_b}")
    for head in lm_head_names():  # an untied head against a tied side: that side's head is its embedding
        for side, other in ((a, b), (b, a)):
            tied_to = tied_embedding(side)
            if head in other.entries and not is_tied(other) and tied_to is not None:
                side.entries[head] = Entry(side.entries[tied_to].dense, list(side.entries[tied_to].lora))
    names_a, names_b = list(a.entries), set(b.entries)
    has_embedding = any(e in a.entries and e in b.entries for e in embedding_names())
    skip = set()
    for head in lm_head_names():
        in_a, in_b = head in a.entries, head in names_b
        if (in_a != in_b and has_embedding) or (in_a and in_b and is_tied(a) and is_tied(b)):
            skip.add(head)  # tied to the embedding: saved on one side only, or declared tied on both
    only_a = [n for n in names_a if n not in names_b and n not in skip]
    only_b = sorted(n for n in names_b if n not in a.entries and n not in skip)
    for only, side, other in ((only_a, a, b), (only_b, b, a)):
        if only:
            more = f" (and {len(only) - 1} more)" if len(only) > 1 else ""
            raise UserError(f"tensor {only[0]}{more} is in {side.label} but not in {other.label}")
    if not names_a:
        raise UserError(f"{a.label}: no tensors")
    return [n for n in names_a if n not in skip]


def _rows_of(files, name, ea, eb, config, spectral, experts) -> list[dict]:
    try:
        sa, sb = files.shape(ea.dense), files.shape(eb.dense)
        if sa != sb:  # a resized vocabulary (resized_rows checked it): the shared rows, then the rows one side adds
            return resized_rows(files, name, ea, eb, sa, sb, spectral, experts)
        return [tensor_row(files, name, ea, eb, spectral, experts=experts),
                *part_rows(files, name, ea, eb, config, spectral, experts)]
    finally:
        for e in (ea, eb):
            if e.delta is not None:
                e.delta.release()


def resizable(name: str, sa: tuple, sb: tuple) -> bool:
    """An embedding or output head whose vocabulary was resized (added tokens): same width, other row count."""
    return (name in embedding_names() or name in lm_head_names()) and len(sa) == len(sb) == 2 and sa[1] == sb[1]


def resized_rows(files, name, ea, eb, sa, sb, spectral, experts) -> list[dict]:
    """A resized vocabulary: the tensor's row over the rows both sides have, and one row `NAME[added]` (or
    `[removed]`, tuned smaller) for the rows only one side has: delta_fro their norm, ref_fro 0, part_of the
    module, so it is reported apart and left out of the layer and whole-model totals."""
    n = min(sa[0], sb[0])
    idx = torch.arange(n)
    view = _PartView(files, idx, 0)
    row = tensor_row(view, name, _restricted(ea, idx, 0), _restricted(eb, idx, 0), spectral, experts=experts)
    big, more = (eb, sb) if sb[0] > sa[0] else (ea, sa)
    sq = 0.0
    step = max(1, CHUNK_ELEMS // max(more[1], 1))
    for start in range(n, more[0], step):
        stop = min(start + step, more[0])
        dense, extra = _side_rows(files, big, start, stop)
        x = dense.to(_F64) + extra
        sq += float((x * x).sum())
    layer, module = tensor_site(name, experts)
    what = "added" if big is eb else "removed"
    extra_row = {**dict.fromkeys(row), "name": f"{name}[{what}]", "layer": layer, "module": f"{module}.{what}",
                 "shape": f"{more[0] - n}x{more[1]}", "dtype": row["dtype"], "numel": (more[0] - n) * more[1],
                 "ref_fro": 0.0, "delta_fro": math.sqrt(sq), "rel_fro": rel_fro(math.sqrt(sq), 0.0),
                 "nonfinite": not math.isfinite(sq), "part_of": module, "expert": None}
    return [row, extra_row]


def compare(a, b, base=None, spectral: bool = False, progress: Callable[[int, int], None] | None = None,
            files: SafeFiles | None = None, workers: int | None = None, experts: bool = False,
            against: str = "original") -> list[dict]:
    """Per-tensor rows for reference A vs tuned B (paths: model folder, .safetensors file, or LoRA adapter), each
    fused tensor followed by its parts (part_of set; mechdiag.parts). experts: a mixture-of-experts' expert
    modules per expert (experts.5.up_proj) instead of aggregated (experts.up_proj). against: an adapter whose
    init rewrote the base is measured against the original base (default) or the residual (mechdiag.adapters).
    Tensors are processed by `workers` threads (default: up to 2 cores), each running single-threaded torch ops:
    on a busy machine this beats intra-op threads, whose barriers stall when cores are oversubscribed."""
    files = files or SafeFiles()
    side_a = open_side(a, files, base=base, other=b, against=against)
    side_b = open_side(b, files, base=base, other=a, against=against)
    for side, other in ((side_a, side_b), (side_b, side_a)):  # an adapter's experts, named as the model does
        regroup(other.entries, side.regroup)
        if side.note:
            note(side.note)
        if not other.is_adapter:  # --against residual: the base side is the residual an init left
            for n, d in side.reference.items():
                other.entries[n].delta = d
    names = pair_names(side_a, side_b)
    for n in names:  # every bad shape is reported before any work
        sa, sb = files.shape(side_a.entries[n].dense), files.shape(side_b.entries[n].dense)
        if sa != sb and not resizable(n, sa, sb):
            raise UserError(f"tensor {n}: shape {'x'.join(map(str, sa))} vs {'x'.join(map(str, sb))}")
    sizes = [max(1, math.prod(files.shape(side_a.entries[n].dense))) for n in names]
    total, done = sum(sizes), 0
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    with single_thread():
        pool = ThreadPoolExecutor(workers)
        try:
            config = side_b.config or side_a.config
            futures = [pool.submit(_rows_of, files, n, side_a.entries[n], side_b.entries[n], config, spectral,
                                   experts) for n in names]
            out = []
            for fut, size in zip(futures, sizes, strict=True):
                out.extend(fut.result())
                done += size
                if progress is not None:
                    progress(done, total)
            return out
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def single_thread():
    """Run torch ops on the calling thread only. The low-rank algebra is r x r work, and on a busy machine
    intra-op threads stall at their barriers: a 16 x 4864 Gram takes 60 ms with 2 threads, 0.2 ms with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rows_frame(rows: list[dict], spectral: bool = False) -> pd.DataFrame:
    cols = ROW_COLUMNS + (SPECTRAL_COLUMNS + GEOMETRY_COLUMNS if spectral else [])
    df = pd.DataFrame(rows, columns=cols)
    for c in ("layer", "lora_rank", "expert", *(("overlap_k", "intruders") if spectral else ())):
        df[c] = df[c].astype("Int64")
    for c in ("frac_unchanged", "frac_sub_ulp", *(SPECTRAL_COLUMNS + ["subspace_overlap"] if spectral else ())):
        df[c] = df[c].astype(float)
    df["nonfinite"] = df["nonfinite"].astype(bool)
    return df


def _keys(df: pd.DataFrame, by: str) -> list[str]:
    if by not in ("module", "layer", "all"):
        raise UserError(f"--by must be tensor, module, layer or all, not {by!r}")
    keys = ["step"] if "step" in df.columns else []
    return keys + ([] if by == "all" else [by])


def group_wdisp(rows_df: pd.DataFrame, by: str = "module", delta_w: float = DELTA_W) -> pd.DataFrame:
    """The study's WDisp per group (per step too when rows carry a step column).
    Columns: [step], key, n_tensors, ref_fro, delta_fro, wdisp, update_mass, update_mass_size_normalised
    (mechdiag.metrics.update_mass, update_mass_size_normalised). Non-finite rows are left out; a fused tensor's parts
    are groups of their own by module (a share of the same total as the whole tensors), and left out of layers and
    the whole model."""
    df = rows_df.copy()
    if "nonfinite" in df.columns:
        df = df[~df["nonfinite"].astype(bool)]
    part = df["part_of"].notna() & (df["part_of"] != "") if "part_of" in df.columns else pd.Series(False, df.index)
    if by != "module":
        df, part = df[~part], part[~part]
    df["is_part"] = part.astype(bool)
    df = df[df["ref_fro"].notna() & df["delta_fro"].notna()]
    df["ref_sq"] = df["ref_fro"].astype(float) ** 2
    df["delta_sq"] = df["delta_fro"].astype(float) ** 2
    keys = _keys(df, by)
    if keys:
        g = df.groupby(keys, dropna=False, sort=True).agg(n_tensors=("ref_sq", "size"), ref_sq=("ref_sq", "sum"),
                                                          delta_sq=("delta_sq", "sum"),
                                                          is_part=("is_part", "any")).reset_index()
    else:
        g = pd.DataFrame({"n_tensors": [len(df)], "ref_sq": [df["ref_sq"].sum()], "delta_sq": [df["delta_sq"].sum()],
                          "is_part": [False]})
    if by == "all":
        g.insert(len(keys), "all", "all")
    g["ref_fro"] = g["ref_sq"] ** 0.5
    g["delta_fro"] = g["delta_sq"] ** 0.5
    g["wdisp"] = wdisp(g["delta_sq"], g["ref_sq"], delta_w)
    parts = [part for _, part in g.groupby("step")] if "step" in g.columns else [g]
    for col, mass in (("update_mass", update_mass), ("update_mass_size_normalised", update_mass_size_normalised)):
        shares = {}
        for part in parts:  # shares within each recorded step
            rows = [{"group": i, "delta_fro": d, "ref_fro": r, "part_of": "part" if p else None} for i, d, r, p in
                    zip(part.index, part["delta_fro"], part["ref_fro"], part["is_part"], strict=True)]
            shares.update(mass(rows, "group", parts=True))
        g[col] = [shares.get(i, 0.0) for i in g.index]
    if by == "layer":
        g["layer"] = g["layer"].astype("Int64")
    return g.drop(columns=["ref_sq", "delta_sq", "is_part"])


def displacement(a, b, base=None, by: str = "tensor", spectral: bool = False, experts: bool = False,
                 against: str = "original") -> pd.DataFrame:
    """Python API: a DataFrame of per-tensor rows (by="tensor") or grouped WDisp (by="module"|"layer"|"all");
    experts: a mixture-of-experts' expert modules one per expert; against: see compare."""
    if by not in ("tensor", "module", "layer", "all"):
        raise UserError(f"by must be tensor, module, layer or all, not {by!r}")
    df = rows_frame(compare(a, b, base=base, spectral=spectral, experts=experts, against=against), spectral)
    return df if by == "tensor" else group_wdisp(df, by=by)


# --- in-memory PEFT models (the trainer's recorder) -------------------------------------------------------------

_REF_SQ_CACHE: dict[tuple, tuple] = {}  # (id(frozen base weight), part) -> (weakref, version, ||W||^2)


class _Term:
    __slots__ = ("scale", "B", "A")

    def __init__(self, scale, B, A):
        self.scale, self.B, self.A = scale, B, A


def _base_sumsq(w: torch.Tensor, key: str = "", get=None) -> float:
    """||W||^2 of a frozen base weight, or of the slice of it get() returns (a part, one expert) named `key`,
    cached while the weight is unchanged."""
    cache = (id(w), key)
    hit = _REF_SQ_CACHE.get(cache)
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    x = (w if get is None else get()).detach()
    value = _sumsq(x.to(torch.float32))  # the checkpoint path's arithmetic, so both give the same numbers
    _REF_SQ_CACHE[cache] = (weakref.ref(w, lambda _, k=cache: _REF_SQ_CACHE.pop(k, None)), w._version, value)
    return value


def lora_rows(model, geometry: bool = False, engine=None) -> list[dict]:
    """One row per LoRA-wrapped weight of an in-memory PEFT model: reference = base weight, tuned = base + the
    active adapters' s*B@A. Factors only, float64; ||W0|| is cached while the base weight is unchanged.
    geometry: also overlap_k, subspace_overlap and intruders, by the routine of `displacement --spectral` (one
    pass over each base weight: the trainers ask for it at the final step only).
    engine: a mechdiag.distributed.Engine when the model is sharded (every rank calls this together; the
    parameters are gathered a module at a time and the frozen base's norms computed once, by name)."""
    with torch.no_grad(), single_thread():
        return _lora_rows(model, geometry, engine)


def _lora_rows(model, geometry: bool, engine=None) -> list[dict]:
    config = getattr(model, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else {}
    rows = []
    if engine is None:
        modules = ((p, m) for p, m in model.named_modules() if _is_tuner_layer(m))
        full = _same
    else:
        cache = engine.base_sq
        modules = engine.lora_modules(model, need_base=lambda p: geometry or _row_name(p) not in cache)
        full = engine.full
    for path, mod in modules:
        if getattr(mod, "merged", False):
            raise ValueError(f"{path}: adapter is merged into the base weight; unmerge before lora_rows")
        if hasattr(mod, "get_param") and hasattr(mod, "num_experts"):  # peft target_parameters (MoE experts)
            rows.extend(_expert_rows(path, mod, config, geometry))
            continue
        if not _plain_lora_layer(mod):  # DoRA, lora_bias, any other peft type: its dense delta (mechdiag.adapters)
            if engine is not None:
                raise RuntimeError(f"{path}: a {type(mod).__name__} adapter is measured from its dense delta, which "
                                   "needs the whole weight; record it unsharded")
            rows.extend(_dense_rows(path, mod, config))
            continue
        terms = _lora_terms(path, mod, full)
        if not terms:
            continue
        name = _row_name(path)
        layer, module = tensor_site(name)
        base_w = None
        if engine is None:
            base_w = mod.get_base_layer().weight
            if base_w.dim() < 2 or not base_w.numel():  # ZeRO-3 / FSDP partition: ||W0|| would read 0
                raise RuntimeError(f"{path}: the base weight is sharded; record under mechdiag.distributed.Engine")
        elif geometry or name not in engine.base_sq:
            base_w = full(mod.get_base_layer().weight)
            engine.base_shape[name] = tuple(base_w.shape)
        shape = tuple(base_w.shape) if base_w is not None else engine.base_shape[name]
        axis = output_axis(config, len(shape))
        sites = [(name, module, "", None)] + [(f"{name}[{part}]", f"{module}.{part}", part, idx)
                                              for part, idx in output_parts(module, shape[axis], config)]
        for row_name, row_module, part, idx in sites:
            get, sub = None, terms
            if idx is not None:
                get = None if base_w is None else (lambda w=base_w, i=idx, a=axis: w.index_select(a, i.to(w.device)))
                sub = restrict(terms, idx.to(terms[0].B.device), axis)
            if engine is None:
                ref_sq = _base_sumsq(base_w, part, get)
            else:  # frozen: computed once from the gathered weight, by name
                if row_name not in engine.base_sq:
                    engine.base_sq[row_name] = _sumsq((base_w if get is None else get()).detach().to(torch.float32))
                ref_sq = engine.base_sq[row_name]
            row = _lora_row(row_name, layer, row_module, base_w, sub, geometry, ref_sq, get)
            rows.append({**row, "part_of": module} if part else row)
    return rows


def _is_tuner_layer(m) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: PLC0415 - peft loads with the first model

    return isinstance(m, BaseTunerLayer) and hasattr(m, "get_base_layer") and bool(getattr(m, "active_adapters", ()))


def _plain_lora_layer(mod) -> bool:
    """A LoRA layer whose active adapters are all s B A (no DoRA magnitude, no lora_bias): kept as factors."""
    from peft.tuners.adalora import AdaLoraLayer  # noqa: PLC0415
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    if not isinstance(mod, LoraLayer) or isinstance(mod, AdaLoraLayer):
        return False
    variant, lora_bias = getattr(mod, "lora_variant", {}), getattr(mod, "lora_bias", {})
    return not any(variant.get(a) is not None or lora_bias.get(a) for a in mod.active_adapters)


def _dense_rows(path: str, mod, config: dict) -> list[dict]:
    """Rows of a peft layer whose update is not low-rank: its float64 delta from peft's merge (the definition
    displacement replays from the files, mechdiag.adapters.module_delta), the weight, its parts, and its bias when
    the form moves it."""
    dw, db = adapters.module_delta(mod)
    base = mod.get_base_layer()
    name = _row_name(path)
    layer, module = tensor_site(name)
    w = base.weight.detach()
    axis = output_axis(config, w.dim())
    rows = []
    sites = [(name, module, "", None)] + [(f"{name}[{part}]", f"{module}.{part}", part, idx)
                                          for part, idx in output_parts(module, w.shape[axis], config)]
    for row_name, row_module, part, idx in sites:
        get = None if idx is None else (lambda i=idx: w.index_select(axis, i.to(w.device)))
        d = dw if idx is None else dw.index_select(axis, idx.to(dw.device))
        ref_fro, delta_fro = math.sqrt(_base_sumsq(w, part, get)), float(d.norm())
        row = {"name": row_name, "layer": layer, "module": row_module, "ref_fro": ref_fro, "delta_fro": delta_fro,
               "rel_fro": rel_fro(delta_fro, ref_fro)}
        rows.append({**row, "part_of": module} if part else row)
    if db is not None and bool(db.any()):
        ref_fro, delta_fro = float(base.bias.detach().double().norm()), float(db.norm())
        rows.append({"name": name.removesuffix(".weight") + ".bias", "layer": layer, "module": module,
                     "ref_fro": ref_fro, "delta_fro": delta_fro, "rel_fro": rel_fro(delta_fro, ref_fro)})
    return rows


def _lora_terms(path: str, mod, full) -> list[_Term]:
    """The active adapters' (s, B, A) of a LoRA layer, whole (full() gathers a sharded factor), B A in the
    stored weight's orientation."""
    transposed = bool(getattr(mod, "fan_in_fan_out", False))
    terms = []
    for adapter in mod.active_adapters:
        if adapter in mod.lora_A:
            A, B = mod.lora_A[adapter].weight, mod.lora_B[adapter].weight
            t = transposed
        elif adapter in getattr(mod, "lora_embedding_A", {}):
            A, B, t = mod.lora_embedding_A[adapter], mod.lora_embedding_B[adapter], True
        else:
            continue
        A, B = full(A), full(B)
        if A.dim() != 2 or B.dim() != 2 or not A.numel():  # a shard: a figure from it would be a silent 0
            raise RuntimeError(f"{path}: LoRA factors are sharded (shape {tuple(A.shape)}); record under "
                               "mechdiag.distributed.Engine, which gathers them")
        B, A = (A.T, B.T) if t else (B, A)
        terms.append(_Term(float(mod.scaling[adapter]), B, A))
    return terms


def _lora_row(name, layer, module, base_w, terms, geometry, ref_sq: float, get=None) -> dict:
    """One row of lora_rows: the weight base_w (||W||^2 = ref_sq), or the slice get() returns (a part, an expert),
    its update from the (restricted) terms."""
    B, A = lowrank_factors(terms)
    delta_sq = lowrank_sumsq(B, A)
    ref_fro, delta_fro = math.sqrt(ref_sq), math.sqrt(max(delta_sq, 0.0))
    row = {"name": name, "layer": layer, "module": module, "ref_fro": ref_fro, "delta_fro": delta_fro,
           "rel_fro": rel_fro(delta_fro, ref_fro)}
    if geometry:
        nonfinite = not (math.isfinite(ref_sq) and math.isfinite(delta_sq))
        w = base_w if get is None else get()
        row.update(_geometry(lambda start, stop, w=w: w[start:stop].to("cpu"), None, tuple(w.shape),
                             None, (B.cpu(), A.cpu()), max(delta_sq, 0.0), nonfinite, None))
    return row


def _expert_rows(path: str, mod, config: dict, geometry: bool) -> list[dict]:
    """Rows of a LoRA on a parameter (peft's ParamWrapper, target_parameters): one per expert of a 3-D expert
    stack [E, ., .], named as transformers saves the experts (mlp.experts.5.gate_up_proj.weight), with the fused
    parts of each. peft's layout: lora_A (E*r, in) -> A_e (r, in); lora_B (out, r*E) -> B_e = B[:, :, e] after
    (out, r, E); each expert's update is B_e A_e out x in: a stack stored [E, in, out] (is_transposed, peft did not
    swap it: GPT-OSS) is read per expert as its transpose, out x in as displacement reads the files."""
    param = mod.get_param()
    swapped = bool(getattr(mod, "_did_swap_in_out_features", False)) or param.ndim == 2
    stack = param[None] if param.ndim == 2 else param if swapped else param.transpose(1, 2)
    E = stack.shape[0]
    per_expert: list[list[_Term]] = [[] for _ in range(E)]
    for name in mod.active_adapters:
        if name not in mod.lora_A:
            continue
        A, B = mod.lora_A[name].weight, mod.lora_B[name].weight
        A3 = A.reshape(E, -1, A.shape[-1])  # (E, r, in)
        B3 = B.reshape(B.shape[0], -1, E).permute(2, 0, 1)  # (E, out, r)
        for e in range(E):
            per_expert[e].append(_Term(float(mod.scaling[name]), B3[e], A3[e]))
    prefix = path.removeprefix("base_model.model.").replace(".base_layer", "")  # peft nests one wrapper per parameter
    rows = []
    for e, terms in enumerate(per_expert):
        if not terms:
            continue
        name = f"{prefix}.{e}.{mod.parameter_name}.weight" if param.ndim == 3 else f"{prefix}.{mod.parameter_name}"
        layer, module = tensor_site(name)
        expert = e if param.ndim == 3 else None
        get = lambda e=e: stack[e]  # noqa: E731 - one expert's slice, for its norm and geometry
        row = _lora_row(name, layer, module, param, terms, geometry, _base_sumsq(param, f"expert{e}", get), get)
        rows.append({**row, "expert": expert})
        for part, idx in output_parts(module.rsplit(".", 1)[-1], stack.shape[1], config):
            idx = idx.to(param.device)
            get = lambda e=e, i=idx: stack[e].index_select(0, i)  # noqa: E731 - the part of one expert
            sub = _lora_row(f"{name}[{part}]", layer, f"{module}.{part}", param, restrict(terms, idx, 0), geometry,
                            _base_sumsq(param, f"expert{e}.{part}", get), get)
            rows.append({**sub, "part_of": module, "expert": expert})
    return rows


def _row_name(path: str) -> str:
    return path.removeprefix("base_model.model.") + ".weight"


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
