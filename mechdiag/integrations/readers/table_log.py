"""Tabular logs (JSON lines, a JSON list, a W&B CSV export, TensorBoard events; logs.table_records) of a TRL,
verl, OpenRLHF or custom run, mapped by the keys of the trainer that wrote them (table_flavour)."""


import math
import re
from pathlib import Path

from mechdiag.integrations import logs
from mechdiag.integrations.provenance import (
    OPENRLHF_FIELDS,
    VERL_FIELDS,
)
from mechdiag.integrations.readers.common import write_foreign
from mechdiag.integrations.readers.trl_dir import TRL_FIELDS, TRL_SKIP, is_eval_log, is_train_log, map_trl_log
from mechdiag.integrations.readers.verl_log import map_verl
from mechdiag.metrics import counts_right, is_number
from mechdiag.run import RunDir

# OpenRLHF (its W&B/TensorBoard train/* keys, openrlhf/trainer/ppo_utils) and custom loops: one alias table
# (the first key a row holds wins: a KL to the reference before a bare "kl", which some loops use for PPO's
# old-vs-new KL, and verl's kl_loss is the unscaled KL to the reference)
TABLE_TRAIN_KEYS = {
    "reward": ("train/reward", "reward", "train_reward", "train/reward_mean", "rewards/mean", "reward_mean",
               "mean_reward", "avg_reward", "average_reward", "score_mean"),
    "reward_std": ("train/reward_std", "reward_std", "train_reward_std", "std_reward"),
    "kl": ("train/kl", "ref_kl", "kl_ref", "kl_to_ref", "kl_loss", "kl", "train_kl", "kl_divergence", "kl_div",
           "mean_kl"),
    "entropy": ("train/policy_entropy", "train/entropy_loss", "entropy", "train_entropy", "entropy_mean",
                "token_entropy"),
    "loss": ("train/policy_loss", "pg_loss", "loss", "train_loss", "policy_loss", "actor_loss"),
    "grad_norm": ("train/actor_grad_norm", "train/raw_grad_norm", "grad_norm"),
    "lr": ("train/actor_lr", "train/policy_lr", "lr", "learning_rate"),
    "completion_length": ("train/response_length", "completion_tokens", "completion_length", "response_length",
                          "response_length_mean", "completion_length_mean", "mean_completion_length",
                          "avg_response_len", "avg_response_length", "mean_response_length"),
    "completion_clipped_ratio": ("train/response_clip_ratio", "train/truncated", "clipped_ratio", "truncation_rate",
                                 "truncated_fraction", "completions/clipped_ratio"),
    "frac_zero_std": ("frac_reward_zero_std", "zero_std_group_ratio", "zero_std_ratio", "frac_zero_std"),
    "frac_groups_all_correct": ("all_correct_group_ratio", "frac_groups_all_correct"),
    "frac_groups_all_wrong": ("all_wrong_group_ratio", "frac_groups_all_wrong"),
    "policy_clip_fraction": ("train/ppo_clip_ratio", "clip_fraction"),
    "value_loss": ("train/critic_loss",),
    "kl_coef": ("train/kl_coef", "kl_coef"),
}
TABLE_EVAL_KEYS = {"eval_reward": ("eval_reward", "eval/reward", "eval/reward_mean", "val_reward", "validation_reward"),
                   "accuracy": ("eval_accuracy", "eval/accuracy", "eval/pass1", "validation_accuracy",
                                "val_accuracy", "val/accuracy", "test_accuracy"),
                   "completion_length": ("eval_completion_tokens", "eval/response_length",
                                         "eval/response_length_mean"),
                   "completion_clipped_ratio": ("eval/truncated_rate",)}
# which trainer wrote a tabular log (a W&B export, TensorBoard events, a JSON-lines file), by its keys
_OPENRLHF_SIGN = {"policy_loss", "actor_lr", "ppo_clip_ratio", "return", "total_length", "critic_loss",
                  "response_clip_ratio", "entropy_loss", "ppo_kl"}
_VERL_SIGN = ("critic/score/", "actor/pg_loss", "actor/entropy", "response_length/", "val-core/", "val-aux/")
_TRL_OWN = ("rewards/", "completions/", "clip_ratio/", "frac_reward_zero_std")  # only TRL writes these bare
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
    if not bare and any(k.startswith(_TRL_OWN) for k in keys):  # TRL's own keys with no train/ prefix: its log
        return "trl"
    return "openrlhf" if bare else "custom"  # train/reward alone (one chart exported): OpenRLHF's spelling


