"""Vocabulary-wide quantities (token log-probs, entropy, KL) from final hidden states, a chunk of positions at a time.

At real vocabularies the logits are a step's largest tensor: 512 positions x 151,936 in float32 is 311 MB per row,
and `log_softmax` and its gradient hold several such copies. Here the output head is applied to `chunk_positions`
positions at a time (CHUNK_BYTES of float32 logits), only at real (mask 1) positions, so full-batch logits never
exist. The log-prob's backward recomputes its chunk's logits rather than keeping them (a custom autograd function:
d log p_y / d z = onehot(y) - softmax(z)), so the gradient holds no chunk's logits either.

`token_logprobs` and `token_entropy` are the same formulas on logits already in hand (the unchunked path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mechdiag import blocks

CHUNK_BYTES = 64 * 2**20  # float32 logits per chunk: ~110 positions at 151,936 entries, a whole batch at 177
CHUNK_LIVE = 3  # vocabulary-wide float32 tensors of one chunk alive at once at worst (logits, softmax, its grad)


# ---- on logits in hand --------------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(y_t | x, y_<t) for each target token: logits (..., V) already aligned with tokens (...)."""
    logits = logits.float() / temperature if temperature != 1.0 else logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H_t = -sum_v p log p per position (nats)."""
    logits = logits.float() / temperature if temperature != 1.0 else logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ---- the output head ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Head:
    """A model's output head as tensors: logits = softcap(h W^T + b), computed in the model's dtype as its forward
    does (Gemma-2's final_logit_softcapping: cap * tanh(z / cap))."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        z = F.linear(h, self.weight, self.bias)
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    @property
    def vocab(self) -> int:
        return self.weight.size(0)


# configs whose forward rescales the logits in ways Head does not model: their callers keep the full-logits path
_OTHER_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier")


def head_of(model) -> Head | None:
    """The Head of a causal LM (a PEFT model's base), or None when its head is not a plain Linear (an adapter on
    lm_head, a family that rescales logits) and the full forward must be used."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    c = getattr(base, "config", None)
    if type(out) is not torch.nn.Linear or c is None or any(getattr(c, k, None) for k in _OTHER_LOGIT_TRANSFORMS):
        return None
    if hasattr(out.weight, "ds_id"):  # a ZeRO-3 partition: whole only inside its module's forward (hooks gather it)
        return None
    return Head(out.weight, out.bias, blocks.logit_softcap(c))


def chunk_positions(vocab: int, chunk_bytes: int | None = None) -> int:
    """Positions per chunk: chunk_bytes (default CHUNK_BYTES, read when called) of float32 logits."""
    return max(1, (chunk_bytes or CHUNK_BYTES) // (4 * max(vocab, 1)))


# ---- log-probs, one chunk at a time -------------------------------------------------------------------------
class _ChunkedLogprob(torch.autograd.Function):
    """log softmax(head(h) / T)[y] over rows of h (N, H), chunk by chunk; the backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, h, weight, bias, tokens, temperature, softcap, chunk):
        head = Head(weight, bias, softcap)
        out = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        lse = torch.empty_like(out)
        for s in range(0, h.size(0), chunk):
            z = head.logits(h[s:s + chunk]).float()
            if temperature != 1.0:
                z = z / temperature
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            out[s:s + chunk] = z.gather(-1, tokens[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
            del z
        ctx.save_for_backward(h, weight, bias, tokens, lse)
        ctx.temperature, ctx.softcap, ctx.chunk = temperature, softcap, chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        h, weight, bias, tokens, lse = ctx.saved_tensors
        t, cap, chunk = ctx.temperature, ctx.softcap, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, h.size(0), chunk):
            hc, g = h[s:s + chunk], grad[s:s + chunk, None].float()
            z = F.linear(hc, weight, bias)
            tc = torch.tanh(z / cap) if cap else None
            p = (tc * cap if cap else z).float()
            del z
            if t != 1.0:
                p.div_(t)
            p.sub_(lse[s:s + chunk, None]).exp_()  # softmax, in place
            p.mul_(-g).scatter_add_(-1, tokens[s:s + chunk, None], g)  # g * (onehot(y) - softmax)
            if t != 1.0:
                p.div_(t)
            if cap:  # through cap * tanh(z / cap)
                p.mul_(1 - tc.float() ** 2)
                del tc
            dz = p.to(h.dtype)
            del p
            if need_h:
                gh[s:s + chunk] = dz @ weight
            if need_w:
                gw.add_(dz.t().float() @ hc.float())
            if need_b:
                gb.add_(dz.float().sum(0))
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None)


def selected_logprobs(hidden: torch.Tensor, head: Head, tokens: torch.Tensor, mask: torch.Tensor,
                      temperature: float = 1.0, chunk: int | None = None) -> torch.Tensor:
    """(B, T) log-probs of `tokens` from final hidden states (B, T, H) aligned with them; 0 where mask is 0 (those
    positions never reach the head). Differentiable in hidden and the head's weight."""
    sel = mask.bool()
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=hidden.device)
    if not bool(sel.any()):
        return out
    chunk = chunk or chunk_positions(head.vocab)
    lp = _ChunkedLogprob.apply(hidden[sel], head.weight, head.bias, tokens[sel], float(temperature), head.softcap,
                               chunk)
    return out.index_put((sel,), lp)


@torch.no_grad()
def selected_kl(hidden_p: torch.Tensor, head_p: Head, hidden_q: torch.Tensor, head_q: Head, mask: torch.Tensor,
                chunk: int | None = None) -> torch.Tensor:
    """sum over real positions of KL(p || q) over the whole vocabulary, in float64, a chunk of positions at a time
    (p and q from their final hidden states (B, T, H))."""
    sel = mask.bool()
    hp, hq = hidden_p[sel], hidden_q[sel]
    chunk = chunk or chunk_positions(head_p.vocab, CHUNK_BYTES // 2)  # float64
    total = torch.zeros((), dtype=torch.float64, device=hp.device)
    for s in range(0, hp.size(0), chunk):
        lp = torch.log_softmax(head_p.logits(hp[s:s + chunk]).double(), -1)
        lq = torch.log_softmax(head_q.logits(hq[s:s + chunk]).double(), -1)
        total += (lp.exp() * (lp - lq)).sum()
        del lp, lq
    return total


@torch.no_grad()
def selected_entropy(hidden: torch.Tensor, head: Head, mask: torch.Tensor, temperature: float = 1.0,
                     chunk: int | None = None) -> torch.Tensor:
    """(B, T) entropy (nats) at real positions, 0 elsewhere, a chunk of positions at a time."""
    sel = mask.bool()
    h = hidden[sel]
    chunk = chunk or chunk_positions(head.vocab)
    ent = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
    for s in range(0, h.size(0), chunk):
        ent[s:s + chunk] = token_entropy(head.logits(h[s:s + chunk]), temperature)
    return torch.zeros(mask.shape, dtype=torch.float32, device=h.device).index_put_((sel,), ent)
