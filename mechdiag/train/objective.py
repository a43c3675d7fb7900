"""The GRPO objective (paper-notes §2) as pure functions of tensors.

Shapes: B completions (prompts x G, grouped contiguously), T completion positions, V vocabulary.
`mask` is 1 on real completion tokens and 0 on padding. Every function is differentiable where it should be
and has no side effects, so the loss reads like the study's equation:

    J = (1/G) sum_i (1/T_i) sum_t [ min(rho A_i, clip(rho, 1-eps, 1+eps_high) A_i) - beta K_{i,t} ]

and the trainer minimises -J.
"""

from __future__ import annotations

import torch

from mechdiag.vocab import token_entropy, token_logprobs  # noqa: F401 - their home is vocab; the objective reads them

STD_EPS = 1e-4  # as TRL: A = (r - mean) / (std + 1e-4)


# ---- advantages ------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """A_i = (r_i - mean(r_group)) / std(r_group); `scale` picks the std: "group", "batch" or "none".

    rewards: (B,) with groups of `group_size` contiguous. std is the unbiased one (Bessel), as in TRL.
    A group whose rewards are all equal gets A = 0 exactly (the study's definition): computed in float64 and set
    to 0, because a float32 mean of equal values can be off by an ulp, which the (std + 1e-4) divisor amplifies
    (TRL has that artefact), and because exact zeros are what the beta = 0 row skip in the trainer tests for.
    """
    r = rewards.view(-1, group_size).to(torch.float64)
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(equal, 0.0, r - r.mean(dim=1, keepdim=True))
    if scale == "none":
        return centred.reshape(-1).to(torch.float32)
    if scale == "group":
        std = r.std(dim=1, keepdim=True)
    elif scale == "batch":
        std = r.reshape(-1).std() if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}")
    return (centred / (std + STD_EPS)).reshape(-1).to(torch.float32)


# ---- per-token quantities ---------------------------------------------------------------------------------
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """K = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 (Schulman's k3: unbiased, non-negative)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      epsilon: float, epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min(rho A, clip(rho, 1-eps, 1+eps_high) A) per token; returns (surrogate, rho). A: (B,) or (B, T)."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    rho = torch.exp(logp - old_logp)
    unclipped = rho * adv
    clipped = torch.clamp(rho, 1 - epsilon, 1 + epsilon_high) * adv
    return torch.min(unclipped, clipped), rho


# ---- aggregation ------------------------------------------------------------------------------------------
def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str = "grpo",
              max_completion_tokens: int | None = None, n_rows: int | None = None,
              n_tokens: int | None = None) -> torch.Tensor:
    """Reduce per-token terms to a scalar.

    grpo:    (1/B) sum_i (1/T_i) sum_t x_it        the study's per-sequence mean
    bnpo / dapo: sum x / sum mask                  token mean over the batch
    dr_grpo: sum x / (B * max_completion_tokens)   no length normalisation

    B and sum mask are the micro-batch's: `n_rows` / `n_tokens` when rows with exactly zero loss were left out of
    `per_token` (the trainer drops zero-advantage rows when beta = 0), else those of `per_token`.
    """
    m = mask.to(per_token.dtype)
    rows = per_token.size(0) if n_rows is None else n_rows
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / max(rows, 1)
    if loss_type in ("dapo", "bnpo"):
        tokens = m.sum() if n_tokens is None else torch.tensor(float(n_tokens), dtype=per_token.dtype)
        return (per_token * m).sum() / tokens.clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_tokens is None:
            raise ValueError("dr_grpo needs max_completion_tokens")
        return (per_token * m).sum() / (max(rows, 1) * max_completion_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def clip_fractions(rho: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float,
                   epsilon_high: float, n_tokens: int | None = None) -> dict[str, float]:
    """Token fractions where the clip is active: low (rho < 1-eps, A < 0), high (rho > 1+eps_high, A > 0), over
    `n_tokens` (the micro-batch's tokens, dropped rows included) or the tokens of `mask`."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    low = (rho < 1 - epsilon) & (adv < 0)
    high = (rho > 1 + epsilon_high) & (adv > 0)
    m = mask.float()
    tokens = max(float(m.sum()) if n_tokens is None else float(n_tokens), 1.0)
    frac = lambda x: float((x.float() * m).sum()) / tokens  # noqa: E731
    return {"clip_fraction_low": frac(low), "clip_fraction_high": frac(high), "policy_clip_fraction": frac(low | high)}


# ---- the loss ---------------------------------------------------------------------------------------------
def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, epsilon: float = 0.2,
              epsilon_high: float | None = None, beta: float = 0.0, loss_type: str = "grpo",
              max_completion_tokens: int | None = None, n_rows: int | None = None,
              n_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """-J of paper-notes §2 and its diagnostics. old_logp None means on-policy (rho = 1, value-wise).

    The whole weighting is here: with `n_rows` / `n_tokens` (the micro-batch's counts when rows with zero loss
    were left out) the loss and the clip fractions are those of the whole micro-batch (see `aggregate`)."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    old_logp = logp.detach() if old_logp is None else old_logp
    surrogate, rho = clipped_surrogate(logp, old_logp, advantages, epsilon, epsilon_high)
    per_token = -surrogate
    stats: dict[str, float] = {}
    if beta != 0.0:  # the penalty, and its value as the logged KL (the trainer measures it itself when beta = 0)
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + beta * kl
        stats["kl"] = masked_mean(kl.detach(), mask).item()
    loss = aggregate(per_token, mask, loss_type, max_completion_tokens, n_rows, n_tokens)
    stats.update(clip_fractions(rho.detach(), advantages, mask, epsilon, epsilon_high, n_tokens))
    return loss, stats
