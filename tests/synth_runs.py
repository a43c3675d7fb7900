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


ALERT_FAULTS = ("no_update", "update_spike", "kl_spike", "truncation", "entropy_collapse", "zero_std",
                "reward_accuracy_gap", "sampler_mismatch")


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
               "frac_groups_shaping_only": 0.05, "loss": 0.01, "grad_norm": 0.5,
               "sampler_logp_diff": 2e-6,  # a float32 sampler's rounding
               "update_norm": 0.02 * (1.5 - p)}  # AdamW's steps shrink as its second moments settle
        if fault == "kl_spike" and s == 25:
            rec["kl"] *= 10
        if fault == "update_spike" and s == 25:
            rec["update_norm"] *= 8
        if fault == "truncation" and late:
            rec["completion_clipped_ratio"] = 0.6
        if fault == "entropy_collapse" and late:
            rec["entropy"] = 0.02
        if fault == "sampler_mismatch" and late:  # the gap grows 1e-4 per step from step 20
            rec["sampler_logp_diff"] = 1e-4 * (s - 19)
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


# ---- foreign logs: each trainer's documented formats, for the readers (tests/test_foreign_variants.py) ---------
# TRL log_history key spellings by version (trl/trainer/grpo_trainer.py `_metrics`): < 0.16 completion_length and
# rewards/<f>; 0.16 completions/* and rewards/<f>/mean|std, clip_ratio; 0.17+ clip_ratio/low_mean.., frac_reward_
# zero_std; 0.19+ entropy. HF Trainer adds loss, grad_norm, learning_rate, epoch, step and a last summary record.
TRL_VERSIONS = ("0.14", "0.16", "0.23", "1.16")


def trl_history(version: str, steps: list[int], funcs: dict, eval_every: int = 0, nan_at: int | None = None,
                kl: bool = True) -> list[dict]:
    """log_history as TRL `version` writes it; funcs: reward name -> (mean(step), std(step))."""
    old = version == "0.14"
    out = []
    for s in steps:
        means = {f: m(s) for f, (m, _) in funcs.items()}
        rec = {"loss": 0.01 * s, "grad_norm": 0.0 if s % 4 == 0 else 0.5 + 0.01 * s,
               "learning_rate": 1e-5 * s / steps[-1], "epoch": s / steps[-1], "step": s,
               "reward": sum(means.values()), "reward_std": 0.3}
        if kl:
            rec["kl"] = 0.001 * s
        if old:
            rec["completion_length"] = 100.0 + s
            rec.update({f"rewards/{f}": v for f, v in means.items()})
        else:
            rec.update({"completions/mean_length": 100.0 + s, "completions/min_length": 5.0,
                        "completions/max_length": 256.0, "completions/clipped_ratio": 0.1,
                        "completions/mean_terminated_length": 90.0 + s, "completions/min_terminated_length": 5.0,
                        "completions/max_terminated_length": 250.0})
            for f, (m, sd) in funcs.items():
                rec[f"rewards/{f}/mean"], rec[f"rewards/{f}/std"] = m(s), sd(s)
            if version == "0.16":
                rec["clip_ratio"] = 0.0
            else:
                rec.update({"clip_ratio/low_mean": 0.0, "clip_ratio/low_min": 0.0, "clip_ratio/high_mean": 0.0,
                            "clip_ratio/high_max": 0.0, "clip_ratio/region_mean": 0.0, "frac_reward_zero_std": 0.25,
                            "num_tokens": 1000.0 * s, "entropy": 0.8 - 0.001 * s})
        if s == nan_at:
            rec["grad_norm"] = math.nan
            rec["loss"] = math.inf
        out.append(rec)
        if eval_every and s % eval_every == 0:
            ev = {"eval_loss": 0.02, "eval_reward": 0.5 + 0.01 * s, "eval_runtime": 3.0,
                  "eval_samples_per_second": 10.0, "epoch": s / steps[-1], "step": s}
            if not old:
                ev["eval_completions/mean_length"] = 80.0
                ev.update({f"eval_rewards/{f}/mean": m(s) for f, (m, _) in funcs.items()})
            out.append(ev)
    out.append({"train_runtime": 100.0, "train_samples_per_second": 1.0, "train_steps_per_second": 0.1,
                "total_flos": 0.0, "train_loss": 0.1, "epoch": 1.0, "step": steps[-1]})
    return out


