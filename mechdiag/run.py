"""The run directory: the one contract between train, recommend, report and the readers of other trainers.

    RUN/config.yaml        the resolved design lambda
    RUN/metrics.jsonl      one record per train step   (canonical train keys, "step")
    RUN/eval.jsonl         one record per eval         (accuracy, eval_reward, entropy, completion_length, pass@k)
    RUN/samples.jsonl      rollouts and eval completions, with group ids
    RUN/displacement.jsonl rows: step, name, layer, module, ref_fro, delta_fro, rel_fro (+ overlap_k,
                           subspace_overlap, intruders at the final step)
    RUN/shift.jsonl        rows: step, layer, shift, ci_low, ci_high, cos_dist, increment, logit_kl
    RUN/eval_benchmarks.jsonl  rows of `mechdiag eval` (benchmark x metric x model group)
    RUN/eval_models.jsonl  the same per adapter, before grouping
    RUN/eval_samples.jsonl every completion `mechdiag eval` scored
    RUN/attribution.jsonl  rows of `mechdiag attribute --save` (mechdiag.attribute.COLUMNS)
    RUN/signals/NAME.jsonl user signals' streams (mechdiag.recorder.Signal, registered by name)
    RUN/checkpoints/step-N/ (complete when step-N/COMPLETE exists), RUN/final/, RUN/summary.json

A TRL output_dir recorded by MechdiagCallback holds its run directory in OUT/mechdiag/ (`resolve_run`).

`Run` is a run directory read into memory (`load_run`); `group_runs` pools seeds of one config; `base_eval` and
`final_eval` are the untrained and the final held-out metrics. Runs of other trainers (TRL, verl) are converted
into this shape once, at the edge (mechdiag.integrations.readers.read_any_run).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mechdiag import atomic
from mechdiag import config as configlib
from mechdiag.errors import UserError
from mechdiag.metrics import is_number

SIGNALS_DIR = "signals"  # user signals' streams
CALLBACK_DIR = "mechdiag"  # MechdiagCallback's run directory inside a TRL output_dir
STREAMS = ("metrics", "eval", "samples", "displacement", "shift", "eval_benchmarks", "eval_models", "eval_samples",
           "attribution")
# summary.json, whoever writes it (native trainer, TRL callback, TRL and verl readers): flat keys, metrics of the
# untrained and the final model as base_<metric> / final_<metric>.
SUMMARY_KEYS = ("steps", "planned_steps", "seed", "model", "task", "eval_n", "source", "wall_time_s", "recorder_s",
                "recorder_once_s",
                "sandbox", "memory", "config_derived", "base_accuracy", "final_accuracy", "accuracy_gain",
                "base_eval_reward", "final_eval_reward", "provenance", "engine", "world_size", "unavailable",
                "read")  # read: a foreign run's name among the runs its source holds (integrations.readers)


@dataclass
class RunDir:
    path: Path

    def __init__(self, path: str | os.PathLike, create: bool = False):
        self.path = Path(path)
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise UserError(f"run directory not found: {self.path}")

    # ---- streams -------------------------------------------------------------------------------------
    def register(self, name: str) -> None:
        """Give a user signal its stream, signals/NAME.jsonl."""
        if name in STREAMS or not name.isidentifier():
            raise ValueError(f"signal stream {name!r}: an identifier that is not a built-in stream")
        (self.path / SIGNALS_DIR).mkdir(exist_ok=True)

    def user_streams(self) -> list[str]:
        return sorted(p.stem for p in (self.path / SIGNALS_DIR).glob("*.jsonl"))

    def stream(self, name: str) -> Path:
        if name in STREAMS:
            return self.path / f"{name}.jsonl"
        if (self.path / SIGNALS_DIR).is_dir() and name.isidentifier():
            return self.path / SIGNALS_DIR / f"{name}.jsonl"
        raise ValueError(f"unknown stream {name!r}")

    def append(self, name: str, records: list[dict] | dict, fsync: bool = False) -> None:
        if isinstance(records, dict):
            records = [records]
        atomic.append_jsonl(self.stream(name), records, fsync=fsync)

    def read(self, name: str) -> list[dict]:
        try:
            return atomic.read_jsonl(self.stream(name))
        except ValueError as e:
            raise UserError(f"corrupt {self.stream(name)}: {e}") from None

    def frame(self, name: str):
        import pandas as pd  # noqa: PLC0415 - pandas loads on first use (slow import)

        return pd.DataFrame(self.read(name))

    def replace_step(self, name: str, step: int, records: list[dict]) -> None:
        """Replace one step's records of a stream (atomically), keeping the others in order."""
        kept = [r for r in self.read(name) if r.get("step") != step] if self.stream(name).exists() else []
        atomic.write_jsonl(self.stream(name), [*kept, *records])

    def drop_after(self, step: int) -> None:
        """On resume: forget every record past the last checkpointed step, so each step appears once."""
        kept = {}
        for name in (*STREAMS, *self.user_streams()):  # read (check) every stream before rewriting any
            if self.stream(name).exists():
                kept[name] = [r for r in self.read(name) if r.get("step", -1) <= step]
        for name, records in kept.items():
            atomic.write_jsonl(self.stream(name), records)

    # ---- files ---------------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def final(self) -> Path:
        return self.path / "final"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    def checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints (a crash mid-write leaves no COMPLETE marker), ascending."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name[5:]) for p in self.checkpoints.iterdir()
                      if p.name.startswith("step-") and p.name[5:].isdigit() and (p / "COMPLETE").exists())

    def write_checkpoint(self, step: int, save: Callable[[Path], None]) -> Path:
        """checkpoints/step-N written by `save(folder)` beside it, made durable with every stream record so far,
        renamed into place, then marked COMPLETE: a crash leaves either the whole checkpoint or none."""
        final, tmp = self.checkpoint(step), self.checkpoints / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.mkdir(parents=True)
        save(tmp)
        for p in [self.stream(s) for s in (*STREAMS, *self.user_streams())] + sorted(tmp.iterdir()) + [tmp]:
            atomic.fsync_file(p)
        os.replace(tmp, final)
        atomic.write_text(final / "COMPLETE", "")
        atomic.fsync_file(self.checkpoints)
        return final

    def write_final(self, save: Callable[[Path], None]) -> Path:
        """final/ appears whole or not at all."""
        return self.write_folder(self.final, save)

    def write_folder(self, folder: Path, save: Callable[[Path], None]) -> Path:
        """A model folder of the run (final/, best/) appears whole or not at all: written beside it by
        `save(folder)`, then renamed over it."""
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save(tmp)
        for p in sorted(tmp.iterdir()) + [tmp]:
            atomic.fsync_file(p)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        return folder

    def write_summary(self, summary: dict) -> None:
        unknown = sorted(k for k in summary if k not in SUMMARY_KEYS and not k.endswith("_output_dir")
                         and not k.startswith(("base_", "final_")) and k != "verl_metrics")
        if unknown:
            raise ValueError(f"summary.json keys outside the schema: {unknown}")
        atomic.write_json(self.summary_path, summary)

    def summary(self) -> dict:
        if not self.summary_path.exists():
            return {}
        try:
            return json.loads(self.summary_path.read_text())
        except ValueError as e:
            raise UserError(f"corrupt {self.summary_path}: {e}") from None


