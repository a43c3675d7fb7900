"""verl's logs into the run-directory shape: the file logger (trainer.logger=[...,'file'], VERL_FILE_LOGGER_PATH:
one JSON line {"step": N, "data": {...}} per step, train and validation keys in one dict) or its console log; the
rollout dump (trainer.rollout_data_dir) is N.jsonl with input, output, score per completion. verl's score is a
batch statistic: reward_cv comes from the rollout dump when given."""


import json
import math
import re
from pathlib import Path

from mechdiag import atomic
from mechdiag.errors import UserError
from mechdiag.integrations import logs
from mechdiag.integrations.provenance import (
    VERL_FIELDS,
)
from mechdiag.integrations.readers.common import write_foreign
from mechdiag.metrics import is_number
from mechdiag.outcomes import group_stats
from mechdiag.run import RunDir

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
        if not (isinstance(rec, dict) and isinstance(rec.get("data"), dict) and is_number(rec.get("step"))):
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
        if is_number(data[key]) and m["key"] not in data:
            data[m["key"]] = float(data[key]) * float(m["scale"])
    train = {f"reward/{k[len(_VERL_REWARD_FN):]}": float(v) for k, v in data.items()
             if k.startswith(_VERL_REWARD_FN) and is_number(v)}
    for key, sources in VERL_TRAIN_KEYS.items():
        for s in sources:
            if is_number(data.get(s)):
                train[key] = float(data[s])
                break
    ev: dict[str, list[float]] = {}
    per_ds: dict = {}
    for key, v in data.items():
        if not is_number(v):
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
        rows = [r for r in rows if isinstance(r, dict) and "input" in r and is_number(r.get("score"))]
        step = int(p.stem)
        keys = [str(r["input"]) for r in rows]
        first: dict = {}
        groups = [first.setdefault(k, len(first)) for k in keys]
        samples = [{"step": step, "split": "train", "group": g, "prompt": r["input"], "completion": r.get("output"),
                    "reward": float(r["score"])} for r, g in zip(rows, groups, strict=True)]
        acc = [r["acc"] for r in rows] if rows and all(is_number(r.get("acc")) for r in rows) else None  # verl's "acc"
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
    return write_foreign(into, by_step, "verl", VERL_FIELDS, path, config,
                          _verl_rollouts(Path(rollout_dir)) if rollout_dir else {},
                          "response_length/max", "actor/lr", "reward_max_batch")