def write_trl_state(folder: Path, history: list[dict], crlf: bool = False, gz: bool = False) -> Path:
    """trainer_state.json as HF Trainer.save_state writes it (json.dumps allows NaN/Infinity literals)."""
    import gzip
    import json

    folder.mkdir(parents=True, exist_ok=True)
    steps = [h["step"] for h in history if "step" in h]
    text = json.dumps({"best_metric": None, "epoch": 1.0, "global_step": max(steps), "is_world_process_zero": True,
                       "log_history": history, "logging_steps": 1, "max_steps": max(steps)}, indent=2)
    if crlf:
        text = text.replace("\n", "\r\n")
    path = folder / ("trainer_state.json.gz" if gz else "trainer_state.json")
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def wandb_csv(path: Path, rows: list[dict], step_key: str = "_step", run_name: str | None = None) -> Path:
    """A W&B export: the API history (`run.history().to_csv`: _step, _runtime, _timestamp, the logged keys, blank
    where a row did not log a key) or, with run_name, the UI chart export ("Step", "RUN - key", __MIN/__MAX)."""
    import csv

    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        if run_name is None:
            w.writerow(["_step", "_runtime", "_timestamp", *keys])
            for i, r in enumerate(rows):
                w.writerow([r.get(step_key, i), 1.5 * i, 1.7e9 + i, *("" if r.get(k) is None else r[k]
                                                                      for k in keys)])
        else:
            cols = [k for k in keys if k != step_key]
            w.writerow(["Step", *(f"{run_name} - {k}{sfx}" for k in cols for sfx in ("", "__MIN", "__MAX"))])
            for r in (r for r in rows if step_key in r):  # a chart plots one step axis
                w.writerow([r[step_key], *(("" if r.get(k) is None else r[k]) for k in cols for _ in range(3))])
    return path