def held(path: str | os.PathLike) -> list[str]:
    """What makes a folder already hold a run (the one rule for train, the TRL backend and the readers): any
    record stream or a summary.json. A config.yaml alone is not a run."""
    p = Path(path)
    return [f.name for f in [*(p / f"{s}.jsonl" for s in STREAMS), p / "summary.json"] if f.exists()]


def is_run_dir(path: str | os.PathLike) -> bool:
    """A mechdiag run directory (the one rule for run arguments, model arguments and the readers): a folder with
    a config.yaml or a record stream, as train, the TRL callback and the readers write them."""
    p = Path(path)
    return p.is_dir() and ((p / "config.yaml").is_file() or any((p / f"{s}.jsonl").is_file() for s in STREAMS))


def callback_run(path: str | os.PathLike) -> Path | None:
    """OUT/mechdiag/ when `path` is a TRL output_dir whose MechdiagCallback wrote its run directory there."""
    p = Path(path) / CALLBACK_DIR
    return p if is_run_dir(p) else None


# what a file that no reader takes is told: the forms the readers read (mechdiag.integrations.readers)
NOT_A_LOG = ("not a log mechdiag reads (TRL trainer_state.json, printed log dicts or a notebook's outputs, a custom "
             "loop's printed step lines, a verl JSONL or console log, an OpenRLHF/custom metrics JSONL/CSV, W&B CSV, "
             "TensorBoard)")


