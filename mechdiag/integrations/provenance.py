"""Where each config value of a foreign run comes from: read from the run, inferred from its logs (with the
evidence), or unknown (absent), and the run's own maximum reward.

The readers fill a Provenance and store it in summary.json ("provenance"); recommend reads it (run.Run.provenance)
so that no advice starts from a value the run did not have, and the report shows only the values the run holds.
`fields` names each mechdiag key in the trainer's own terms (GRPOConfig fields, verl config keys).
"""

from __future__ import annotations

import math

from mechdiag.integrations.trl_args import trl_snippet
from mechdiag.metrics import is_number, whole_batches_at_cap

READ, INFERRED = "read", "inferred"
CLIPPED_SEEN = 1e-9  # a clipped share above this at a step: the length cap was hit there

# mechdiag key -> the trainer's own name for it
VERL_FIELDS = {"learning_rate": "actor_rollout_ref.actor.optim.lr", "beta": "actor_rollout_ref.actor.kl_loss_coef",
               "max_completion_tokens": "data.max_response_length", "group_size": "actor_rollout_ref.rollout.n",
               "temperature": "actor_rollout_ref.rollout.temperature", "top_p": "actor_rollout_ref.rollout.top_p",
               "epsilon": "actor_rollout_ref.actor.clip_ratio",
               "epsilon_high": "actor_rollout_ref.actor.clip_ratio_high",
               "max_grad_norm": "actor_rollout_ref.actor.grad_clip", "lora.r": "actor_rollout_ref.model.lora_rank",
               "lora.alpha": "actor_rollout_ref.model.lora_alpha", "loss_type": "actor_rollout_ref.actor.loss_agg_mode",
               "prompts_per_step": "data.train_batch_size", "rewards.weights": "reward_model.reward_manager (weights)",
               "task.options": "data.train_files"}
OPENRLHF_FIELDS = {"learning_rate": "--actor_learning_rate", "beta": "--init_kl_coef",
                   "group_size": "--n_samples_per_prompt", "max_completion_tokens": "--generate_max_len",
                   "temperature": "--temperature", "top_p": "--top_p", "epsilon": "--eps_clip",
                   "max_grad_norm": "--max_norm", "lora.r": "--lora_rank",
                   "lora.alpha": "--lora_alpha", "prompts_per_step": "--rollout_batch_size",
                   "task.options": "--prompt_data"}


class Provenance:
    def __init__(self, trainer: str, fields: dict[str, str] | None = None):
        self.trainer = trainer
        self.fields = dict(fields or {})
        self.keys: dict[str, dict] = {}
        self.max_reward: dict | None = None

    def read(self, key: str, value, where: str) -> None:
        self.keys[key] = {"how": READ, "value": value, "evidence": where}

    def infer(self, key: str, value, evidence: str, bound: str = "=") -> None:
        if key not in self.keys:  # a value read from the run beats any inference
            self.keys[key] = {"how": INFERRED, "value": value, "bound": bound, "evidence": evidence}

    def values(self) -> dict:
        return {k: e["value"] for k, e in self.keys.items()}

    def to_dict(self) -> dict:
        return {"trainer": self.trainer, "fields": self.fields, "keys": self.keys, "max_reward": self.max_reward}


def _series(metrics: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(m["step"]), float(m[key])) for m in metrics if is_number(m.get(key)) and is_number(m.get("step"))]


def infer_from_logs(prov: Provenance, metrics: list[dict], length_name: str, lr_name: str) -> None:
    """The config values a run's own logs show: the completion cap (the longest completion, where completions were
    cut) and the learning rate (its logged peak)."""
    lengths = _series(metrics, "completion_length_max")
    clipped = dict(_series(metrics, "completion_clipped_ratio"))
    if lengths:
        top = max(v for _, v in lengths)
        at = [s for s, v in lengths if v == top]
        cut = [s for s in at if clipped.get(s, 0.0) > CLIPPED_SEEN]
        evidence = f"{length_name} reached {top:g} on {len(at)} step(s)" + (
            f", with completions cut at {len(cut)} of them" if cut else "")
        prov.infer("max_completion_tokens", int(top), evidence, "=" if cut else ">=")
    elif (cap := whole_batches_at_cap(metrics)) is not None:
        prov.infer("max_completion_tokens", cap[0], f"the mean completion_length was exactly {cap[0]} (its maximum) "
                   f"at {len(cap[1])} steps: every completion of those batches ran to the same length, the cap")
    lrs = _series(metrics, "lr")
    if lrs and max(v for _, v in lrs) > 0:
        step, top = max(lrs, key=lambda sv: sv[1])
        prov.infer("learning_rate", top, f"{lr_name} peaked at {top:.3g} (step {step})",
                   "=" if step != lrs[-1][0] else ">=")


