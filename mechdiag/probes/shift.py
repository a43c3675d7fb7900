"""Activation shift between a reference and a tuned model, layer by layer (paper-notes §4, field-notes).

For block l with post-block residual h_l and token mask m (padding left out, and position 0 of a prompt whose
first token is the tokenizer's BOS, unless keep_bos; a tokenizer that adds no BOS keeps every position):

    shift_pooled_l = sqrt(sum_{x,t} m ||h_tuned - h_ref||^2) / sqrt(sum_{x,t} m ||h_ref||^2 + delta_h)  (eq. 13)
    shift_l        = mean over prompts x of the same ratio taken within x (the study's figure), with a
                     bootstrap 95% interval over prompts (tokens within a prompt are correlated)
    cos_dist_l     = mean over prompts of the token mean of 1 - cos(h_tuned, h_ref)
    increment_l    = mean over prompts of ||d_tuned - d_ref|| / ||d_ref||, d = h_l - h_(l-1): what block l writes
    logit_kl_l     = mean over prompts of KL(lens_ref || lens_tuned) at the last prompt token, lens = head(norm(h_l))
    output_kl      = KL(pi_ref || pi_tuned) of the next-token distributions, averaged over all prompt tokens
                     (padding masked, position 0 kept: it is a real prediction); one value per pair, repeated on
                     every row

Hidden states are reduced inside the batch loop to per-prompt, per-layer sums (float64), so memory is set by the
batch, not by the number of prompts.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mechdiag import atomic, models
from mechdiag.errors import UserError
from mechdiag.models import pad_id
from mechdiag.probes.capture import Captured, Probe, pad_batch
from mechdiag.probes.load import load_pair
from mechdiag.probes.prompts import encode, max_length_of, read_prompts

DELTA_H = 1e-12  # delta_h of eq. 13: guards the denominator only
N_BOOT = 1000
COLUMNS = ["layer", "shift", "ci_low", "ci_high", "shift_pooled", "cos_dist", "increment", "logit_kl",
           "output_kl", "n_prompts", "n_tokens"]


class ShiftSums:
    """Per-prompt, per-layer sums; everything the metrics need, O(prompts x layers) scalars."""

    def __init__(self, n_prompts: int, n_layers: int):
        z = lambda: np.zeros((n_prompts, n_layers))  # noqa: E731
        self.diff, self.ref, self.cos, self.inc_diff, self.inc_ref, self.lens_kl = z(), z(), z(), z(), z(), z()
        self.tokens = np.zeros(n_prompts)
        self.bos = np.zeros(n_prompts, dtype=bool)  # position 0 was BOS and left out of the norms
        self.out_kl = np.zeros(n_prompts)
        self.out_tokens = np.zeros(n_prompts)

    @torch.no_grad()
    def add(self, idx: list[int], ref: Captured, tuned: Captured, lens_ref: torch.Tensor, lens_tuned: torch.Tensor,
            mask: torch.Tensor, drop_first: torch.Tensor | None = None) -> None:
        """drop_first [B] bool: leave position 0 out of the norms for these prompts (their BOS)."""
        real = mask.bool()
        m = real.clone()
        if drop_first is not None:
            m[:, 0] &= ~drop_first.to(m.device)
            self.bos[idx] = drop_first.cpu().numpy()

        def per_prompt(q):  # [B, T] per-token values -> [B] masked sums; where() so NaN in padding cannot leak
            return torch.where(m, q, 0).double().sum(-1).cpu().numpy()

        self.tokens[idx] = m.sum(-1).cpu().numpy()
        for layer in range(1, len(ref.resid)):
            hr, ht = ref.resid[layer].float(), tuned.resid[layer].float()  # cast first, then subtract
            dr, dt = hr - ref.resid[layer - 1].float(), ht - tuned.resid[layer - 1].float()
            j = layer - 1
            self.diff[idx, j] = per_prompt((ht - hr).pow(2).sum(-1))
            self.ref[idx, j] = per_prompt(hr.pow(2).sum(-1))
            # 1 - cos = ||a/|a| - b/|b|||^2 / 2: exactly 0 for equal vectors, accurate for small angles
            self.cos[idx, j] = per_prompt(0.5 * (F.normalize(ht, dim=-1) - F.normalize(hr, dim=-1)).pow(2).sum(-1))
            self.inc_diff[idx, j] = per_prompt((dt - dr).pow(2).sum(-1))
            self.inc_ref[idx, j] = per_prompt(dr.pow(2).sum(-1))
            self.lens_kl[idx, j] = _kl(lens_ref[j], lens_tuned[j]).cpu().numpy()
        for i, p in enumerate(idx):  # output KL row by row: [T, V] at a time
            kl = _kl(ref.logits[i], tuned.logits[i])
            self.out_kl[p] = kl[real[i]].sum().item()
            self.out_tokens[p] = real[i].sum().item()

    def rows(self, n_boot: int = N_BOOT, seed: int = 0) -> list[dict]:
        keep = self.tokens > 0  # a prompt of BOS alone has nothing to compare
        if not keep.any():
            raise UserError("no prompt has a token to compare (all are empty or BOS only)")
        n = int(keep.sum())
        ratio = np.sqrt(self.diff[keep] / (self.ref[keep] + DELTA_H))
        pooled = np.sqrt(self.diff[keep].sum(0) / (self.ref[keep].sum(0) + DELTA_H))
        cos = (self.cos[keep] / self.tokens[keep, None]).mean(0)
        inc = np.sqrt(self.inc_diff[keep] / (self.inc_ref[keep] + DELTA_H)).mean(0)
        lo, hi = bootstrap_ci(ratio, n_boot, seed)
        out_kl = self.out_kl.sum() / max(self.out_tokens.sum(), 1)
        n_tok = int(self.tokens[keep].sum())
        return [{"layer": j, "shift": float(ratio[:, j].mean()), "ci_low": float(lo[j]), "ci_high": float(hi[j]),
                 "shift_pooled": float(pooled[j]), "cos_dist": float(cos[j]), "increment": float(inc[j]),
                 "logit_kl": float(self.lens_kl[keep, j].mean()), "output_kl": float(out_kl), "n_prompts": n,
                 "n_tokens": n_tok} for j in range(ratio.shape[1])]


def _kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis, in float64 (near-identical models give tiny values)."""
    lp, lq = F.log_softmax(logits_p.double(), -1), F.log_softmax(logits_q.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0)


