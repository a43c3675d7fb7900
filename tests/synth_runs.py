"""Synthetic but realistic run directories for report tests (no training needed)."""

from __future__ import annotations

import math
import random
from pathlib import Path

from mechdiag import config as C
from mechdiag.run import RunDir

XSS_SCRIPT = "<script>document.title='pwned'</script>"
XSS_IMG = "<img src=x onerror=\"document.title='pwned'\">"
XSS_MARK = "<svg onload=\"document.documentElement.setAttribute('data-pwned','1')\"></svg>"
MODULES = C.ALL_MODULES


def make_run(path: Path, seed: int = 42, steps: int = 200, layers: int = 4, eval_every: int = 20,
             disp_every: int = 20, overrides: list[str] | None = None, streams: tuple[str, ...] | None = None,
             hostile: bool = True, summary: bool = True) -> RunDir:
    """Write a run directory like `mechdiag train` would. `streams` limits which streams exist (partial runs)."""
    rng = random.Random(seed)
    run = RunDir(path, create=True)
    cfg = C.load(None, [f"seed={seed}", f"max_steps={steps}", *(overrides or [])])
    C.save(cfg, run.config_path)
    want = set(streams) if streams is not None else {"metrics", "eval", "samples", "displacement", "shift",
                                                       "eval_benchmarks"}
    if "metrics" in want:
        recs = []
        for s in range(1, steps + 1):
            p = 1 - math.exp(-s / 60)
            recs.append({"step": s, "reward": 0.4 + 2.2 * p + rng.gauss(0, 0.15), "reward_cv": 0.9 - 0.6 * p +
                         rng.gauss(0, 0.04), "kl": 0.002 + 0.03 * p + abs(rng.gauss(0, 0.003)),
                         "completion_clipped_ratio": max(0.0, 0.3 - 0.25 * p + rng.gauss(0, 0.02)),
                         "entropy": 1.2 - 0.5 * p, "completion_length": 40 - 12 * p, "reward_std": 0.5,
                         "frac_zero_std": 0.2 * p, "policy_clip_fraction": 0.0, "loss": rng.gauss(0, 0.01),
                         "grad_norm": abs(rng.gauss(0.5, 0.1)), "lr": 2e-3, "step_time": 0.4, "tokens_per_s": 900.0,
                         "reward/correctness": 1.6 * p, "reward/format": 0.5 * p})
        run.append("metrics", recs)
    evals = list(range(0, steps + 1, eval_every)) or [0]
    if evals[-1] != steps:
        evals.append(steps)
    if "eval" in want:
        run.append("eval", [{"step": s, "accuracy": 0.1 + 0.5 * (1 - math.exp(-s / 70)) + rng.gauss(0, 0.01),
                             "eval_reward": 0.5 + 2 * (1 - math.exp(-s / 70)), "entropy": 1.1 - 0.4 * s / steps,
                             "completion_length": 38 - 10 * s / steps, "pass@1": 0.3, "pass@3": 0.5}
                            for s in evals])
    if "displacement" in want:
        rows = []
        for s in range(disp_every, steps + 1, disp_every):
            for lay in range(layers):
                for m in MODULES:
                    ref = 4.0 + lay + 0.1 * MODULES.index(m)
                    scale = (0.5 + lay / layers) * (1.5 if m in ("v_proj", "o_proj") else 1.0)
                    delta = ref * 0.01 * scale * math.sqrt(s / steps) * (1 + rng.gauss(0, 0.05))
                    rows.append({"step": s, "name": f"model.layers.{lay}.{m}", "layer": lay, "module": m,
                                 "ref_fro": ref, "delta_fro": delta, "rel_fro": delta / ref})
        run.append("displacement", rows)
    if "shift" in want:
        rows = []
        for s in evals[1:]:
            for lay in range(layers):
                v = 0.01 + 0.002 * lay + (0.05 if lay >= layers - 2 else 0.0) * s / steps
                rows.append({"step": s, "layer": lay, "shift": v, "ci_low": v * 0.9, "ci_high": v * 1.1,
                             "cos_dist": v / 3, "increment": v / 2, "logit_kl": v / 10})
        run.append("shift", rows)
    if "eval_benchmarks" in want:
        rows = []
        for bench, base in (("gsm8k", 0.4), ("math500", 0.2), ("arith", 0.6)):
            for metric, bump in (("pass@1", 0.05), ("pass@3", -0.02)):
                rows.append({"benchmark": bench, "metric": metric, "model": "base", "value": base, "n": 100})
                rows.append({"benchmark": bench, "metric": metric, "model": "tuned",
                             "value": base + bump + rng.gauss(0, 0.005), "std": 0.01, "n": 100})
        run.append("eval_benchmarks", rows)
    if "samples" in want:
        rows = []
        for s in range(10, steps + 1, 10):
            for g in range(2):
                for i in range(4):
                    rows.append({"step": s, "group": g, "prompt": f"What is {g} + {s}?",
                                 "completion": f"<reasoning>add</reasoning><answer>{g + s + i % 2}</answer>",
                                 "reward": 2.5 if i % 2 == 0 else 0.5, "advantage": 1.0 if i % 2 == 0 else -1.0,
                                 "split": "train"})
        for i in range(4):
            bad = f"{XSS_SCRIPT} {XSS_IMG}" if hostile and i == 0 else f"<answer>{i}</answer>"
            prompt = f"Q{i}: 7 * {i} = ? & <b>bold</b>" + (f" {XSS_MARK}" if hostile and i == 0 else "")
            rows.append({"step": 0, "group": i, "prompt": prompt, "completion": f"base says {i + 1}",
                         "reward": 0.1, "split": "eval", "model": "base", "correct": False})
            rows.append({"step": steps, "group": i, "prompt": prompt, "completion": bad, "reward": 2.1,
                         "split": "eval", "model": "tuned", "correct": i % 2 == 1})
        run.append("samples", rows)
    if summary:
        run.write_summary({"base_accuracy": 0.1, "base_eval_reward": 0.5, "base_completion_length": 38.0,
                           "final_accuracy": 0.55 + rng.gauss(0, 0.01), "final_eval_reward": 2.3,
                           "final_completion_length": 29.0, "steps": steps})
    return run