def resolve_run(path) -> RunDir:
    """The run directory named by a user: RUN itself, or RUN/mechdiag/ for a TRL output_dir with the callback."""
    p = Path(path)
    if p.is_file():
        raise UserError(f"{p}: {NOT_A_LOG} nor a run directory")
    if not p.is_dir():
        raise UserError(f"run directory not found: {p}")
    got = p if is_run_dir(p) else callback_run(p)
    if got is None:
        raise UserError(f"{p} is not a run directory (no config.yaml or record stream; for a TRL output_dir, "
                        f"its {CALLBACK_DIR}/ folder written by MechdiagCallback)")
    return RunDir(got)


def find_checkpoint(path: Path, step: int | None = None) -> Path:
    """A run directory's model: checkpoints/step-N when `step` is given, else final/ (else the last complete
    checkpoint of a run that has not finished)."""
    rd = RunDir(path)
    steps = rd.checkpoint_steps()
    if step is not None:
        if step not in steps:
            raise UserError(f"{path}: no complete checkpoint at step {step} (have: {steps or 'none'})")
        return rd.checkpoint(step)
    if rd.final.is_dir():
        return rd.final
    if steps:
        return rd.checkpoint(steps[-1])
    raise UserError(f"{path}: the run has neither final/ nor a complete checkpoint")


# ---- a run in memory -------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run directory read once: raw config, every stream, summary and checkpoint steps."""

    path: Path
    config: dict  # config.yaml as written ({} when absent); `cfg` validates it
    streams: dict[str, list[dict]]
    summary: dict = field(default_factory=dict)
    checkpoints: list[int] = field(default_factory=list)
    source: str = "mechdiag"  # or "trl" / "verl", converted at the edge

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def seed(self):
        return self.config.get("seed")

    @property
    def provenance(self) -> dict | None:
        """A foreign run's account of its config (integrations.provenance): {"keys": {key: {"how": "read" or
        "inferred", "value", "evidence"}}, "fields", "trainer", "max_reward"}; None for a run mechdiag wrote,
        whose config.yaml is what ran."""
        p = self.summary.get("provenance")
        return p if isinstance(p, dict) else None

    @functools.cached_property
    def cfg(self) -> configlib.Config:
        if not self.config:
            raise UserError(f"{self.path} has no config.yaml: not a run directory")
        return configlib.from_dict(self.config)

    def read(self, name: str) -> list[dict]:
        return self.streams.get(name, [])

    def has(self, name: str) -> bool:
        return bool(self.streams.get(name))

    @property
    def metrics(self) -> list[dict]:
        return self.read("metrics")

    @property
    def eval(self) -> list[dict]:
        return self.read("eval")

    @property
    def displacement(self) -> list[dict]:
        return self.read("displacement")

    @property
    def shift(self) -> list[dict]:
        return self.read("shift")

    @property
    def samples(self) -> list[dict]:
        return self.read("samples")


def load_run(path: str | os.PathLike, source: str = "mechdiag") -> Run:
    """Read a mechdiag run directory (UserError when it is missing, corrupt, or holds no run data)."""
    rd = RunDir(path)
    streams = {name: rd.read(name) for name in (*STREAMS, *rd.user_streams()) if rd.stream(name).exists()}
    for name, rows in streams.items():
        if any(not isinstance(r, dict) for r in rows):
            raise UserError(f"corrupt {rd.stream(name)}: a line is not a JSON object")
    config = configlib.read_yaml(rd.config_path) if rd.config_path.is_file() else {}
    summary = rd.summary()
    if not any(streams.values()) and not summary and not config:
        raise UserError(f"{rd.path} holds no run data (no config.yaml, summary.json or *.jsonl streams)")
    return Run(rd.path, config, streams, summary, rd.checkpoint_steps(), source)


def load_runs(paths, load: Callable[[str | os.PathLike], Run] = load_run) -> list[Run]:
    if not paths:
        raise UserError("give at least one run directory")
    return [load(p) for p in paths]


# ---- held-out metrics ------------------------------------------------------------------------------------------
def _summary_eval(summary: dict, which: str) -> dict:
    return {k.removeprefix(f"{which}_"): v for k, v in summary.items() if k.startswith(f"{which}_")}


