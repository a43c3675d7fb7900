"""The GRPO objective family of TRL 1.16 (paper-notes §2; docs/training.md has each formula and its paper) as
pure functions of tensors.

Shapes: B completions (prompts x G, grouped contiguously), T completion positions, V vocabulary.
`mask` is 1 on the tokens the loss counts and 0 elsewhere (padding; a truncated completion under
mask_truncated_completions). Every function is differentiable where it should be and has no side effects, so
the loss reads like the study's equation:

    J = (1/G) sum_i (1/T_i) sum_t [ min(rho A_i, clip(rho, 1-eps, 1+eps_high) A_i) - beta K_{i,t} ]

and the trainer minimises -J. `Objective` holds the options (from the Config), `Share` says where a micro-batch
sits in its update (the counts its loss is divided by), and `grpo_loss` is the one branch point over loss_type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def decoupled_advantages(components: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """multi_objective_aggregation: normalize_then_sum (GDPO): each reward component normalised within its group,
    z_k = (c_k - mean_group c_k) / (std_group c_k + 1e-4), then r = sum_k w_k z_k and A = (r - mean r) / (std r +
    1e-4) over the batch.

    components: (B, K) unweighted, weights: (K,). In float64, with the same exact zeros as group_advantages: a
    component equal across a group gives z = 0, a batch of equal r gives A = 0."""
    c = components.to(torch.float64).view(-1, group_size, components.size(-1))
    equal = (c == c[:, :1]).all(dim=1, keepdim=True)
    z = torch.where(equal, 0.0, (c - c.mean(dim=1, keepdim=True)) / (c.std(dim=1, keepdim=True) + STD_EPS))
    r = (z.reshape(-1, components.size(-1)) * weights.to(torch.float64)).sum(-1)
    if r.numel() < 2 or bool((r == r[0]).all()):
        return torch.zeros_like(r, dtype=torch.float32)
    return ((r - r.mean()) / (r.std() + STD_EPS)).to(torch.float32)


# ---- the options ------------------------------------------------------------------------------------------
CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped surrogate; cispo, sapo, vespo weigh rho
LOSS_TYPES = (*CLIP_FAMILY, "cispo", "sapo", "vespo")
BATCH_TOKEN_LOSSES = ("dapo", "cispo", "vespo")  # divided by the generation batch's tokens per update


@dataclass(frozen=True)
class Objective:
    """The options of the loss, named as TRL 1.16's GRPOConfig names them (docs/training.md: formula and paper)."""

    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None = epsilon; cispo's eps_max
    delta: float | None = None  # INTELLECT-2's two-sided clip: rho <= delta on the unclipped term
    beta: float = 0.0
    importance_sampling_level: str = "token"  # "sequence": GSPO
    use_bias_correction_kl: bool = False  # K multiplied by rho (DeepSeek-V3.2)
    top_entropy_quantile: float = 1.0  # < 1: the loss on the top-rho entropy tokens only (Beyond the 80/20 Rule)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's off-policy sequence mask
    entropy_coef: float = 0.0  # the entropy bonus's coefficient as applied (the adaptive controller's, gated)
    use_adaptive_entropy: bool = False  # Skywork-OR1's controller: the entropy is computed even at coefficient 0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    max_completion_tokens: int | None = None  # dr_grpo's constant

    @classmethod
    def of(cls, cfg) -> Objective:
        """The objective a Config trains with."""
        return cls(**{f: getattr(cfg, f) for f in cls.__dataclass_fields__ if f != "max_completion_tokens"},
                   max_completion_tokens=cfg.max_completion_tokens)

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def entropy_needed(self) -> bool:
        """The update pass must compute each token's entropy (with its gradient, for the bonus)."""
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @property
    def zero_advantage_rows_in_quantile_only(self) -> bool:
        """beta = 0 and no bonus under top_entropy_quantile < 1: a completion with A = 0 has zero loss and gradient,
        but its tokens count in the quantile's threshold; its entropy is needed, not its backward pass."""
        return self.beta == 0.0 and self.entropy_coef == 0.0 and not self.use_adaptive_entropy \
            and self.top_entropy_quantile < 1.0

    @property
    def zero_advantage_rows_vanish(self) -> bool:
        """A completion with A = 0 has exactly zero loss and gradient (no KL, no entropy bonus, and no entropy
        quantile, whose threshold counts every row): the trainer may leave it out of the forward pass."""
        return self.beta == 0.0 and not self.entropy_needed