ALERT_FAULTS = ("no_update", "kl_spike", "truncation", "entropy_collapse", "zero_std", "reward_accuracy_gap")


def make_alert_run(path: Path, fault: str | None = None, steps: int = 40) -> RunDir:
    """A run as `mechdiag train` writes it, noise-free: healthy (reward and accuracy rise together, small smooth
    KL, few clipped completions, steady entropy, most groups informative, the adapter moving), or with one fault
    of mechdiag.alerts injected from step 20 (step 10 for no_update's displacement and the accuracy of
    reward_accuracy_gap)."""
    if fault is not None and fault not in ALERT_FAULTS:
        raise ValueError(fault)
    run = RunDir(path, create=True)
    C.save(C.load(None, [f"max_steps={steps}"]), run.config_path)
    recs = []
    for s in range(1, steps + 1):
        p = 1 - math.exp(-s / 15)
        late = s >= 20
        rec = {"step": s, "reward": 0.5 + 2.0 * p, "reward_cv": 0.6 - 0.2 * p, "kl": 0.002 + 0.02 * p,
               "completion_clipped_ratio": 0.05, "entropy": 1.2 - 0.3 * p, "completion_length": 30.0,
               "frac_zero_std": 0.2, "frac_groups_all_correct": 0.1, "frac_groups_all_wrong": 0.1,
               "frac_groups_shaping_only": 0.05, "loss": 0.01, "grad_norm": 0.5}
        if fault == "kl_spike" and s == 25:
            rec["kl"] *= 10
        if fault == "truncation" and late:
            rec["completion_clipped_ratio"] = 0.6
        if fault == "entropy_collapse" and late:
            rec["entropy"] = 0.02
        if fault == "zero_std" and late:
            rec.update(frac_zero_std=0.9, frac_groups_all_wrong=0.9, frac_groups_all_correct=0.0)
        recs.append(rec)
    run.append("metrics", recs)
    acc = (lambda s: 0.1) if fault == "reward_accuracy_gap" else (lambda s: 0.1 + 0.4 * (1 - math.exp(-s / 15)))
    run.append("eval", [{"step": s, "accuracy": acc(s), "eval_reward": 0.5 + 2.0 * (1 - math.exp(-s / 15)),
                         "entropy": 1.1, "completion_length": 30.0} for s in range(0, steps + 1, 10)])
    rows = []
    for s in range(10, steps + 1, 10):
        for lay in range(2):
            for m in ("q_proj", "v_proj"):
                delta = 0.0 if fault == "no_update" else 0.01 * s
                rows.append({"step": s, "name": f"model.layers.{lay}.self_attn.{m}.weight", "layer": lay,
                             "module": m, "ref_fro": 4.0, "delta_fro": delta, "rel_fro": delta / 4.0})
    run.append("displacement", rows)
    return run