def wandb_trl_rows(history: list[dict]) -> list[dict]:
    """HF's WandbCallback: train keys under train/, eval_x as eval/x, the step as train/global_step."""
    out = []
    for h in history:
        if "train_runtime" in h:
            continue
        row = {"train/global_step": h["step"]}
        for k, v in h.items():
            if k == "step":
                continue
            row[f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"] = v
        out.append(row)
    return out


# verl (verl/trainer/ppo/ray_trainer.py, metric_utils.compute_data_metrics): critic/score/*, critic/rewards/*,
# actor/*, response_length/*, val-core/<ds>/<var>/mean@N, reward_extra_info/<f>; dynamic sampling's rollout/*
def verl_data(s: int, ppo: bool = False, funcs: tuple[str, ...] = ("acc", "format"), val: bool = False) -> dict:
    d = {"critic/score/mean": 0.1 + 0.01 * s, "critic/score/max": 1.0, "critic/score/min": 0.0,
         "critic/rewards/mean": 0.1 + 0.01 * s, "actor/entropy": 0.9 - 0.005 * s, "actor/pg_loss": -0.01,
         "actor/grad_norm": 0.0 if s % 5 == 0 else 0.3, "actor/lr": 1e-6, "actor/pg_clipfrac": 0.002,
         "actor/ppo_kl": 0.0001, "response_length/mean": 300.0 + s, "response_length/max": 1024.0,
         "response_length/min": 20.0, "response_length/clip_ratio": 0.05, "timing_s/step": 30.0,
         "training/global_step": s, "training/epoch": 0}
    if ppo:
        d.update({"critic/kl": 0.002, "critic/kl_coeff": 0.001, "critic/vf_loss": 0.5})
    else:
        d.update({"actor/kl_loss": 0.001 * s, "actor/kl_coef": 0.001,
                  "rollout/too_bad_sample_ratio": 0.2, "rollout/too_good_sample_ratio": 0.1})
    d.update({f"reward_extra_info/{f}": 0.05 * (i + 1) + 0.001 * s for i, f in enumerate(funcs)})
    if val:
        d.update({"val-core/openai/gsm8k/acc/mean@1": 0.3 + 0.01 * s, "val-core/openai/gsm8k/reward/mean@1":
                  0.3 + 0.01 * s, "val-aux/openai/gsm8k/score/mean@1": 0.3 + 0.01 * s})
    return d


def verl_console_line(step: int, data: dict, style: str = "pformat") -> str:
    """One line of verl's console logger (tracking.py concat_dict_to_str): values as pprint.pformat of numpy
    scalars (np.float64(0.5), nan), as f"{v:.3f}" (older verl) or as format_metric_value (5.000000e-07)."""
    def fmt(v):
        if style == "pformat":
            return f"np.float64({v!r})" if isinstance(v, float) else f"np.int64({v})"
        if style == "3f":
            return f"{v:.3f}"
        return f"{v:.6e}" if v and (abs(v) < 1e-3 or abs(v) >= 1e4) else f"{v:.8f}".rstrip("0").rstrip(".") or "0"
    return f"step:{step} - " + " - ".join(f"{k}:{fmt(v)}" for k, v in data.items())


def write_verl_console(path: Path, steps: list[int], style: str = "pformat", prefix: str = "(TaskRunner pid=7) ",
                       crlf: bool = False, torn: bool = False, gz: bool = False, nan_at: int | None = None,
                       val_every: int = 0, ppo: bool = False) -> Path:
    import gzip

    lines = ["2025-06-01 INFO Ray started", "(TaskRunner pid=7) Training Progress:  10%|#         | 1/10"]
    if val_every:  # verl validates the base first: a step-0 line with validation keys only
        lines.append(prefix + verl_console_line(0, {k: v for k, v in verl_data(0, ppo, val=True).items()
                                                    if k.startswith("val")}, style))
    for s in steps:
        d = verl_data(s, ppo, val=bool(val_every) and s % val_every == 0)
        if s == nan_at:
            d["actor/grad_norm"] = math.nan
        lines.append(prefix + verl_console_line(s, d, style))
    text = ("\r\n" if crlf else "\n").join(lines) + "\n"
    if torn:
        text += prefix + verl_console_line(steps[-1] + 1, verl_data(steps[-1] + 1, ppo), style)[:60]
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def write_verl_jsonl(path: Path, steps: list[int], torn: bool = False, val_every: int = 0) -> Path:
    import json

    text = "".join(json.dumps({"step": s, "data": verl_data(s, val=bool(val_every) and s % val_every == 0)}) + "\n"
                   for s in steps)
    if torn:
        text += json.dumps({"step": steps[-1] + 1, "data": verl_data(steps[-1] + 1)})[:50]
    path.write_text(text)
    return path


# OpenRLHF (openrlhf/trainer/ppo_utils/loggers.py; ppo_actor / experience_maker status keys): train/<k> with
# train/global_step, eval/<k> with eval/epoch; GRPO runs log no critic keys
def openrlhf_status(s: int, ppo: bool = False) -> dict:
    d = {"policy_loss": -0.02, "actor_lr": 5e-7, "kl": 0.001 * s, "reward": 0.2 + 0.02 * s, "score": 0.2 + 0.02 * s,
         "return": 0.2, "response_length": 400.0 + s, "total_length": 600.0 + s, "response_clip_ratio": 0.05,
         "ppo_clip_ratio": 0.01, "ppo_kl": 0.0002, "entropy_loss": 0.7 - 0.005 * s}
    if ppo:
        d.update({"critic_loss": 0.4, "values": 0.1, "critic_lr": 9e-6})
    return d


def openrlhf_rows(steps: list[int], ppo: bool = False, eval_every: int = 0) -> list[dict]:
    rows = []
    for s in steps:
        rows.append({"train/global_step": s, **{f"train/{k}": v for k, v in openrlhf_status(s, ppo).items()}})
        if eval_every and s % eval_every == 0:
            rows.append({"eval/epoch": s, "eval/reward_mean": 0.3 + 0.01 * s, "eval/pass1": 0.3 + 0.01 * s,
                         "eval/math_pass1": 0.3 + 0.01 * s, "eval/response_length_mean": 380.0})
    return rows


def write_openrlhf_tensorboard(folder: Path, steps: list[int], ppo: bool = False, eval_every: int = 0) -> Path:
    """Event files as OpenRLHF's TensorboardLogger writes them (torch.utils.tensorboard.SummaryWriter at
    use_tensorboard/run_name, add_scalar("train/<k>", v, global_step))."""
    from torch.utils.tensorboard import SummaryWriter

    run = folder / "grpo_run"
    w = SummaryWriter(log_dir=str(run))
    for s in steps:
        for k, v in openrlhf_status(s, ppo).items():
            w.add_scalar(f"train/{k}", v, s)
        if eval_every and s % eval_every == 0:
            w.add_scalar("eval/pass1", 0.3 + 0.01 * s, s)
            w.add_scalar("eval/reward_mean", 0.3 + 0.01 * s, s)
        w.add_text("train/generated_samples", "Sample: 1+1=2", s)
    w.close()
    return run