@dataclass(frozen=True)
class Share:
    """Where a micro-batch sits in its update: the counts its loss is divided by, so that the micro-batches'
    losses sum to the update's. None means "those of the tensors given" (one micro-batch, one pass).

    rows / tokens: the micro-batch's rows and loss tokens (the trainer may pass a part of them: rows with zero
    loss left out, or one of several passes). accum: micro-batches summed into one update (grad_accum).
    update_tokens: dapo / cispo / vespo's normaliser, the loss tokens of the whole generation batch (every
    process) per update, N_gen x grad_accum / steps_per_generation (TRL's num_items_in_batch rescaled).
    processes: processes whose gradients are averaged (DDP): each divides by update_tokens / processes."""

    rows: int | None = None
    tokens: float | None = None
    accum: int = 1
    update_tokens: float | None = None
    processes: int = 1


# ---- per-token quantities ---------------------------------------------------------------------------------
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """K = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 (Schulman's k3: unbiased, non-negative)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def log_importance_weights(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """log rho: per token (B, T), or GSPO's per sequence (B, 1), the length-mean of the token log-ratios."""
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"unknown importance_sampling_level {level!r}")


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      epsilon: float, epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min(rho A, clip(rho, 1-eps, 1+eps_high) A) per token; returns (surrogate, rho). A: (B,) or (B, T)."""
    rho = torch.exp(logp - old_logp)
    return clipped(rho, _col(advantages), epsilon, epsilon_high), rho


def clipped(rho: torch.Tensor, adv: torch.Tensor, epsilon: float, epsilon_high: float,
            delta: float | None = None) -> torch.Tensor:
    """min(min(rho, delta) A, clip(rho, 1-eps, 1+eps_high) A): PPO's clip, with INTELLECT-2's upper bound delta on
    the unclipped term when given (the clipped term keeps the unbounded rho, as TRL)."""
    bounded = torch.clamp(rho, 1 - epsilon, 1 + epsilon_high) * adv
    if delta is not None:
        rho = torch.clamp(rho, max=delta)
    return torch.min(rho * adv, bounded)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      pool: torch.Tensor | None = None) -> torch.Tensor:
    """True on the tokens whose entropy reaches the (1 - quantile) quantile of `pool`: the entropies of the
    micro-batch's tokens on every process (default: those of `mask`, one process)."""
    values = entropy[mask.bool()].float() if pool is None else pool.float()
    if values.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(values.detach(), 1 - quantile)
    return ((entropy * mask.float()) >= threshold) & mask.bool()