def bootstrap_ci(ratio: np.ndarray, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95):
    """Percentile interval of the prompt mean, resampling prompts: ratio [N, L] -> (low [L], high [L])."""
    n = ratio.shape[0]
    if n < 2:
        return ratio[0], ratio[0]
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=n_boot)  # [n_boot, N]
    means = counts @ ratio / n
    a = (1 - level) / 2
    return np.quantile(means, a, axis=0), np.quantile(means, 1 - a, axis=0)


def measure(ref: Probe, tuned: Probe, seqs: list[list[int]], pad_id: int, batch_size: int = 16,
            ref_ctx=contextlib.nullcontext, tuned_ctx=contextlib.nullcontext, keep_bos: bool = False,
            bos_id: int | None = None, progress=None) -> ShiftSums:
    """Run both models on the same batches and reduce each batch into per-prompt sums (progress(done, total)
    after each batch, when given). Position 0 is left out only where it holds `bos_id` (the tokenizer added a BOS,
    or the prompt text began with it) and not keep_bos."""
    if ref.n_layers != tuned.n_layers:
        raise UserError(f"base has {ref.n_layers} layers, tuned has {tuned.n_layers}")
    if batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    sums = ShiftSums(len(seqs), ref.n_layers)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths together: less padding
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = pad_batch([seqs[i] for i in idx], pad_id, ref.device)
        rows = torch.arange(len(idx), device=batch.last.device)
        with ref_ctx():
            cap_ref = ref.run(batch)
            lens_ref = ref.lens(torch.stack([h[rows, batch.last] for h in cap_ref.resid[1:]]))  # [L, B, V]
        with tuned_ctx():
            cap_tuned = tuned.run(batch)
            lens_tuned = tuned.lens(torch.stack([h[rows, batch.last] for h in cap_tuned.resid[1:]]))
        first = torch.tensor([not keep_bos and bos_id is not None and seqs[i][0] == bos_id for i in idx])
        sums.add(idx, cap_ref, cap_tuned, lens_ref, lens_tuned, batch.attention_mask, first)
        del cap_ref, cap_tuned, lens_ref, lens_tuned
        if progress is not None:
            progress(min(start + batch_size, len(order)), len(order))
    return sums


def _prepare(tokenizer, config, prompts: list[str], max_length: int | None):
    if not prompts:
        raise UserError("no prompts to probe with")
    limit = max_length or max_length_of(tokenizer, config)
    seqs, truncated = encode(tokenizer, prompts, limit)
    empty = sum(1 for s in seqs if not s)
    if empty:
        raise UserError(f"{empty} prompt(s) tokenise to nothing")
    return seqs, truncated, limit


