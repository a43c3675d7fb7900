"""Weight displacement from checkpoints (paper-notes §4): per-tensor norms of W - W_ref, read from the files.

Per tensor: ref_fro = ||W_ref||_F, delta_fro = ||W - W_ref||_F, rel_fro = delta_fro / ref_fro. Each side's tensor
is dense + sum of LoRA terms s*B@A (+ a form's float64 delta, mechdiag.adapters). Dense parts are streamed a row
chunk at a time in float32 (cast before subtracting) with float64 accumulators; LoRA terms stay factors
(mechdiag.lowrank). Grouping (WDisp, update mass) is mechdiag.grouping; the trainers' records of a model in memory
are mechdiag.live_rows. The public API keeps its names here: displacement, compare, group_wdisp, rows_frame,
lora_rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import torch

from mechdiag.console import note
from mechdiag.errors import UserError
from mechdiag.grouping import ROW_COLUMNS, group_wdisp, rows_frame  # noqa: F401 - the public API's names
from mechdiag.live_rows import lora_rows  # noqa: F401 - the public API's name
from mechdiag.lowrank import (  # noqa: F401 - lowrank_* and the column names: the public API's names
    CHUNK_ELEMS,
    F64,
    GEOMETRY_COLUMNS,
    SPECTRAL_COLUMNS,
    geometry_pass,
    lowrank_factors,
    lowrank_sumsq,
    lowrank_svdvals,
    rel_fro,
    restrict,
    scratch,
    single_thread,
    spectral_columns,
    spectral_stats,
    sumsq,
)
from mechdiag.parts import output_axis, output_parts
from mechdiag.weights import (
    ConcatRef,
    Entry,
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


def _pow2_floor(w: torch.Tensor) -> torch.Tensor:
    """2^floor(log2|w|) from the float32 exponent bits (one bf16 ULP is this times 2^-7); the smallest normal
    float at zero and subnormal weights, so that an unchanged entry always counts as below one ULP."""
    return (w.view(torch.int32) & 0x7F800000).view(torch.float32).clamp_min_(1.1754944e-38)


def _count(x: torch.Tensor) -> int:
    """Sum of a 0/1 float32 tensor; float32 sums of ones are exact below 2^24 elements."""
    total = float(x.sum() if x.numel() < (1 << 24) else x.sum(dtype=F64))
    return int(total) if math.isfinite(total) else 0  # NaN weights: the row is flagged nonfinite anyway


def _change_counts(d: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(entries changed, entries with |d| < one bf16 ULP of w, zeros included); overwrites d. Each count is one
    comparison written as 0/1 float32 into a reused buffer and a float32 sum: on CPU, comparisons into bool and
    count_nonzero are 10x slower. ULP = 2^floor(log2|w|) * 2^-7 from the exponent bits (exact, see _pow2_floor)."""
    t = scratch(2, d.numel()).view(d.shape)
    changed = _count(torch.ne(d, 0, out=t))
    x = d.abs_()
    torch.bitwise_and(w.view(torch.int32), 0x7F800000, out=t.view(torch.int32))  # 2^floor(log2|w|), see _pow2_floor
    ulp = t.mul_(2.0 ** -7).clamp_min_(2.0 ** -133)  # 2^-133: zero and subnormal w, as _pow2_floor's clamp
    below = _count(torch.lt(x, ulp, out=t))
    return changed, below


def _as_f32(x: torch.Tensor, slot: int) -> torch.Tensor:
    if x.dtype == torch.float32:
        return x
    return scratch(slot, x.numel()).view(x.shape).copy_(x)


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
            ref_sq += sumsq(a)
            if ref_cross is not None:
                ref_cross += ref_lr[0][start:stop].T @ a.to(F64)
            if same_dense:
                continue
            b = files.read(eb.dense, start, stop)
            d = scratch(1, a.numel()).view(a.shape).copy_(b).sub_(a)  # float32: cast before subtracting
            dense_sq += sumsq(d)
            if delta_cross is not None:
                delta_cross += delta_lr[0][start:stop].T @ d.to(F64)
            if need_dense_spectral:
                dd = d.to(F64) if delta_lr is None else d.to(F64) + delta_lr[0][start:stop] @ delta_lr[1]
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
        row.update(spectral_columns(shape, same_dense, delta_lr, gram, dense_chunks, delta_sq, nonfinite))
        read_tuned = None if same_dense else (lambda start, stop: files.read(eb.dense, start, stop))
        row.update(geometry_pass(lambda start, stop: files.read(ea.dense, start, stop), read_tuned, shape, ref_lr,
                             delta_lr, delta_sq, nonfinite, chunk_elems))
    return row


def _side_rows(files, e: Entry, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored rows, their float64 additions: LoRA terms multiplied out for these rows and the form's delta)."""
    dense = files.read(e.dense, start, stop)
    extra = torch.zeros(dense.shape, dtype=F64)
    for t in e.lora:
        extra += t.scale * (t.B[start:stop].to(F64) @ t.A.to(F64))
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
        ref = a.to(F64) + xa
        d = (b.to(F64) - a.to(F64)) + (xb - xa)
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
        row.update(spectral_columns(shape, False, None, gram, [k.to(torch.float32) for k in kept], delta_sq, nonfinite))

        def read(e):
            return lambda start, stop: (lambda d, x: d.to(F64) + x)(*_side_rows(files, e, start, stop))
        row.update(geometry_pass(read(ea), read(eb), shape, None, None, delta_sq, nonfinite, chunk_elems))
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
        x = dense.to(F64) + extra
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


def displacement(a, b, base=None, by: str = "tensor", spectral: bool = False, experts: bool = False,
                 against: str = "original") -> pd.DataFrame:
    """Python API: a DataFrame of per-tensor rows (by="tensor") or grouped WDisp (by="module"|"layer"|"all");
    experts: a mixture-of-experts' expert modules one per expert; against: see compare."""
    if by not in ("tensor", "module", "layer", "all"):
        raise UserError(f"by must be tensor, module, layer or all, not {by!r}")
    df = rows_frame(compare(a, b, base=base, spectral=spectral, experts=experts, against=against), spectral)
    return df if by == "tensor" else group_wdisp(df, by=by)
