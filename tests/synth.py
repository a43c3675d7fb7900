"""Synthetic run directories for the rule tests: records shaped like a real run's (same streams, keys and
cadence), with each signal set by the test to show one symptom, and a simulated trainer whose records react
to the config, for the outer-loop tests."""

from __future__ import annotations

import random

from mechdiag import config as configlib
from mechdiag.config import ALL_MODULES, Config, parse_layers
from mechdiag.run import RunDir


def _curve(spec, t: float) -> float:
    """A constant, or (start, end) linearly in t in [0, 1], or (start, mid, end) piecewise."""
    if isinstance(spec, (int, float)):
        return float(spec)
    if len(spec) == 2:
        return spec[0] + (spec[1] - spec[0]) * t
    a, m, b = spec
    return a + (m - a) * 2 * t if t < 0.5 else m + (b - m) * (2 * t - 1)


def write_run(path, cfg: Config | None = None, *, steps: int = 40, seed: int = 0, reward=(1.0, 2.4),
              reward_cv=0.3, frac_zero_std=0.1, kl=(0.0, 0.015, 0.02), clipped=0.02, length=30.0, entropy=(1.2, 0.9),
              accuracy=(0.2, 0.5), n_evals: int = 3, n_layers: int = 8, layer_mass=None, module_mass=None,
              shift=None, components: dict | None = None, noise: float = 0.01, kl_recorded: bool = True,
              disp_layers: list[int] | None = None, pass_k: dict | None = None,
              samples: list[dict] | None = None, eval_reward=(1.0, 2.0), drop: tuple = (),
              clip_fraction=0.0, sampler_gap=None, ended: dict | None = None) -> RunDir:
    """Write a run directory. Curves are over training time; layer_mass(layer) and module_mass[module] shape
    the displacement rows, shift(layer) the shift rows (defaults: flat). pass_k {"pass@4": curve} adds sampled
    pass@k to the eval records (greedy accuracy is `accuracy`); samples are train samples.jsonl records; `drop`
    names train keys the run does not log."""
    cfg = cfg or configlib.load()
    rng = random.Random(seed)
    rd = RunDir(path, create=True)
    configlib.save(cfg, rd.config_path)
    jit = lambda: rng.gauss(0, noise)  # noqa: E731
    metrics = []
    for step in range(1, steps + 1):
        t = (step - 1) / max(1, steps - 1)
        rec = {"step": step, "reward": _curve(reward, t) + jit(), "reward_cv": max(0.0, _curve(reward_cv, t) + jit()),
               "frac_zero_std": min(1.0, max(0.0, _curve(frac_zero_std, t) + jit())),
               "completion_clipped_ratio": min(1.0, max(0.0, _curve(clipped, t) + jit())),
               "entropy": max(0.0, _curve(entropy, t) + jit()), "completion_length": _curve(length, t),
               "reward_std": 0.4, "policy_clip_fraction": _curve(clip_fraction, t),
               "loss": 0.01, "grad_norm": 0.5, "lr": cfg.learning_rate}
        if kl_recorded:
            rec["kl"] = max(0.0, _curve(kl, t) + jit() * 0.1)
        for name, spec in (components or {}).items():
            rec[f"reward/{name}"] = _curve(spec, t)
        if sampler_gap is not None:  # mean |log pi_train - log pi_sampler|
            rec["sampler_logp_diff"] = _curve(sampler_gap, t)
        metrics.append({k: v for k, v in rec.items() if k not in drop})
    rd.append("metrics", metrics)
    eval_steps = [round(i * steps / (n_evals - 1)) for i in range(n_evals)] if accuracy is not None else []
    evals = [{"step": s, "accuracy": _curve(accuracy, s / steps) + jit() * 0.1,
              **({"eval_reward": _curve(eval_reward, s / steps)} if eval_reward is not None else {}),
              "entropy": _curve(entropy, s / steps), "completion_length": 30.0,
              **{k: _curve(v, s / steps) for k, v in (pass_k or {}).items()}} for s in eval_steps]
    if evals:  # accuracy=None: a run that logs no eval stream
        rd.append("eval", evals)
    if samples:
        rd.append("samples", [{"step": steps, "split": "train", **x} for x in samples])
    layers = disp_layers if disp_layers is not None else parse_layers(cfg.lora.layers, n_layers)
    modules = cfg.lora.target_modules
    disp = []
    for s in range(steps // 2, steps + 1, steps // 2):
        for layer in layers:
            for mod in modules:
                w = (layer_mass(layer) if layer_mass else 1.0) * ((module_mass or {}).get(mod, 1.0))
                delta = (s / steps) * 0.01 * w ** 0.5 * (1 + jit())
                disp.append({"step": s, "name": f"model.layers.{layer}.{mod}.weight", "layer": layer,
                             "module": mod, "ref_fro": 1.0, "delta_fro": delta, "rel_fro": delta})
    rd.append("displacement", disp)
    rd.append("shift", [{"step": s, "layer": layer, "shift": (shift(layer) if shift else 0.02) * s / steps,
                         "ci_low": 0.0, "ci_high": 0.1, "cos_dist": 0.001, "logit_kl": 0.01}
                        for s in eval_steps[1:] for layer in range(n_layers)])
    rd.write_summary({**{f"base_{k}": v for k, v in (evals[0] if evals else {}).items() if k != "step"},
                      **{f"final_{k}": v for k, v in (evals[-1] if evals else {}).items() if k != "step"},
                      **({"read": {"ended": ended}} if ended else {})})  # how a printed log ended (readers)
    return rd


def ends_heavy(n_layers: int = 8, factor: float = 6.0):
    return lambda layer: factor if layer < 2 or layer >= n_layers - 2 else 1.0


def sim_train(cfg: Config, out_dir) -> RunDir:
    """A stand-in trainer whose records react to the config the way the study's runs did: low temperature ->
    few distinct rewards per group; beta 0 -> KL grows and held-out accuracy falls; LoRA on every layer ->
    the update piles up at the ends of the stack. Held-out accuracy is better the more of that is fixed."""
    low_temp = cfg.temperature < 0.7
    no_anchor = cfg.beta == 0
    all_layers = parse_layers(cfg.lora.layers, 8) == list(range(8))
    gain = 0.1 * (not low_temp) + 0.1 * (not no_anchor) + 0.05 * (not all_layers) + 0.01 * (cfg.seed % 3)
    base = 0.3
    final = base - 0.08 if no_anchor else base + gain
    return write_run(out_dir, cfg, seed=cfg.seed, steps=30,
                     reward_cv=0.05 if low_temp else 0.3, frac_zero_std=0.8 if low_temp else 0.1,
                     kl=(0.0, 0.2, 0.4) if no_anchor else (0.0, 0.015, 0.018),
                     accuracy=(base, final), layer_mass=ends_heavy() if all_layers else None,
                     module_mass={m: 1.0 for m in ALL_MODULES})