def _trl_row(data: dict) -> tuple[dict, dict]:
    """A row of HF's W&B/TensorBoard log (train/<key>, eval/<key>) -> (train record, eval record)."""
    raw = {("eval_" + k[5:] if k.startswith("eval/") else k.removeprefix("train/")): v for k, v in data.items()}
    raw = {k: v for k, v in raw.items() if k not in TRL_SKIP}  # TensorBoard puts train_runtime at the last step
    tr = map_trl_log(raw) if is_train_log(raw) else {}
    return tr, map_trl_log(raw, eval_=True) if is_eval_log(raw) else {}


_COMPONENT = re.compile(r"^(?:(?P<a>\w+?)_reward|reward_(?P<b>\w+))$")  # a custom loop's reward components
_NOT_COMPONENT = {"std", "mean", "max", "min", "cv", "groups", "total", "sum", "var", "variance"}


def _own_streams(data: dict) -> dict:
    """A custom loop's reward components (format_reward, reward_answer -> reward/format, reward/answer) and its
    success shares (correct=1/2 -> reward/correct), beside the keys TABLE_TRAIN_KEYS maps."""
    out = {}
    for k, v in data.items():
        if not is_number(v) or not isinstance(k, str) or k.startswith(("eval", "val", "test")):
            continue
        m = _COMPONENT.match(k)
        name = (m.group("a") or m.group("b")) if m else None
        if name and name not in _NOT_COMPONENT and not name.startswith(("train", "total", "mean", "avg")):
            out[f"reward/{name}"] = float(v)
        elif counts_right(k) and "/" not in k:
            out[f"reward/{k}"] = float(v)
    return out


def _pick(data: dict, table: dict) -> dict:
    out = {}
    for key, sources in table.items():
        for src in sources:
            if is_number(data.get(src)):
                out[key] = float(data[src])
                break
    return out


def read_table_run(path, into, config=None, records=None, trainer=None) -> RunDir:
    """A tabular log (JSON lines, a JSON list, a W&B CSV export, TensorBoard events; logs.table_records) of a TRL,
    verl, OpenRLHF or custom run, mapped by the keys of the trainer that wrote it (table_flavour). `records` (one
    launch of several the file holds, readers.runs_in) and `trainer` ("trl" for printed log dicts) when known."""
    path = Path(path)
    records = logs.table_records(path) if records is None else records
    trainer = trainer or table_flavour(records)
    by_step: dict[int, tuple[dict, dict]] = {}
    if trainer in ("trl", "verl"):
        for step, data in records:
            tr, ev = by_step.get(step, ({}, {}))
            new_tr, new_ev = _trl_row(data) if trainer == "trl" else map_verl(data)
            by_step[step] = ({**tr, **new_tr}, {**ev, **new_ev})
        if trainer == "trl":
            return write_foreign(into, by_step, "trl", TRL_FIELDS, path, config, {}, "completions/max_length",
                                  "learning_rate", None)
        return write_foreign(into, by_step, "verl", VERL_FIELDS, path, config, {}, "response_length/max",
                              "actor/lr", "reward_max_batch")
    for step, data in records:
        tr, ev = by_step.get(step, ({}, {}))
        ev = {**ev, **_pick(data, TABLE_EVAL_KEYS)}
        ev.update({f"accuracy/{k[5:].removesuffix('_pass1')}": v for k, v in data.items()
                   if k.startswith("eval/") and k.endswith("_pass1")})
        tr = {**tr, **_own_streams(data), **_pick(data, TABLE_TRAIN_KEYS)}
        if any(k.startswith("accuracy/") for k in ev) and "accuracy" not in ev:
            accs = [v for k, v in ev.items() if k.startswith("accuracy/")]
            ev["accuracy"] = math.fsum(accs) / len(accs)
        by_step[step] = (tr, ev)
    return write_foreign(into, by_step, trainer, OPENRLHF_FIELDS if trainer == "openrlhf" else {}, path, config,
                          {}, "the longest response", "lr", None)
