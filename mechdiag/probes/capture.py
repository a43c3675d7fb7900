"""Capture the post-block residual stream of every decoder layer with nnsight.

One `Probe` per model in memory. A PEFT model is probed through its inner transformers model, so the adapter can
be toggled (`disable_adapter()` / `set_adapter(name)`) around a trace and base and tuned share one copy of the
weights. Batches are right-padded by us, so both models see identical ids and masks and real tokens never attend
to padding.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import nnsight
import torch
from nnsight import NNsight
from torch import nn

from mechdiag.blocks import final_norm, find_blocks, head_transform
from mechdiag.errors import UserError

_WRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> NNsight (wrap each model once)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    last: torch.Tensor  # [B] index of the last real token


def pad_batch(seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    """Right-pad token id lists into one batch."""
    lens = [len(s) for s in seqs]
    ids = torch.full((len(seqs), max(lens)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    last = torch.tensor(lens, dtype=torch.long) - 1
    return Batch(ids.to(device), mask.to(device), last.to(device))


@dataclass
class Captured:
    resid: list[torch.Tensor]  # L+1 tensors [B, T, D]: the stream entering block 0, then each block's output
    logits: torch.Tensor  # [B, T, V]


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def _envoy(root, path: str):
    for part in path.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


class Probe:
    """nnsight view of one model: per-layer residuals and logits for a batch, plus the logit-lens head."""

    def __init__(self, model: nn.Module):

        self.model = model
        self.inner = unwrap(model)
        if self.inner not in _WRAPPED:
            with warnings.catch_warnings():  # wrapping reads deprecated model attributes
                warnings.simplefilter("ignore", FutureWarning)
                _WRAPPED[self.inner] = NNsight(self.inner)
        self.nn = _WRAPPED[self.inner]
        self.layers_path, blocks = find_blocks(self.inner)
        self.n_layers = len(blocks)
        self.norm = final_norm(self.inner)
        self.head = self.inner.get_output_embeddings()
        if self.head is None:
            raise UserError(f"{type(self.inner).__name__} has no output head (need a causal LM)")

    @property
    def device(self) -> torch.device:
        return next(self.inner.parameters()).device

    @torch.no_grad()
    def run(self, batch: Batch) -> Captured:

        layers = _envoy(self.nn, self.layers_path)
        with self.nn.trace(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False):
            outs = [layers[0].input]  # read in execution order: block 0's input comes first
            for layer in layers:
                o = layer.output
                outs.append(o[0] if isinstance(o, tuple) else o)  # transformers 5 gives a tensor, 4 a tuple
            outs.append(self.nn.output.logits)
            saved = nnsight.save(outs)
        cap = Captured(resid=list(saved[:-1]), logits=saved[-1])
        self._check_lens(cap, batch)
        return cap

    @torch.no_grad()
    def lens(self, h: torch.Tensor) -> torch.Tensor:
        """Logit lens: next-token logits read from a residual h [..., D], through the model's own final norm, head
        and head transform (soft-capping, logit scaling)."""
        return head_transform(self.inner.config, self.head(self.norm(h)))

    def _check_lens(self, cap: Captured, batch: Batch) -> None:
        """The last block's lens must be the model's own logits; a family whose head does more than norm, head and
        head_transform is refused rather than measured wrong."""
        rows = torch.arange(len(batch.last), device=batch.last.device)
        got = self.lens(cap.resid[-1][rows, batch.last]).float()
        want = cap.logits[rows, batch.last].float()
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(want.abs().max()))):
            raise UserError(f"{type(self.inner).__name__}: the logit lens of the last block does not reproduce the "
                            f"model's logits (max difference {float((got - want).abs().max()):.3g}); this family's "
                            "head is not supported by shift")