def _eval_rows(run: Run) -> list[dict]:
    return sorted((r for r in run.eval if is_number(r.get("step"))), key=lambda r: r["step"])


def final_eval(run: Run) -> dict[str, float]:
    """The final model's held-out numbers: the last eval record, with summary.json's final_* over it."""
    rows = _eval_rows(run)
    rec = {**(rows[-1] if rows else {}), **_summary_eval(run.summary, "final")}
    return {k: float(v) for k, v in rec.items() if k != "step" and is_number(v)}


def base_eval(run: Run) -> dict[str, float]:
    """The untrained model's numbers: the first eval record when it is at step 0 and a later one follows (a log
    whose first eval is at step 20 of a resumed run holds no base), with summary.json's base_* over it."""
    rows = _eval_rows(run)
    rec = {**(rows[0] if len(rows) > 1 and rows[0]["step"] == 0 else {}), **_summary_eval(run.summary, "base")}
    return {k: float(v) for k, v in rec.items() if k != "step" and is_number(v)}


# ---- seeds of one config ---------------------------------------------------------------------------------------
# Config keys that never define a treatment: the seed is what we pool over; the rest are bookkeeping.
IGNORED_KEYS = ("seed", "threads", "hooks", "save_every", "record.")
_SEED_SUFFIX = re.compile(r"[-_.]?seed[-_=]?\d+$", re.IGNORECASE)


@dataclass
class Group:
    """Runs whose configs agree but for seed-like keys (IGNORED_KEYS)."""

    label: str
    runs: list[Run]


def flatten_config(d: dict, prefix: str = "") -> dict:
    """A config dict as dotted keys; reward weights and task options stay whole (one value each)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in configlib.WHOLE_KEYS:
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _text(v) -> str:
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_text(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_text(x) for x in v) + "]"
    return str(v)


def _treatment(run: Run) -> dict:
    """The config as resolved (defaults filled in, so two spellings of one config agree) minus IGNORED_KEYS."""
    try:
        data = run.cfg.model_dump(mode="json")
    except UserError:  # an old or foreign config: compare it as written
        data = run.config or {"path": str(run.path)}
    out = {k: v for k, v in flatten_config(data).items() if not k.startswith(IGNORED_KEYS)}
    seed = ((run.provenance or {}).get("keys") or {}).get("seed") or {}
    if run.provenance is not None and seed.get("how") != "read":
        out["run"] = str(run.path)  # a foreign run that does not show its seed is never pooled as another's seed
    return out


def _stem(run: Run) -> str:
    """The directory name without its seed suffix ("demo-seed42", "demo_3407" -> "demo")."""
    name = _SEED_SUFFIX.sub("", run.name)
    if name == run.name and run.seed is not None:
        name = re.sub(rf"[-_.]{re.escape(str(run.seed))}$", "", name)
    return name or run.name


def _varying(items: list[dict]) -> list[str]:
    return [k for k in sorted({k for it in items for k in it}) if len({_text(it.get(k)) for it in items}) > 1]


def varying_keys(runs: list[Run]) -> list[str]:
    """The config keys that tell runs apart (the one rule for group labels and the report's highlighted columns):
    values of the resolved config, seed-like keys (IGNORED_KEYS) aside."""
    return _varying([_treatment(r) for r in runs])


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs whose treatments agree form a group, first run's group first (the baseline of a comparison). A group
    is labelled by the config keys that vary across groups (at most three), or by its runs' name without a seed
    suffix when there is one group."""
    items = [_treatment(r) for r in runs]
    varying = _varying(items)
    groups: dict[tuple, Group] = {}
    for run, it in zip(runs, items, strict=True):
        sig = tuple(_text(it.get(k)) for k in varying)
        if sig not in groups:
            groups[sig] = Group(", ".join(f"{k}={v}" for k, v in zip(varying[:3], sig, strict=False)), [])
        groups[sig].runs.append(run)
    out = list(groups.values())
    if len(out) == 1:
        out[0].label = _stem(out[0].runs[0])
    labels = [g.label for g in out]
    for i, g in enumerate(out):
        g.label = (g.label if labels.count(g.label) == 1 else f"{g.label} #{i + 1}")[:80]
    return out
