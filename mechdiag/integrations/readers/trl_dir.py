"""A TRL GRPOTrainer (or Unsloth) output_dir into the run-directory shape (mechdiag.run).

    trainer_state.json (or checkpoint-N/trainer_state.json)  log_history: one dict per logging step, eval_ keys
    completions/completions_NNNNN.parquet                    step, prompt, completion, one column per reward
                                                             function (unweighted), advantage   (log_completions)
    checkpoint-N/adapter_model.safetensors                   the LoRA adapter at step N
    mechdiag/                                                the run directory MechdiagCallback wrote, if it ran

TRL's reward_std is a BATCH statistic, so reward_cv (the study's within-group CV) is computed from the completions
(grouped by prompt) or taken from the reward-function wrapper's log; clip metrics are 0 when num_iterations is 1
(ratio exactly 1), kept as the true value; keys TRL did not log are left out, never written as 0.
"""


import json
import math
import re
import shutil
from pathlib import Path

from mechdiag import config as C
from mechdiag import tasks
from mechdiag.displacement import compare
from mechdiag.errors import UserError, first_line
from mechdiag.integrations import logs
from mechdiag.integrations.provenance import (
    Provenance,
)
from mechdiag.integrations.readers.common import finish_provenance, fresh_run_dir, with_logged
from mechdiag.integrations.trl_args import (
    GRPO_FIELDS,
    LORA_FIELDS,
    config_and_fields,
    find_training_args,
    lora_targets,
)
from mechdiag.metrics import is_number
from mechdiag.outcomes import CORRECTNESS, group_stats
from mechdiag.outcomes import KEYS as OUTCOME_KEYS
from mechdiag.run import RunDir, callback_run, is_run_dir
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
    "reward_max": "reward_max_batch", "reward_min": "reward_min_batch",  # forks' and custom callbacks' batch range
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
TRL_SKIP = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
             "step", "runtime", "samples_per_second", "steps_per_second", "global_step")

def map_trl_log(logs: dict, eval_: bool = False) -> dict:
    """One TRL log dict -> canonical keys (eval_: the eval_-prefixed record of an evaluation).

    rewards/<f>/mean -> reward/<f> (unweighted, as our components); keys we have no name for keep their TRL
    name under trl/; None (TRL logs None for an all-None reward) is dropped; a NaN or inf the trainer logged is kept
    as NaN (written as null: a grad_norm NaN at every step is a finding, not a gap)."""
    out: dict = {}
    table = TRL_EVAL_KEYS if eval_ else TRL_TRAIN_KEYS
    for key, v in logs.items():
        if eval_:
            if not key.startswith("eval_"):
                continue
            key = key.removeprefix("eval_")
        elif key.startswith("eval_"):
            continue
        if key in TRL_SKIP or not (is_number(v) or isinstance(v, float)):
            continue
        v = v if is_number(v) else math.nan
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
                                    and is_number(h.get("step", 0))]
            if best is None or _gstep(state) > _gstep(best):
                best = state
    return best or {}


def _gstep(state: dict) -> float:
    return state["global_step"] if is_number(state.get("global_step")) else 0


def is_trl_dir(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_dir() or is_run_dir(path):
        return False
    return any((path / n).exists() or any(path.glob(f"checkpoint-*/{n}")) for n in STATE_FILES) \
        or callback_run(path) is not None



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
    rd = fresh_run_dir(into)
    prov = Provenance("trl", TRL_FIELDS)
    cfg = C.load(cb.config_path) if cb is not None else _config_from_output_dir(output_dir, prov)
    history = state.get("log_history", [])
    # metrics: the callback's records, else log_history; reward_cv from the wrapper's log or the parquet
    metrics = cb.read("metrics") if cb is not None else []
    if not metrics:
        metrics = [{"step": int(h["step"]), **map_trl_log(h)} for h in history if is_train_log(h) and "step" in h]
    if cb is None:
        cfg = with_logged(cfg, prov, metrics, "completions/max_length", "learning_rate")
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
    summary = cb.summary() if cb is not None else {"provenance": finish_provenance(prov, metrics, None)}
    summary = {**summary, "source": "trl", "trl_output_dir": str(output_dir),
               "steps": summary.get("steps", state.get("global_step", metrics[-1]["step"] if metrics else 0))}
    if evals and "final_accuracy" not in summary and "accuracy" in evals[-1]:
        summary["final_accuracy"] = evals[-1]["accuracy"]
    rd.write_summary(summary)
    return rd
