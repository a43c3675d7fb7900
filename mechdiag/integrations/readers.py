"""Readers: a TRL GRPOTrainer output_dir or a verl JSONL metrics file into the run-directory shape (mechdiag.run).

TRL (trl 1.16) output_dir:
    trainer_state.json (or checkpoint-N/trainer_state.json)  log_history: one dict per logging step, eval_ keys
    completions/completions_NNNNN.parquet                    step, prompt, completion, one column per reward
                                                             function (unweighted), advantage   (log_completions)
    checkpoint-N/adapter_model.safetensors                   the LoRA adapter at step N
    mechdiag/                                                the run directory MechdiagCallback wrote, if it ran
verl file logger (trainer.logger=[...,'file'], VERL_FILE_LOGGER_PATH): one JSON line {"step": N, "data": {...}}
per step, train and validation keys in one dict; the rollout dump (trainer.rollout_data_dir) is N.jsonl with
input, output, score per completion.

Quirks handled (docs/trl.md): TRL's reward_std and verl's score are BATCH statistics, so reward_cv (the study's
within-group CV) is computed from the completions (grouped by prompt) or taken from the reward-function wrapper's
log; clip metrics are 0 when num_iterations is 1 (ratio exactly 1), kept as the true value; entropy, kl and
other keys a trainer did not log are left out, never written as 0.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path

from mechdiag import atomic, tasks
from mechdiag import config as C
from mechdiag.displacement import compare
from mechdiag.errors import UserError, first_line
from mechdiag.integrations import logs
from mechdiag.integrations.provenance import (
    INFERRED,
    OPENRLHF_FIELDS,
    VERL_FIELDS,
    Provenance,
    infer_from_logs,
    infer_reward_weights,
    observed_max_reward,
)
from mechdiag.integrations.trl_args import (
    GRPO_FIELDS,
    LORA_FIELDS,
    config_and_fields,
    find_training_args,
    lora_targets,
)
from mechdiag.metrics import is_number as _num
from mechdiag.outcomes import CORRECTNESS, group_stats
from mechdiag.outcomes import KEYS as OUTCOME_KEYS
from mechdiag.run import Run, RunDir, callback_run, flatten_config, held, is_run_dir, load_run
from mechdiag.tasks.rewards import weighted_total
from mechdiag.weights import ADAPTER_CONFIG, adapter_base, adapter_config, is_adapter

# ---- key maps -----------------------------------------------------------------------------------------------
TRL_TRAIN_KEYS = {
    "reward": "reward", "reward_std": "reward_std", "reward_cv": "reward_cv", "frac_reward_zero_std": "frac_zero_std",
    "kl": "kl", "entropy": "entropy", "completions/clipped_ratio": "completion_clipped_ratio",
    "completions/mean_length": "completion_length", "completion_length": "completion_length",  # < 0.16 spelling
    "completions/max_length": "completion_length_max", "completions/min_length": "completion_length_min",
    "completions/mean_terminated_length": "terminated_length",
    "completions/max_terminated_length": "terminated_length_max",
    "completions/min_terminated_length": "terminated_length_min",
    "clip_ratio": "policy_clip_fraction",  # 0.15-0.17 spelling
    "clip_ratio/region_mean": "policy_clip_fraction",
    "clip_ratio/low_mean": "clip_fraction_low", "clip_ratio/high_mean": "clip_fraction_high", "loss": "loss",
    "clip_ratio/low_min": "clip_fraction_low_min", "clip_ratio/high_max": "clip_fraction_high_max",
    "grad_norm": "grad_norm",
    "learning_rate": "lr", "step_time": "step_time", "num_tokens": "num_tokens", "epoch": "epoch",
    "entropy_coef": "entropy_coef",  # the entropy bonus's coefficient (adaptive: after the update)
    **{k: k for k in OUTCOME_KEYS},  # GroupCV's log
    # the sampler against the trainer (vLLM's importance-sampling correction; metrics.SAMPLER_KEYS)
    "sampling/importance_sampling_ratio/min": "sampler_ratio_min",
    "sampling/importance_sampling_ratio/mean": "sampler_ratio_mean",
    "sampling/importance_sampling_ratio/max": "sampler_ratio_max",
    "sampling/sampling_logp_difference/mean": "sampler_logp_diff",
    "sampling/sampling_logp_difference/max": "sampler_logp_diff_max",
}
TRL_EVAL_KEYS = {
    "reward": "eval_reward", "accuracy": "accuracy", "entropy": "entropy", "completions/mean_length":
    "completion_length", "kl": "kl", "reward_std": "reward_std", "reward_cv": "reward_cv",
    "completions/clipped_ratio": "completion_clipped_ratio", "loss": "eval_loss",
}
_TRL_REWARD = re.compile(r"^rewards/(?P<name>.+?)(?:/(?P<stat>mean|std))?$")  # no /mean: TRL < 0.16
_TRL_SKIP = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
             "step", "runtime", "samples_per_second", "steps_per_second", "global_step")

# verl: canonical key <- first key present (older verl names after newer ones)
VERL_TRAIN_KEYS = {
    "reward": ("critic/score/mean",),
    "reward_max_batch": ("critic/score/max",),
    "reward_with_kl": ("critic/rewards/mean",),
    "entropy": ("actor/entropy", "actor/entropy_loss"),
    "kl": ("actor/kl_loss", "actor/reward_kl_penalty", "critic/kl"),  # critic/kl: Dec-2024 PPO logs
    "kl_coef": ("critic/kl_coeff", "actor/reward_kl_penalty_coeff"),  # the in-reward penalty (algorithm.kl_ctrl)
    "kl_loss_coef": ("actor/kl_coef",),  # use_kl_loss: actor_rollout_ref.actor.kl_loss_coef
    "policy_clip_fraction": ("actor/pg_clipfrac",),
    "clip_fraction_low": ("actor/pg_clipfrac_lower",),
    "loss": ("actor/pg_loss",),
    "grad_norm": ("actor/grad_norm",),
    "lr": ("actor/lr",),
    "completion_length": ("response_length/mean",),
    "completion_length_max": ("response_length/max",),
    "completion_length_min": ("response_length/min",),
    "completion_clipped_ratio": ("response_length/clip_ratio",),
    "filter_too_bad_ratio": ("rollout/too_bad_sample_ratio",),  # dynamic sampling: groups all wrong, dropped
    "filter_too_good_ratio": ("rollout/too_good_sample_ratio",),  # ...all correct, dropped
    "step_time": ("timing_s/step", "timing/step"),
    "tokens_per_s": ("perf/throughput",),
    "value_loss": ("critic/vf_loss",),
    # the sampler against the trainer (rollout correction; metrics.SAMPLER_KEYS)
    "sampler_ratio_min": ("rollout_corr/rollout_is_min",),
    "sampler_ratio_mean": ("rollout_corr/rollout_is_mean",),
    "sampler_ratio_max": ("rollout_corr/rollout_is_max",),
    "sampler_kl": ("rollout_corr/kl",),
    "sampler_masked_fraction": ("rollout_corr/rollout_rs_masked_fraction",),
}
_VERL_SCALED = re.compile(r"^(?P<key>.+)\((?P<scale>[0-9.eE+-]+)\)$")  # "actor/lr(1e-4)": value in units of 1e-4
_VERL_REWARD_FN = "reward_extra_info/"  # verl's per-function reward means
# val-core/<data source>/<variable>/<stat>: a data source may hold slashes (openai/gsm8k)
_VERL_VAL = re.compile(r"^val-(?:core|aux)/(?P<ds>.+?)/(?P<var>[^/]+)/"
                       r"(?P<stat>(?:mean|std|best|worst|maj)@\d+(?:/\w+)?)$")
_VERL_OLD_VAL = re.compile(r"^val/test_score/(?P<ds>.+)$")
_MEAN_AT = re.compile(r"^mean@(\d+)$")
_BEST_AT = re.compile(r"^best@(\d+)/mean$")


def map_trl_log(logs: dict, eval_: bool = False) -> dict:
    """One TRL log dict -> canonical keys (eval_: the eval_-prefixed record of an evaluation).

    rewards/<f>/mean -> reward/<f> (unweighted, as our components); keys we have no name for keep their TRL
    name under trl/; None and non-finite values (TRL logs None for an all-None reward) are dropped."""
    out: dict = {}
    table = TRL_EVAL_KEYS if eval_ else TRL_TRAIN_KEYS
    for key, v in logs.items():
        if eval_:
            if not key.startswith("eval_"):
                continue
            key = key.removeprefix("eval_")
        elif key.startswith("eval_"):
            continue
        if key in _TRL_SKIP or not _num(v):
            continue
        m = _TRL_REWARD.match(key)
        if key in table:
            if table[key] not in out or key != "completion_length":  # the newer spelling wins when both
                out[table[key]] = float(v)
        elif key.startswith("pass@"):
            out[key] = float(v)
        elif m:
            out[("reward_std/" if m["stat"] == "std" else "reward/") + m["name"]] = float(v)
        else:
            out[f"trl/{key}"] = float(v)
    # GroupCV's share of all-equal groups is right for every scale_rewards; TRL's frac_reward_zero_std is a
    # per-batch flag under scale_rewards="batch"
    if "trl/group_frac_zero_std" in out:
        out["frac_zero_std"] = out.pop("trl/group_frac_zero_std")
    return out


def is_train_log(logs: dict) -> bool:
    return any(k in logs for k in ("loss", "reward", "grad_norm")) and "train_runtime" not in logs


def is_eval_log(logs: dict) -> bool:
    return any(k.startswith("eval_") for k in logs)


def _contiguous_keys(n: int, group_size: int | None, prompts: list) -> list:
    """Group ids: contiguous blocks of group_size (how TRL lays out a generation batch), else the prompt text."""
    if group_size and n % group_size == 0:
        return [i // group_size for i in range(n)]
    return [str(p) for p in prompts]


# ---- TRL completions parquet --------------------------------------------------------------------------------
def completion_files(output_dir: Path) -> dict[int, Path]:
    folder = Path(output_dir) / "completions"
    out = {}
    if folder.is_dir():
        for p in folder.glob("completions_*.parquet"):
            m = re.fullmatch(r"completions_(\d+)\.parquet", p.name)
            if m:
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def completions_rows(path: Path, reward_names: list[str], weights: dict[str, float] | None = None,
                     group_size: int | None = None) -> tuple[dict, list[dict]]:
    """(group stats, samples records) of one completions parquet. The weighted reward is sum_f w_f * r_f over the
    reward-function columns (weights default to 1, TRL's default reward_weights); groups are contiguous blocks
    of group_size when it is known, else equal prompts."""
    import pandas as pd  # noqa: PLC0415 - pandas loads on first use (slow import)

    try:
        df = pd.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise UserError(f"cannot read {path}: {first_line(e)}") from None
    names = [n for n in reward_names if n in df.columns]
    if not names or "prompt" not in df.columns:
        return {}, []
    weights = weights or {}
    comp = df[names].astype(float)
    total = weighted_total({n: comp[n] for n in names}, weights, missing=1.0)
    total = total.where(~comp.isna().all(axis=1))  # a row every function left None is unscorable (TRL: NaN)
    prompts = [p if isinstance(p, str) else json.dumps(p, default=str) for p in df["prompt"].tolist()]
    keys = _contiguous_keys(len(df), group_size, prompts)
    # a reward function named correctness (task_reward_funcs) gives the outcomes
    stats = group_stats(total.tolist(), keys, comp[CORRECTNESS].tolist() if CORRECTNESS in names else None)
    first: dict = {}
    group_of = [first.setdefault(k, len(first)) for k in keys]
    steps = df["step"].tolist() if "step" in df.columns else [None] * len(df)
    samples = []
    for i in range(len(df)):
        completion = df["completion"].iloc[i] if "completion" in df.columns else None
        rec = {"step": int(steps[i]) if steps[i] is not None else None, "split": "train", "group": group_of[i],
               "prompt": prompts[i], "completion": completion if isinstance(completion, str) else
               json.dumps(completion, default=str), "reward": _none_nan(total.iloc[i])}
        if "advantage" in df.columns:
            rec["advantage"] = _none_nan(df["advantage"].iloc[i])
        rec.update({f"reward/{n}": _none_nan(comp[n].iloc[i]) for n in names})
        samples.append(rec)
    return stats, samples


def _none_nan(v):
    v = float(v)
    return v if math.isfinite(v) else None


# ---- TRL output_dir -----------------------------------------------------------------------------------------
TRL_FIELDS = {**GRPO_FIELDS, **LORA_FIELDS, "prompts_per_step": "per_device_train_batch_size",
              "rewards.weights": "reward_weights", "warmup_ratio": "warmup_ratio"}
STATE_FILES = ("trainer_state.json", "trainer_state.json.gz")


def _checkpoints(output_dir: Path) -> dict[int, Path]:
    out = {}
    for p in output_dir.glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def trainer_state(output_dir: Path) -> dict:
    """trainer_state.json of the output_dir (written by trainer.save_state()), else of its latest checkpoint."""
    candidates = [d / name for d in [output_dir, *reversed(_checkpoints(output_dir).values())]
                  for name in STATE_FILES]
    best = None
    for path in candidates:
        if path.is_file():
            try:
                state = json.loads(logs.read_text(path))
            except ValueError as e:
                raise UserError(f"corrupt {path}: {e}") from None
            if not isinstance(state, dict) or not isinstance(state.get("log_history", []), list):
                raise UserError(f"corrupt {path}: no log_history list")
            # records as HF writes them: dicts with a numeric step (anything else is not a logging record)
            state["log_history"] = [h for h in state.get("log_history", []) if isinstance(h, dict)
                                    and _num(h.get("step", 0))]
            if best is None or _gstep(state) > _gstep(best):
                best = state
    return best or {}


def _gstep(state: dict) -> float:
    return state["global_step"] if _num(state.get("global_step")) else 0


def is_trl_dir(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_dir() or is_run_dir(path):
        return False
    return any((path / n).exists() or any(path.glob(f"checkpoint-*/{n}")) for n in STATE_FILES) \
        or callback_run(path) is not None


def _fresh(into) -> RunDir:
    rd = into if isinstance(into, RunDir) else RunDir(into, create=True)
    rd.path.mkdir(parents=True, exist_ok=True)
    if held(rd.path):
        raise UserError(f"{rd.path} already holds a run ({', '.join(held(rd.path))}); give an empty folder")
    return rd


def _config_from_output_dir(output_dir: Path, prov: Provenance):
    """Config for what a TRL output_dir says about itself: its GRPOConfig from training_args.bin (read by a
    restricted unpickler, mechdiag.integrations.trl_args) and the LoRA layout and base model of its latest adapter
    (adapter_config.json); `prov` records which keys each file gave. Keys neither gives stay unknown (their
    config.yaml value is a placeholder the report and recommend never present as the run's)."""

    data: dict = {}
    ckpts = list(_checkpoints(output_dir).values())
    for folder in [output_dir, *reversed(ckpts)]:
        path = folder / ADAPTER_CONFIG
        if is_adapter(folder):
            a = adapter_config(folder)
            lora = {"r": a.get("r", 8), "alpha": a.get("lora_alpha", 8), "dropout": a.get("lora_dropout", 0.0),
                    "use_rslora": bool(a.get("use_rslora", False))}
            targets = lora_targets(a.get("target_modules"), a.get("target_parameters"))
            if targets:
                lora["target_modules"] = targets
            layers = a.get("layers_to_transform")
            if isinstance(layers, int):
                layers = [layers]
            if isinstance(layers, list) and layers:
                lora["layers"] = layers
            data["lora"] = lora
            for k, v in lora.items():
                prov.read(f"lora.{k}", v, str(path.relative_to(output_dir)))
            if a.get("base_model_name_or_path"):
                data["model"] = {"name_or_path": str(a["base_model_name_or_path"])}
                prov.read("model.name_or_path", data["model"]["name_or_path"], str(path.relative_to(output_dir)))
            break
    got = config_and_fields(output_dir, data.get("lora"), data.get("model", {}).get("name_or_path"))
    if got is None:
        return C.from_dict(data)
    cfg, fields, held = got
    if fields.get("_unsloth"):
        prov.trainer = "unsloth"
    where = str(find_training_args(output_dir).relative_to(output_dir))
    flat = cfg.model_dump(mode="json")
    for k in sorted(held):
        prov.read(k, flat.get(k), where)
    if fields.get("reward_weights"):
        prov.read("rewards.weights", fields["reward_weights"], where)
    return cfg


def _checkpoint_displacement(output_dir: Path) -> list[dict]:
    """Per-tensor LoRA displacement of every checkpoint-N adapter against its base (when the base is local)."""

    rows = []
    for step, ck in _checkpoints(output_dir).items():
        if not is_adapter(ck):
            continue
        base = adapter_base(ck)
        if base is None or not Path(base).is_dir():
            continue
        for r in compare(base, ck):
            if r.get("lora_rank") is None:
                continue  # a tensor the adapter does not touch
            rows.append({"step": step, "name": r["name"], "layer": r["layer"], "module": r["module"],
                         "ref_fro": r["ref_fro"], "delta_fro": r["delta_fro"], "rel_fro": r["rel_fro"]})
    return rows


def _with_logged(cfg, prov: Provenance, metrics: list[dict], length_name: str, lr_name: str):
    """cfg with the values the logs show (prov's inferences) put in, so rules reason from them."""
    infer_from_logs(prov, metrics, length_name, lr_name)
    if "rewards.weights" not in prov.keys:
        got = infer_reward_weights(metrics)
        if got:
            prov.infer("rewards.weights", got[0], got[1])
    data = cfg.model_dump(mode="json")
    for key in ("max_completion_tokens", "learning_rate"):
        e = prov.keys.get(key)
        if e and e["how"] == INFERRED:
            data[key] = e["value"]
    w = prov.keys.get("rewards.weights")
    if w and isinstance(w["value"], dict):
        data.setdefault("rewards", {})["weights"] = w["value"]
    try:
        return C.from_dict(data)
    except UserError:
        return cfg


def _finish(prov: Provenance, metrics: list[dict], batch_max_key: str | None) -> dict:
    w = prov.keys.get("rewards.weights", {}).get("value")
    names = sorted({k.split("/", 1)[1] for m in metrics for k in m if k.startswith("reward/")})
    if isinstance(w, list):  # GRPOConfig.reward_weights: in the order of the reward functions (log order unknown)
        w = dict(zip(names, w, strict=False)) if len(w) == len(names) else None
    value, evidence = observed_max_reward(metrics, w if isinstance(w, dict) else None, batch_max_key)
    prov.max_reward = {"value": value, "evidence": evidence}
    return prov.to_dict()


def read_trl_run(output_dir, into, reward_weights: dict[str, float] | None = None,
                 group_size: int | None = None) -> RunDir:
    """Read a TRL GRPOTrainer output_dir into the empty run directory `into` (a RunDir or a path) and return it.

    Streams the MechdiagCallback recorded (output_dir/mechdiag/) are taken as they are; what it did not record is
    rebuilt from TRL's own files: metrics and eval from log_history, samples and reward_cv from the completions
    parquet, displacement from the checkpoint-N adapters."""

    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise UserError(f"TRL output directory not found: {output_dir}")
    state = trainer_state(output_dir)
    cb = RunDir(callback_run(output_dir)) if callback_run(output_dir) else None
    if not state and cb is None:
        raise UserError(f"{output_dir} has no trainer_state.json (nor checkpoint-N/trainer_state.json): "
                        "not a TRL output directory")
    rd = _fresh(into)
    prov = Provenance("trl", TRL_FIELDS)
    cfg = C.load(cb.config_path) if cb is not None else _config_from_output_dir(output_dir, prov)
    history = state.get("log_history", [])
    # metrics: the callback's records, else log_history; reward_cv from the wrapper's log or the parquet
    metrics = cb.read("metrics") if cb is not None else []
    if not metrics:
        metrics = [{"step": int(h["step"]), **map_trl_log(h)} for h in history if is_train_log(h) and "step" in h]
    if cb is None:
        cfg = _with_logged(cfg, prov, metrics, "completions/max_length", "learning_rate")
        read = sorted({e["evidence"] for e in prov.keys.values() if e["how"] == "read"})
        header = ("read from TRL output_dir " + str(output_dir) + "; values read from " +
                  (", ".join(read) if read else "no config file") + "; inferred and unknown values: summary.json "
                  "provenance (unknown ones are placeholders, never the run's)")
    else:
        header = "read from TRL output_dir " + str(output_dir)
    C.save(cfg, rd.config_path, header=header)
    weights = reward_weights if reward_weights is not None else tasks.reward_weights(cfg) if cb is not None else None
    group_size = group_size or (cfg.group_size if cb is not None else None)
    names = sorted({k.split("/", 1)[1] for m in metrics for k in m if k.startswith("reward/")})
    files = completion_files(output_dir)
    samples = cb.read("samples") if cb is not None else []
    have_samples = bool(samples)
    for m in metrics:
        path = files.get(m["step"])
        if path is None or not names:
            continue
        stats, rows = completions_rows(path, names, weights, group_size)
        for k, v in stats.items():
            m.setdefault(k, v)
        if not have_samples:
            samples += rows
    rd.append("metrics", metrics)

    evals = cb.read("eval") if cb is not None else []
    if not evals:
        evals = [{"step": int(h["step"]), **map_trl_log(h, eval_=True)} for h in history
                 if is_eval_log(h) and "step" in h]
    if cb is None and not metrics and not evals:
        raise UserError(f"{output_dir}: trainer_state.json's log_history holds no train or eval records")
    rd.append("eval", evals)
    rd.append("samples", samples)

    disp = cb.read("displacement") if cb is not None else []
    rd.append("displacement", disp or _checkpoint_displacement(output_dir))
    if cb is not None:
        rd.append("shift", cb.read("shift"))
        if cb.stream("eval_benchmarks").exists():
            shutil.copyfile(cb.stream("eval_benchmarks"), rd.stream("eval_benchmarks"))
    summary = cb.summary() if cb is not None else {"provenance": _finish(prov, metrics, None)}
    summary = {**summary, "source": "trl", "trl_output_dir": str(output_dir),
               "steps": summary.get("steps", state.get("global_step", metrics[-1]["step"] if metrics else 0))}
    if evals and "final_accuracy" not in summary and "accuracy" in evals[-1]:
        summary["final_accuracy"] = evals[-1]["accuracy"]
    rd.write_summary(summary)
    return rd


# ---- verl ---------------------------------------------------------------------------------------------------
def _verl_lines(path: Path) -> list[dict]:
    lines = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            if i == len(text.splitlines()):
                break  # a torn last line of a running job
            raise UserError(f"{path}:{i}: not a JSON line") from None
        if not (isinstance(rec, dict) and isinstance(rec.get("data"), dict) and _num(rec.get("step"))):
            raise UserError(f"{path}:{i}: not a verl file-logger line (expected {{\"step\": N, \"data\": {{...}}}})")
        lines.append(rec)
    return lines


def is_verl_file(path: str | Path) -> bool:
    path = Path(path)
    if not (path.is_file() and path.suffix == ".jsonl"):
        return False
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
        rec = json.loads(first)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(rec, dict) and isinstance(rec.get("data"), dict) and "step" in rec


def map_verl(data: dict) -> tuple[dict, dict]:
    """One verl data dict -> (train record, eval record) in canonical keys; datasets averaged, kept per dataset."""
    data = dict(data)
    for key in [k for k in data if _VERL_SCALED.match(k)]:
        m = _VERL_SCALED.match(key)
        if _num(data[key]) and m["key"] not in data:
            data[m["key"]] = float(data[key]) * float(m["scale"])
    train = {f"reward/{k[len(_VERL_REWARD_FN):]}": float(v) for k, v in data.items()
             if k.startswith(_VERL_REWARD_FN) and _num(v)}
    for key, sources in VERL_TRAIN_KEYS.items():
        for s in sources:
            if _num(data.get(s)):
                train[key] = float(data[s])
                break
    ev: dict[str, list[float]] = {}
    per_ds: dict = {}
    for key, v in data.items():
        if not _num(v):
            continue
        m = _VERL_VAL.match(key)
        name = None
        if m:
            var, stat = m["var"], m["stat"]
            mean_at, best_at = _MEAN_AT.match(stat), _BEST_AT.match(stat)
            if var == "acc" and mean_at:
                name = ("accuracy", int(mean_at.group(1)))
            elif var == "acc" and best_at:
                name = (f"pass@{best_at.group(1)}", 0)
            elif var in ("reward", "score") and mean_at:
                name = ("eval_reward", int(mean_at.group(1)))
            ds = m["ds"]
        else:
            m = _VERL_OLD_VAL.match(key)
            if m:
                name, ds = ("eval_reward", 1), m["ds"]
        if name is None:
            continue
        # several mean@N for one dataset: the largest N (the most samples)
        slot = per_ds.setdefault((name[0], ds), (name[1], float(v)))
        if name[1] > slot[0]:
            per_ds[(name[0], ds)] = (name[1], float(v))
    for (metric, _ds), (_, v) in per_ds.items():
        ev.setdefault(metric, []).append(v)
    evrec = {k: math.fsum(v) / len(v) for k, v in ev.items()}
    if len({ds for (_, ds) in per_ds}) > 1:
        evrec.update({f"{metric}/{ds}": v for (metric, ds), (_, v) in per_ds.items()})
    return train, evrec


def _verl_rollouts(rollout_dir: Path) -> dict[int, tuple[dict, list[dict]]]:
    """Per step: (group stats, samples) from verl's rollout dump N.jsonl (input, output, score)."""

    out = {}
    for p in rollout_dir.glob("*.jsonl"):
        if not p.stem.isdigit():
            continue
        try:
            rows = atomic.read_jsonl(p)
        except ValueError as e:
            raise UserError(f"corrupt {p}: {e}") from None
        rows = [r for r in rows if isinstance(r, dict) and "input" in r and _num(r.get("score"))]
        step = int(p.stem)
        keys = [str(r["input"]) for r in rows]
        first: dict = {}
        groups = [first.setdefault(k, len(first)) for k in keys]
        samples = [{"step": step, "split": "train", "group": g, "prompt": r["input"], "completion": r.get("output"),
                    "reward": float(r["score"])} for r, g in zip(rows, groups, strict=True)]
        acc = [r["acc"] for r in rows] if rows and all(_num(r.get("acc")) for r in rows) else None  # verl's "acc"
        stats = group_stats([float(r["score"]) for r in rows], keys, acc)
        out[step] = (stats, samples)
    return out


def read_verl_run(jsonl_path, into, rollout_dir=None, config=None) -> RunDir:
    """Read verl's file-logger JSONL or its console log (plain or gzipped; and, if given, its rollout dump folder
    for reward_cv) into the empty run directory `into`. Lines with train keys become metrics, validation keys
    eval records (a step-0 line with only validation keys is the base model); `config` (a Config or YAML path)
    stands for the design when given, else the values the log shows are inferred and the rest stay unknown."""

    path = Path(jsonl_path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if is_verl_file(p) or logs.is_console_log(p))
        if len(found) != 1:
            raise UserError(f"{path}: expected one verl metrics file in it, found {len(found)}")
        path = found[0]
    if not path.is_file():
        raise UserError(f"verl metrics file not found: {path}")
    if is_verl_file(path):
        records = [(int(rec["step"]), rec["data"]) for rec in _verl_lines(path)]
    else:
        records = logs.console_records(path)
    if not records:
        raise UserError(f"{path} holds no verl metrics lines")
    by_step: dict[int, tuple[dict, dict]] = {}
    for step, data in records:  # a step logged twice (a resumed job) keeps its last line
        by_step[step] = map_verl(data)
    return _write_foreign(into, by_step, "verl", VERL_FIELDS, path, config,
                          _verl_rollouts(Path(rollout_dir)) if rollout_dir else {},
                          "response_length/max", "actor/lr", "reward_max_batch")


# OpenRLHF (its W&B/TensorBoard train/* keys, openrlhf/trainer/ppo_utils) and custom loops: one alias table
TABLE_TRAIN_KEYS = {
    "reward": ("train/reward", "reward", "train_reward", "train/reward_mean", "rewards/mean"),
    "reward_std": ("train/reward_std", "reward_std", "train_reward_std"),
    "kl": ("train/kl", "kl", "train_kl"),
    "entropy": ("train/policy_entropy", "train/entropy_loss", "entropy", "train_entropy"),
    "loss": ("train/policy_loss", "pg_loss", "loss", "train_loss", "policy_loss"),
    "grad_norm": ("train/actor_grad_norm", "train/raw_grad_norm", "grad_norm"),
    "lr": ("train/actor_lr", "train/policy_lr", "lr", "learning_rate"),
    "completion_length": ("train/response_length", "completion_tokens", "completion_length", "response_length"),
    "completion_clipped_ratio": ("train/response_clip_ratio", "train/truncated", "clipped_ratio"),
    "policy_clip_fraction": ("train/ppo_clip_ratio", "clip_fraction"),
    "value_loss": ("train/critic_loss",),
    "kl_coef": ("train/kl_coef", "kl_coef"),
}
TABLE_EVAL_KEYS = {"eval_reward": ("eval_reward", "eval/reward", "eval/reward_mean"),
                   "accuracy": ("eval_accuracy", "eval/accuracy", "eval/pass1"),
                   "completion_length": ("eval_completion_tokens", "eval/response_length",
                                         "eval/response_length_mean"),
                   "completion_clipped_ratio": ("eval/truncated_rate",)}
# which trainer wrote a tabular log (a W&B export, TensorBoard events, a JSON-lines file), by its keys
_OPENRLHF_SIGN = {"policy_loss", "actor_lr", "ppo_clip_ratio", "return", "total_length", "critic_loss",
                  "response_clip_ratio", "entropy_loss", "ppo_kl"}
_VERL_SIGN = ("critic/score/", "actor/pg_loss", "actor/entropy", "response_length/", "val-core/", "val-aux/")
_TRL_SIGN = ("completions/", "rewards/", "clip_ratio/", "frac_reward_zero_std", "completion_length", "num_tokens")


def table_flavour(records: list[tuple[int, dict]]) -> str:
    """"trl" (HF's W&B/TensorBoard callbacks: train/<TRL key>, eval/<key>), "verl" (its metric names),
    "openrlhf" (train/<its status keys>) or "custom"."""
    keys = {k for _, d in records for k in d}
    if any(k.startswith(_VERL_SIGN) for k in keys):
        return "verl"
    bare = {k.removeprefix("train/") for k in keys if k.startswith("train/")}
    if bare & _OPENRLHF_SIGN:
        return "openrlhf"
    if any(k.startswith(_TRL_SIGN) for k in bare) or "learning_rate" in bare:
        return "trl"
    return "openrlhf" if bare else "custom"  # train/reward alone (one chart exported): OpenRLHF's spelling


def _trl_row(data: dict) -> tuple[dict, dict]:
    """A row of HF's W&B/TensorBoard log (train/<key>, eval/<key>) -> (train record, eval record)."""
    raw = {("eval_" + k[5:] if k.startswith("eval/") else k.removeprefix("train/")): v for k, v in data.items()}
    raw = {k: v for k, v in raw.items() if k not in _TRL_SKIP}  # TensorBoard puts train_runtime at the last step
    tr = map_trl_log(raw) if is_train_log(raw) else {}
    return tr, map_trl_log(raw, eval_=True) if is_eval_log(raw) else {}


def _pick(data: dict, table: dict) -> dict:
    out = {}
    for key, sources in table.items():
        for src in sources:
            if _num(data.get(src)):
                out[key] = float(data[src])
                break
    return out


def read_table_run(path, into, config=None) -> RunDir:
    """A tabular log (JSON lines, a JSON list, a W&B CSV export, TensorBoard events; logs.table_records) of a TRL,
    verl, OpenRLHF or custom run, mapped by the keys of the trainer that wrote it (table_flavour)."""
    path = Path(path)
    records = logs.table_records(path)
    trainer = table_flavour(records)
    by_step: dict[int, tuple[dict, dict]] = {}
    if trainer in ("trl", "verl"):
        for step, data in records:
            tr, ev = by_step.get(step, ({}, {}))
            new_tr, new_ev = _trl_row(data) if trainer == "trl" else map_verl(data)
            by_step[step] = ({**tr, **new_tr}, {**ev, **new_ev})
        if trainer == "trl":
            return _write_foreign(into, by_step, "trl", TRL_FIELDS, path, config, {}, "completions/max_length",
                                  "learning_rate", None)
        return _write_foreign(into, by_step, "verl", VERL_FIELDS, path, config, {}, "response_length/max",
                              "actor/lr", "reward_max_batch")
    for step, data in records:
        tr, ev = by_step.get(step, ({}, {}))
        ev = {**ev, **_pick(data, TABLE_EVAL_KEYS)}
        ev.update({f"accuracy/{k[5:].removesuffix('_pass1')}": v for k, v in data.items()
                   if k.startswith("eval/") and k.endswith("_pass1")})
        tr = {**tr, **_pick(data, TABLE_TRAIN_KEYS)}
        if any(k.startswith("accuracy/") for k in ev) and "accuracy" not in ev:
            accs = [v for k, v in ev.items() if k.startswith("accuracy/")]
            ev["accuracy"] = math.fsum(accs) / len(accs)
        by_step[step] = (tr, ev)
    return _write_foreign(into, by_step, trainer, OPENRLHF_FIELDS if trainer == "openrlhf" else {}, path, config,
                          {}, "the longest response", "lr", None)


def _write_foreign(into, by_step: dict, trainer: str, fields: dict, path: Path, config, rolls: dict,
                   length_name: str, lr_name: str, batch_max_key: str | None) -> RunDir:
    rd = _fresh(into)
    prov = Provenance(trainer, fields)
    metrics, evals, samples = [], [], []
    for step, (tr, ev) in sorted(by_step.items()):
        if tr:
            if step in rolls:
                for k, v in rolls[step][0].items():
                    tr.setdefault(k, v)
            metrics.append({"step": step, **tr})
        if ev:
            evals.append({"step": step, **ev})
    for step in sorted(rolls):
        samples += rolls[step][1]
    if config:
        cfg = config if isinstance(config, C.Config) else C.load(config)
        for k, v in flatten_config(cfg.model_dump(mode="json")).items():
            prov.read(k, v, "the config given")
        header = f"read from {trainer} log {path}; the design is the config given"
    else:
        which = "kl_loss_coef" if any("kl_loss_coef" in m for m in metrics) else "kl_coef"
        coefs = [m[which] for m in metrics if which in m]
        if coefs:
            prov.read("beta", coefs[-1], "the logged kl coefficient (last step)")
            if trainer == "verl" and which == "kl_coef":  # PPO's KL in the reward, not the actor's KL loss
                prov.fields["beta"] = "algorithm.kl_ctrl.kl_coef"
        cfg = _with_logged(C.from_dict({"beta": coefs[-1]} if coefs and 0 <= coefs[-1] else {}), prov, metrics,
                           length_name, lr_name)
        header = (f"read from {trainer} log {path}; the log holds no config: inferred and unknown values in "
                  "summary.json provenance (unknown ones are placeholders, never the run's)")
    C.save(cfg, rd.config_path, header=header)
    rd.append("metrics", metrics)
    rd.append("eval", evals)
    rd.append("samples", samples)
    summary = {"source": trainer, "verl_metrics": str(path), "steps": metrics[-1]["step"] if metrics else 0,
               "provenance": _finish(prov, metrics, batch_max_key)}
    if evals and "accuracy" in evals[-1]:
        summary["final_accuracy"] = evals[-1]["accuracy"]
    rd.write_summary(summary)
    return rd


# ---- any foreign run ----------------------------------------------------------------------------------------
SEARCH_DEPTH = 3  # a folder the user names may hold the run this many levels down (repo/outputs/checkpoint-N)


def _own_kind(path: Path) -> str | None:
    if path.is_file():
        if path.name in STATE_FILES:
            return "trl"
        if logs.is_tensorboard(path):
            return "table"
        if is_verl_file(path) or logs.is_console_log(path):
            return "verl"
        return "table" if logs.is_table_log(path) else None
    if is_trl_dir(path):
        return "trl"
    if (path / "metrics.jsonl").is_file() and not (path / "config.yaml").exists() and \
            logs.is_table_log(path / "metrics.jsonl"):  # metrics.jsonl without config.yaml: another loop's log
        return "table"
    if path.is_dir() and logs.is_tensorboard(path) and not (path / "config.yaml").exists():
        return "table"  # a SummaryWriter log_dir
    return None


def _target(kind: str, path: Path) -> Path:
    if kind == "trl" and path.is_file():
        return path.parent
    return path / "metrics.jsonl" if kind == "table" and path.is_dir() and not logs.is_tensorboard(path) else path


def locate(path) -> tuple[str, Path] | None:
    """(kind, the file or folder to read) for a foreign run at `path` or in one folder a few levels under it; None
    for a mechdiag run directory (or nothing recognised). Several runs under one folder: a UserError naming them."""
    path = Path(path)
    kind = _own_kind(path)
    if kind is not None:
        return kind, _target(kind, path)
    if not path.is_dir() or is_run_dir(path) or callback_run(path):  # a mechdiag run directory
        return None
    level, found = [path], []
    for _ in range(SEARCH_DEPTH):
        nxt = []
        for folder in level:
            for child in sorted(folder.iterdir()):
                if child.name.startswith(".") or child.name in ("SOURCE.md", "README.md"):
                    continue
                k = _own_kind(child)
                if k is not None and not (k == "trl" and child.name.startswith("checkpoint-")):
                    found.append((k, _target(k, child)))
                elif child.is_dir():
                    nxt.append(child)
        if found:
            break
        level = nxt
    found = list(dict.fromkeys(found))
    if len(found) > 1:
        raise UserError(f"{path} holds {len(found)} runs ({', '.join(str(p) for _, p in found[:4])}); name one")
    if not found and any(any(path.glob(f"checkpoint-*/{n}")) for n in STATE_FILES):
        return "trl", path
    return found[0] if found else None


def foreign_kind(path) -> str | None:
    """"trl", "verl" or "table" (OpenRLHF, a custom loop) for a foreign run at or under `path`, else None."""
    got = locate(path)
    return got[0] if got else None


def read_foreign(path, into) -> RunDir:
    got = locate(path)
    if got is None:
        raise UserError(f"{path} is neither a mechdiag run directory, a TRL output_dir, a verl log nor an "
                        "OpenRLHF/custom metrics log")
    kind, where = got
    if kind == "trl":
        return read_trl_run(where, into=into)
    if kind == "verl":
        return read_verl_run(where, into=into)
    return read_table_run(where, into=into)


def read_any_run(path) -> Run:
    """A mechdiag run directory, or another trainer's run converted into that shape once, here at the edge."""
    got = locate(path)
    if got is None:
        if Path(path).is_file():
            raise UserError(f"{path}: not a log mechdiag reads (TRL trainer_state.json, a verl JSONL or console "
                            "log, an OpenRLHF/custom metrics JSONL/CSV)")
        return load_run(path)
    with tempfile.TemporaryDirectory(prefix="mechdiag-foreign-") as tmp:
        rd = read_foreign(path, Path(tmp) / "run")
        run = load_run(rd.path, source=rd.summary().get("source", got[0]))
    run.path = Path(path)
    return run