def acting_tokens(entropy: torch.Tensor | None, mask: torch.Tensor, objective: Objective,
                  pool: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens the policy term (and the entropy bonus) acts on: the mask, less the low-entropy tokens under
    top_entropy_quantile < 1."""
    if objective.top_entropy_quantile >= 1.0:
        return mask
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the policy's entropy")
    return mask * high_entropy_mask(entropy, mask, objective.top_entropy_quantile, pool)


def applied_entropy_coef(coef: float, last_entropy: float, target: float, adaptive: bool) -> float:
    """The bonus's coefficient for an update: the static coef, or (adaptive) coef only while the entropy measured
    at the previous update is at or below the target (inf before the first: no bonus)."""
    return coef if not adaptive or last_entropy <= target else 0.0


def adapt_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """Skywork-OR1's controller after an update whose acting tokens' mean entropy was `entropy`: coef + delta
    (at most `high`) when it is at or below the target, coef - delta (at least `low`) above it."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def off_policy_mask(advantages: torch.Tensor, logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """(B, 1): 0 on a sequence with A < 0 whose mean log(pi_sampling / pi_theta) over its tokens exceeds the
    threshold (the off-policy sequences DeepSeek-V3.2 drops), 1 elsewhere."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    seq = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (seq <= threshold)).to(mask.dtype)


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, k_pos: float,
                  lambda_pos: float, k_neg: float, lambda_neg: float) -> torch.Tensor:
    """(B, 1) phi(w) = e^lambda w^k e^(-lambda w) of the sequence ratio w = prod_t rho_t (log-space, clamped to
    [log 1e-8, 20] as VESPO's code), k and lambda by the advantage's sign; a weight, never differentiated."""
    low = math.log(1e-8)
    log_w = torch.clamp(torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True), low, 20.0)
    pos = advantages >= 0
    k = torch.where(pos, k_pos, k_neg)
    lam = torch.where(pos, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _col(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


# ---- aggregation ------------------------------------------------------------------------------------------
def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str = "grpo",
              max_completion_tokens: int | None = None, share: Share = Share()) -> torch.Tensor:
    """Reduce per-token terms to this micro-batch's part of the update's loss (per_token * mask summed, then):

    grpo, sapo: sum_i (1/T_i) sum_t x_it / (B accum)       the study's per-sequence mean
    bnpo:       / (sum mask x accum)                        token mean over the micro-batch
    dr_grpo:    / (B x max_completion_tokens x accum)       no length normalisation
    luspo:      / (B accum)                                  sequence sums: each sequence weighs by its length
    dapo, cispo, vespo: / (update_tokens / processes)       token mean over the whole generation batch

    B, sum mask and update_tokens come from `share` when given (see Share)."""
    m = mask.to(per_token.dtype)
    rows = per_token.size(0) if share.rows is None else share.rows
    rows_acc = max(rows, 1) * share.accum
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / rows_acc
    if loss_type == "luspo":
        return (per_token * m).sum() / rows_acc
    if loss_type == "bnpo":
        tokens = m.sum() if share.tokens is None else torch.tensor(float(share.tokens), dtype=per_token.dtype)
        return (per_token * m).sum() / (tokens.clamp(min=1.0) * share.accum)
    if loss_type in BATCH_TOKEN_LOSSES:
        tokens = share.update_tokens
        if tokens is None:  # one micro-batch: the generation batch is the micro-batch
            tokens = float(m.sum()) if share.tokens is None else float(share.tokens)
            tokens *= share.accum
        return (per_token * m).sum() / (max(float(tokens), 1.0) / share.processes)
    if loss_type == "dr_grpo":
        if max_completion_tokens is None:
            raise ValueError("dr_grpo needs max_completion_tokens")
        return (per_token * m).sum() / (max(rows, 1) * max_completion_tokens * share.accum)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def clip_fractions(rho: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float,
                   epsilon_high: float, n_tokens: float | None = None) -> dict[str, float]:
    """Fractions where the clip is active: low (rho < 1-eps, A < 0), high (rho > 1+eps_high, A > 0), of the tokens
    (rho per token) or of the sequences (rho per sequence, GSPO), over `n_tokens` (the micro-batch's count, rows
    left out included) or those of `mask`."""
    adv = _col(advantages)
    low = (rho < 1 - epsilon) & (adv < 0)
    high = (rho > 1 + epsilon_high) & (adv > 0)
    m = mask.float() if rho.size(-1) == mask.size(-1) else torch.ones(rho.shape)
    tokens = max(float(m.sum()) if n_tokens is None else float(n_tokens), 1.0)
    frac = lambda x: float((x.float() * m).sum()) / tokens  # noqa: E731
    return {"clip_fraction_low": frac(low), "clip_fraction_high": frac(high), "policy_clip_fraction": frac(low | high)}


# ---- the sampler against the trainer -----------------------------------------------------------------------
def sampler_gap(logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The mismatch between the sampler and the trainer on the same policy and tokens (metrics.SAMPLER_KEYS):
    the ratio pi_train / pi_sampler per token (min, mean, max), mean and max |log pi_train - log pi_sampler|, and
    the sampler-vs-trainer KL estimate mean(log pi_sampler - log pi_train) over the sampled tokens. Tokens where
    mask is 0 (or logp is NaN: not computed) are left out; {} when none is left."""
    keep = mask.bool() & ~torch.isnan(logp)
    if not bool(keep.any()):
        return {}
    d = (logp[keep] - sampling_logp[keep]).double()
    ratio = d.exp()
    return {"sampler_ratio_min": ratio.min().item(), "sampler_ratio_mean": ratio.mean().item(),
            "sampler_ratio_max": ratio.max().item(), "sampler_logp_diff": d.abs().mean().item(),
            "sampler_logp_diff_max": d.abs().max().item(), "sampler_kl": (-d).mean().item()}


# ---- the loss ---------------------------------------------------------------------------------------------
def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, objective: Objective = Objective(),
              share: Share = Share(), *, entropy: torch.Tensor | None = None,
              sampling_logp: torch.Tensor | None = None,
              entropy_pool: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """-J and its diagnostics, TRL 1.16's `_compute_loss` term by term. old_logp None means on-policy (rho = 1
    value-wise); `entropy` (B, T) is the policy's per-token entropy, needed by top_entropy_quantile and the bonus;
    `sampling_logp` is the sampler's log-prob (the off-policy mask; default old_logp, as TRL without vLLM);
    `entropy_pool` the micro-batch's token entropies on every process (the quantile's; default these).

    The weighting is `aggregate`'s, by `share`: with the micro-batch's counts the loss and the clip fractions
    are those of the whole micro-batch, summed over its parts."""
    o = objective
    adv = _col(advantages)
    old_logp = logp.detach() if old_logp is None else old_logp
    stats: dict[str, float] = {}
    acts = acting_tokens(entropy, mask, o, entropy_pool)  # the tokens the policy term acts on
    log_w = log_importance_weights(logp, old_logp, mask, o.importance_sampling_level)
    rho = torch.exp(log_w)
    if o.beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = kl_k3(logp, ref_logp)
        if o.use_bias_correction_kl:
            kl = kl * rho
    if o.loss_type in CLIP_FAMILY:
        per_token = -clipped(rho, adv, o.epsilon, o.eps_high, o.delta)
    elif o.loss_type == "cispo":  # MiniMax-M1: the ratio clipped from above and detached weighs log pi
        per_token = -torch.clamp(rho, max=o.eps_high).detach() * adv * logp
    elif o.loss_type == "sapo":  # a soft gate in place of the clip, temperature by the advantage's sign
        tau = torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (rho - 1)) * 4 / tau * adv
    elif o.loss_type == "vespo":
        phi = vespo_weights(adv, logp - old_logp, mask, o.vespo_k_pos, o.vespo_lambda_pos, o.vespo_k_neg,
                            o.vespo_lambda_neg)
        per_token = -phi * adv * logp
    else:
        raise ValueError(f"unknown loss_type {o.loss_type!r}")
    if o.off_policy_mask_threshold is not None:
        sampled = old_logp if sampling_logp is None else sampling_logp
        per_token = per_token * off_policy_mask(adv, logp, sampled, mask, o.off_policy_mask_threshold)
    if acts is not mask:
        per_token = per_token * acts
    if o.beta != 0.0:  # the penalty, and its value as the logged KL (the trainer measures it itself when beta = 0)
        per_token = per_token + o.beta * kl
        stats["kl"] = masked_mean(kl.detach(), mask).item()
    loss = aggregate(per_token, mask, o.loss_type, o.max_completion_tokens, share)
    if o.entropy_coef != 0.0 or o.use_adaptive_entropy:  # L - coef x mean H over the acting tokens, per micro-batch
        if entropy is None:
            raise ValueError("the entropy bonus needs the policy's entropy")
        loss = loss - o.entropy_coef * (entropy * acts).sum() / acts.sum().clamp(min=1.0) / share.accum
    n = share.tokens if rho.size(-1) == mask.size(-1) else share.rows  # token ratios, or GSPO's per sequence
    if o.loss_type in CLIP_FAMILY:  # rho < 1 - eps with A < 0, rho > 1 + eps_high with A > 0 (rho after delta)
        bounds = o.epsilon, o.eps_high
        rho = torch.clamp(rho, max=o.delta) if o.delta is not None else rho
    elif o.loss_type == "cispo":  # rho > eps_max with A > 0: where the weight's clamp is active
        bounds = math.inf, o.eps_high - 1
    else:  # sapo, vespo: no clip
        bounds = math.inf, math.inf
    stats.update(clip_fractions(rho.detach(), adv, mask, *bounds, n))
    return loss, stats