def infer_reward_weights(metrics: list[dict]) -> tuple[dict[str, float], str] | None:
    """reward = sum_f w_f * reward/<f> at every logged step (TRL's weighted sum of per-function means): the weights
    solved by least squares, kept when they reproduce the logged reward (max residual under 1e-3 of its scale)."""
    import numpy as np  # noqa: PLC0415 - numpy only for this solve

    names = sorted({k.split("/", 1)[1] for m in metrics for k in m if k.startswith("reward/")})
    rows = [m for m in metrics if is_number(m.get("reward")) and all(is_number(m.get(f"reward/{n}")) for n in names)]
    if not names or len(rows) < len(names) + 2:
        return None
    a = np.array([[float(m[f"reward/{n}"]) for n in names] for m in rows], dtype=np.float64)
    b = np.array([float(m["reward"]) for m in rows], dtype=np.float64)
    w, *_ = np.linalg.lstsq(a, b, rcond=None)
    w = np.where(np.abs(a).max(axis=0) > 0, w, 1.0)  # a function that never paid: its weight is not seen
    resid = float(np.abs(a @ w - b).max())
    scale = max(1e-9, float(np.abs(b).max()))
    if resid > 1e-3 * scale:
        return None
    weights = {n: round(float(x), 4) for n, x in zip(names, w, strict=True)}
    return weights, f"reward = sum of w_f x rewards/<f> on all {len(rows)} steps (max residual {resid:.2g})"


def observed_max_reward(metrics: list[dict], weights: dict[str, float] | None, batch_max_key: str | None = None) \
        -> tuple[float, str]:
    """The run's own best total reward: sum over its reward functions of weight x the function's highest logged
    mean (a function that never paid counts 0), else the highest batch maximum (verl's critic/score/max) or reward
    logged; 1.0 only when the log shows no positive reward at all."""
    batch = [v for _, v in _series(metrics, batch_max_key)] if batch_max_key else []
    if batch and max(batch) > 0:  # a logged batch maximum is the best total seen, no weights needed
        return max(batch), f"highest logged batch maximum of the score ({batch_max_key})"
    names = sorted({k.split("/", 1)[1] for m in metrics for k in m if k.startswith("reward/")})
    if names:
        w = weights or {}
        best = {n: max((v for _, v in _series(metrics, f"reward/{n}")), default=0.0) for n in names}
        total = math.fsum(max(0.0, float(w.get(n, 1.0)) * best[n]) for n in names)
        if total > 0:
            parts = ", ".join(f"{float(w.get(n, 1.0)):g} x {best[n]:.3g} ({n})" for n in names)
            return total, f"sum of weight x highest logged mean per reward function: {parts}"
    vals = [v for _, v in _series(metrics, "reward")]
    if vals and max(vals) > 0:
        return max(vals), "highest logged mean reward"
    return 1.0, "no positive reward logged: 1.0"


def openrlhf_args(changes, fields: dict | None = None) -> str:
    """The refined settings as OpenRLHF command-line arguments (train_ppo_ray's --flags), for the changes it has
    an argument for."""
    lines = ["# mechdiag recommend: the refined settings as OpenRLHF arguments (only what changes)"]
    for c in changes:
        name = {**OPENRLHF_FIELDS, **(fields or {})}.get(c.key)
        lines.append(f"{name} {c.new}" if name else f"# {c.key}: {c.old!r} -> {c.new!r} has no OpenRLHF argument")
    return "\n".join(lines) + "\n"


# the file beside recommend's --out that holds the refined settings in the trainer's own terms
OWN_TERMS_SUFFIX = {"trl": ".trl.py", "unsloth": ".trl.py", "verl": ".verl.txt", "openrlhf": ".openrlhf.txt"}
OWN_TERMS_NAME = {"trl": "TRL", "unsloth": "TRL", "verl": "verl", "openrlhf": "OpenRLHF"}


def own_terms_text(trainer: str | None, changes, cfg, fields: dict | None = None) -> str | None:
    """The refined settings as the trainer that wrote the run takes them (`fields`: the run's own names, its
    provenance); None for a custom loop or mechdiag."""
    if trainer in ("trl", "unsloth"):
        return trl_snippet(changes, cfg)
    if trainer == "verl":
        return verl_overrides(changes, fields)
    if trainer == "openrlhf":
        return openrlhf_args(changes, fields)
    return None


def verl_overrides(changes, fields: dict | None = None) -> str:
    """The refined settings as verl command-line overrides (key=value), for the changes verl has a key for."""
    lines = ["# mechdiag recommend: the refined settings as verl overrides (only what changes)"]
    for c in changes:
        name = {**VERL_FIELDS, **(fields or {})}.get(c.key)
        lines.append(f"{name}={c.new}" if name else f"# {c.key}: {c.old!r} -> {c.new!r} has no verl key")
    return "\n".join(lines) + "\n"
