"""Vocabulary-wide quantities (token log-probs, entropy, KL) from final hidden states, a chunk of positions at a time.

At real vocabularies the logits are a step's largest tensor: 512 positions x 151,936 in float32 is 311 MB per row,
and `log_softmax` and its gradient hold several such copies. Here the output head is applied to `chunk_positions`
positions at a time (CHUNK_BYTES of float32 logits), only at real (mask 1) positions, so full-batch logits never
exist. The log-prob's backward recomputes its chunk's logits rather than keeping them (a custom autograd function:
d log p_y / d z = onehot(y) - softmax(z)), so the gradient holds no chunk's logits either. The same function gives
each position's entropy with its gradient (dH / dz = -p (log p + H)) from the same matmul, for the entropy bonus.

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


# ---- log-probs (and entropy), one chunk at a time -----------------------------------------------------------
def _scaled_logits(h, weight, bias, cap, temperature):
    """softcap(h W^T + b) / T in float32, and tanh(z / cap) in the model's dtype (the softcap's backward reads it;
    None without a softcap). The same operations as Head.logits, so forward and backward see the same logits."""
    z = F.linear(h, weight, bias)
    tc = torch.tanh(z / cap) if cap else None
    z = (tc * cap if cap else z).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z, tc


def _shift_(z):
    """z -= max z in place; returns (max z, log sum exp(z - max z)) per row. log p = (z - max) - that, rounded as
    log_softmax rounds it: z - logsumexp(z) would carry logsumexp's rounding at the logits' scale into every entry."""
    top = z.amax(-1, keepdim=True)
    z.sub_(top)
    return top.squeeze(-1), z.exp().sum(-1).log_()


class _ChunkedLogprob(torch.autograd.Function):
    """log softmax(head(h) / T)[y] over rows of h (N, H), chunk by chunk, and with `entropy` also
    H = -sum_v p log p of the same softmax (a second output); the backward recomputes each chunk:
    d log p_y / dz = onehot(y) - p, dH / dz = -p (log p + H), both through the temperature and the softcap."""

    @staticmethod
    def forward(ctx, h, weight, bias, tokens, temperature, softcap, chunk, entropy):
        out = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        top, lse = torch.empty_like(out), torch.empty_like(out)  # max z and log sum exp(z - max), the backward's
        ent = torch.empty_like(out) if entropy else None
        for s in range(0, h.size(0), chunk):
            z = _scaled_logits(h[s:s + chunk], weight, bias, softcap, temperature)[0]
            top[s:s + chunk], lse[s:s + chunk] = _shift_(z)
            if entropy:  # as token_entropy: -sum p log p
                z.sub_(lse[s:s + chunk, None])
                out[s:s + chunk] = z.gather(-1, tokens[s:s + chunk, None]).squeeze(-1)
                ent[s:s + chunk] = -z.exp().mul_(z).sum(-1)
            else:
                out[s:s + chunk] = z.gather(-1, tokens[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
            del z
        ctx.save_for_backward(h, weight, bias, tokens, top, lse, ent)
        ctx.temperature, ctx.softcap, ctx.chunk = temperature, softcap, chunk
        ctx.set_materialize_grads(False)  # an output the loss does not read (a detached entropy) gets None
        return (out, ent) if entropy else out

    @staticmethod
    def backward(ctx, grad, grad_ent=None):
        h, weight, bias, tokens, top, lse, ent = ctx.saved_tensors
        t, cap, chunk = ctx.temperature, ctx.softcap, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad is None and grad_ent is None:
            return (None,) * 8
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, h.size(0), chunk):
            hc = h[s:s + chunk]
            g = None if grad is None else grad[s:s + chunk, None].float()
            p, tc = _scaled_logits(hc, weight, bias, cap, t)
            p.sub_(top[s:s + chunk, None]).sub_(lse[s:s + chunk, None])  # log softmax as the forward's, in place
            if grad_ent is None:
                p.exp_().mul_(-g)  # -g * softmax
            else:  # -p (g + g_H (log p + H)): the log-prob's share and the entropy's
                logp, p = p, p.exp()
                a = logp.add_(ent[s:s + chunk, None]).mul_(grad_ent[s:s + chunk, None].float())
                if g is not None:
                    a.add_(g)
                p.mul_(a).neg_()
                del logp, a
            if g is not None:
                p.scatter_add_(-1, tokens[s:s + chunk, None], g)  # + g * onehot(y)
            if t != 1.0:
                p.div_(t)
            if cap:  # through cap * tanh(z / cap), in float32 or the model's wider dtype (1 - tanh^2 cancels)
                p.mul_(1 - tc.to(torch.promote_types(tc.dtype, torch.float32)) ** 2)
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
                None, None, None, None, None)


def selected_logprobs(hidden: torch.Tensor, head: Head, tokens: torch.Tensor, mask: torch.Tensor,
                      temperature: float = 1.0, chunk: int | None = None) -> torch.Tensor:
    """(B, T) log-probs of `tokens` from final hidden states (B, T, H) aligned with them; 0 where mask is 0 (those
    positions never reach the head). Differentiable in hidden and the head's weight."""
    return _selected(hidden, head, tokens, mask, temperature, chunk, False)[0]


def selected_logprobs_entropy(hidden: torch.Tensor, head: Head, tokens: torch.Tensor, mask: torch.Tensor,
                              temperature: float = 1.0, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """selected_logprobs and the (B, T) entropy (nats) of the same softmax, 0 where mask is 0, both differentiable,
    from one head matmul per chunk (one more per chunk in the backward). Detach the entropy when only its value is
    wanted: its backward share is then skipped."""
    return _selected(hidden, head, tokens, mask, temperature, chunk, True)


def _selected(hidden, head, tokens, mask, temperature, chunk, entropy: bool):
    """(log-probs, entropy or None) at mask's positions of (B, T) zeros."""
    sel = mask.bool()
    outs = [torch.zeros(tokens.shape, dtype=torch.float32, device=hidden.device) for _ in range(1 + entropy)]
    if bool(sel.any()):
        got = _ChunkedLogprob.apply(hidden[sel], head.weight, head.bias, tokens[sel], float(temperature),
                                    head.softcap, chunk or chunk_positions(head.vocab), entropy)
        outs = [o.index_put((sel,), g) for o, g in zip(outs, got if entropy else (got,), strict=True)]
    return outs[0], outs[1] if entropy else None


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
