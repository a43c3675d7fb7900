"""The algebra of weight updates, one home for it: low-rank products kept as factors, exact float64 norms, spectra
and update geometry, shared by displacement from checkpoints (mechdiag.displacement) and the trainers' records of
a model in memory (mechdiag.live_rows). No I/O here.

Identities (field-notes), never forming B @ A:
    ||B A||_F^2 = sum((B^T B) * (A A^T)),   <W, B A>_F = sum((B^T W) * A),   svdvals(B A) = svdvals(R_B R_A^T).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable

import torch

CHUNK_ELEMS = 1 << 20  # rows per read chunk ~ 1M elements: 4 MB in float32, the passes stay in cache
SPECTRAL_COLUMNS = ["sigma_1", "stable_rank", "effective_rank"]
GEOMETRY_COLUMNS = ["overlap_k", "subspace_overlap", "intruders"]  # with --spectral too, see update_geometry
INTRUDER_TOP, INTRUDER_COS = 10, 0.5  # the tuned weight's top 10 singular vectors; |cos| below 0.5 = intruder
DENSE_OVERLAP_DIV = 16  # dense delta: k = min(m, n) // 16 (LoRA: k = the update's rank)
F64 = torch.float64


def lowrank_factors(plus: Iterable, minus: Iterable = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stack sum(s B A for plus) - sum(s B A for minus) as one product Bc @ Ac (float64), or None if empty.
    Items are objects with .scale, .B (out x r), .A (r x in)."""
    Bs, As = [], []
    for sign, terms in ((1.0, plus), (-1.0, minus)):
        for t in terms:
            Bs.append(t.B.detach().to(F64) * (sign * t.scale))
            As.append(t.A.detach().to(F64))
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
    s = s.to(F64)
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


def sumsq(x: torch.Tensor) -> float:
    """sum(x^2) of a float32 tensor in float64, where each square is exact (the C kernel's arithmetic; one float32
    norm over millions of elements drifts by 1e-4). A float64 dot per 1M-element slice of a reused buffer."""
    flat, total = x.reshape(-1), 0.0
    for start in range(0, flat.numel(), CHUNK_ELEMS):
        part = flat[start:start + CHUNK_ELEMS]
        buf = scratch(3, part.numel(), F64).copy_(part)
        total += float(torch.dot(buf, buf))
    return total


_TLS = threading.local()


def scratch(slot: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer of n elements, one per (thread, slot), reused chunk after chunk: fresh allocations of megabytes
    cost page faults on every chunk."""
    bufs = getattr(_TLS, "bufs", None)
    if bufs is None:
        bufs = _TLS.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = bufs[slot] = torch.empty(max(n, CHUNK_ELEMS), dtype=dtype)
    return buf[:n]


def restrict(terms, idx: torch.Tensor, axis: int) -> list:
    """LoRA terms of a part: the part's output features of s B A are B[idx] A (axis 0) or B A[:, idx] (axis 1,
    Conv1D's stored orientation), still factors (terms of the same type: .scale, .B, .A)."""
    return [type(t)(t.scale, t.B[idx], t.A) if axis == 0 else type(t)(t.scale, t.B, t.A[:, idx]) for t in terms]


def geometry_pass(read_ref, read_tuned, shape, ref_lr, delta_lr, delta_sq, nonfinite, chunk_elems) -> dict:
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
    G, C, H = (torch.zeros(p, p, dtype=F64) for _ in range(3))  # from the dense parts: a^T a, a^T d, d^T d
    P = None if delta_x is None else torch.zeros(p, delta_x[0].shape[1], dtype=F64)  # a^T Bx
    Q = None if delta_x is None or same_dense else torch.zeros_like(P)  # d^T Bx
    Ra = None if ref_x is None else torch.zeros(p, ref_x[0].shape[1], dtype=F64)  # a^T Bc (the reference's own LoRA)
    Rd = None if ref_x is None or same_dense else torch.zeros_like(Ra)  # d^T Bc
    step = max(1, (chunk_elems or CHUNK_ELEMS) // n) if tall else m
    for start in range(0, m, step):
        stop = min(start + step, m)
        a32 = read_ref(start, stop).to(torch.float32)
        d = None if same_dense else (read_tuned(start, stop).to(torch.float32) - a32).to(F64)  # as above
        a = a32.to(F64)
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


def spectral_columns(shape, same_dense, delta_lr, gram, dense_chunks, delta_sq, nonfinite) -> dict:
    if len(shape) != 2 or nonfinite:
        return dict.fromkeys(SPECTRAL_COLUMNS, math.nan if nonfinite else None)
    if same_dense:
        s = lowrank_svdvals(*delta_lr) if delta_lr is not None else torch.zeros(0)
        return spectral_stats(s, delta_sq)
    if gram is None:  # wide matrix: D D^T from the kept chunks
        d = torch.cat(dense_chunks).to(F64)
        gram = d @ d.T
    s = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    s = s[s > s.max() * 1e-7] if s.numel() else s  # eigenvalues of a Gram matrix below eps*sigma_1^2 are noise
    return spectral_stats(s, delta_sq)


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