def shift(base, tuned, prompts: list[str], batch_size: int = 16, keep_bos: bool = False,
          max_length: int | None = None, dtype: str = "float32", device: str = "auto", n_boot: int = N_BOOT,
          seed: int = 0, progress=None, against: str = "original"):
    """Per-layer activation shift of `tuned` against `base` on `prompts` -> DataFrame (against: an adapter whose
    init rewrote the base, against the original base or the residual; mechdiag.adapters).

    prompts: a list of strings, or a pathlib.Path to a probe file (see read_prompts).

    base, tuned: model folders or PEFT adapter folders (see mechdiag.probes.load). df.attrs carries
    truncated (prompts cut to max_length), max_length, shared (one model with the adapter toggled), bos_dropped
    (prompts whose position 0 was BOS and left out of the norms) and n_prompts.
    """
    import pandas as pd  # noqa: PLC0415 - pandas loads on first use (slow import)

    if isinstance(prompts, Path):
        prompts = read_prompts(prompts)
    elif isinstance(prompts, str):
        raise UserError("prompts must be a list of strings or a pathlib.Path to a probe file")
    device = models.device(device)
    pair = load_pair(base, tuned, dtype=dtype, device=device, against=against)
    seqs, truncated, limit = _prepare(pair.tokenizer, pair.ref.inner.config, list(prompts), max_length)
    sums = measure(pair.ref, pair.tuned, seqs, pad_id(pair.tokenizer), batch_size, pair.ref_ctx,
                   pair.tuned_ctx, keep_bos, pair.tokenizer.bos_token_id, progress)
    df = pd.DataFrame(sums.rows(n_boot, seed), columns=COLUMNS)
    df.attrs.update(truncated=truncated, max_length=limit, shared=pair.shared, bos_dropped=int(sums.bos.sum()),
                    n_prompts=len(seqs))
    return df


def shift_inmemory(model, tokenizer, prompts: list[str], batch_size: int = 8, step: int | None = None,
                   keep_bos: bool = False, max_length: int | None = None) -> list[dict]:
    """Shift of a PEFT-wrapped model against itself with the adapter disabled, for the trainer's recorder.

    Returns one row per layer (step, layer, shift, ci_low, ci_high, ..., output_kl on every row). The model is put
    in eval mode for the measurement (LoRA dropout off) and its training mode is restored after.
    """
    if not hasattr(model, "disable_adapter") or not hasattr(model, "peft_config"):
        raise UserError("shift_inmemory needs a PEFT model (the reference is the model with the adapter disabled)")
    seqs, _, _ = _prepare(tokenizer, model.config, list(prompts), max_length)
    probe = Probe(model)
    was_training = model.training
    model.eval()
    try:
        sums = measure(probe, probe, seqs, pad_id(tokenizer), batch_size, model.disable_adapter,
                       contextlib.nullcontext, keep_bos, tokenizer.bos_token_id)
    finally:
        model.train(was_training)
    return [{"step": step, **r} for r in sums.rows()]


# ---- output -------------------------------------------------------------------------------------------------
def write_html(df, path: str | Path, title: str = "Activation shift") -> None:
    """One offline page: shift with its 95% interval, and the companion measures, per layer."""
    import plotly.graph_objects as go  # noqa: PLC0415 - plotly loads only when a figure is drawn
    from plotly.subplots import make_subplots  # noqa: PLC0415 - plotly loads only when a figure is drawn

    fig = make_subplots(rows=2, cols=2, subplot_titles=("shift (mean over prompts, 95% CI)", "cosine distance",
                                                        "block increment", "logit-lens KL (last token)"))
    x = df["layer"]
    fig.add_trace(go.Scatter(x=list(x) + list(x)[::-1], y=list(df["ci_high"]) + list(df["ci_low"])[::-1],
                             fill="toself", line={"width": 0}, name="95% CI", opacity=0.3), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=df["shift"], mode="lines+markers", name="shift"), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=df["shift_pooled"], mode="lines", name="shift pooled (eq. 13)",
                             line={"dash": "dot"}), 1, 1)
    for (r, c), col in zip([(1, 2), (2, 1), (2, 2)], ["cos_dist", "increment", "logit_kl"], strict=True):
        fig.add_trace(go.Scatter(x=x, y=df[col], mode="lines+markers", name=col), r, c)
    out_kl = float(df["output_kl"].iloc[0]) if len(df) else float("nan")
    fig.update_layout(title=f"{title} (output KL {out_kl:.4g}, {int(df['n_prompts'].iloc[0])} prompts)",
                      height=700)
    fig.update_xaxes(title_text="layer")
    atomic.write_text(path, fig.to_html(include_plotlyjs=True, full_html=True))


def bos_note(df) -> str:
    """What happened to position 0, for the user: it is left out only where it was BOS."""
    k, n = df.attrs.get("bos_dropped", 0), df.attrs.get("n_prompts", 0)
    if k:
        return f"position 0 (BOS) left out of the norms in {k} of {n} prompts (--keep-bos counts it)"
    return "no prompt starts with BOS: every position counted"


def note(msg: str) -> None:
    print(f"mechdiag: note: {msg}", file=sys.stderr)
