"""Read run directories into memory for a report: one `Run` per directory, seeds of one config grouped.

A report is drawn from whatever the runs hold: every stream may be missing or short (a crashed or running
run, a TRL output directory), and each section says so instead of failing.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mechdiag.config import read_yaml
from mechdiag.errors import UserError
from mechdiag.run import STREAMS, RunDir

_SEED_SUFFIX = re.compile(r"[-_.]?seed[-_=]?\d+$", re.IGNORECASE)


def _stem(run: Run) -> str:
    """The directory name without its seed suffix ("demo-seed42", "demo_3407" -> "demo")."""
    name = _SEED_SUFFIX.sub("", run.name)
    if name == run.name and run.seed is not None:
        name = re.sub(rf"[-_.]{re.escape(str(run.seed))}$", "", name)
    return name or run.name


@dataclass
class Run:
    rundir: RunDir
    name: str
    config: dict  # raw config.yaml ({} when absent); read loosely so old runs still report
    streams: dict[str, list[dict]]
    summary: dict
    source: str = "mechdiag"  # or "trl"

    @property
    def seed(self):
        return self.config.get("seed")

    def read(self, name: str) -> list[dict]:
        return self.streams.get(name, [])

    def has(self, name: str) -> bool:
        return bool(self.streams.get(name))


@dataclass
class Group:
    """Runs that share a config except the seed: drawn as one colour, seeds as mean and band."""

    label: str
    runs: list[Run]
    color: str = "#1f77b4"
    key: str = field(default="", repr=False)


PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22"]


def _is_trl_dir(path: Path) -> bool:
    has_ours = any((path / f"{s}.jsonl").exists() for s in STREAMS) or (path / "config.yaml").exists()
    if has_ours:
        return False
    return (path / "trainer_state.json").exists() or any(path.glob("checkpoint-*/trainer_state.json"))


def _read_trl(path: Path, stack: contextlib.ExitStack) -> RunDir:
    try:
        from mechdiag.integrations.trl import read_trl_run
    except ImportError:
        raise UserError(f"{path} is a TRL output directory, but the TRL reader is not installed") from None
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="mechdiag-trl-"))
    into = RunDir(Path(tmp) / path.name, create=True)
    out = read_trl_run(path, into=into)
    return out if isinstance(out, RunDir) else into


def load_run(path: str | Path, stack: contextlib.ExitStack) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"run directory not found: {path}")
    source = "mechdiag"
    if _is_trl_dir(path):
        rundir, source = _read_trl(path, stack), "trl"
    else:
        rundir = RunDir(path)
    streams = {s: rundir.read(s) for s in STREAMS}
    config = read_yaml(rundir.config_path) if rundir.config_path.exists() else {}
    summary = rundir.summary()
    if not any(streams.values()) and not summary and not config:
        raise UserError(f"{path} holds no run data (no config.yaml, summary.json or *.jsonl streams)")
    return Run(rundir=rundir, name=path.resolve().name, config=config, streams=streams, summary=summary,
               source=source)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _short(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def group_runs(runs: list[Run]) -> list[Group]:
    """Group runs whose configs are equal but for the seed, in the order given, and label each group."""
    groups: dict[str, Group] = {}
    for run in runs:
        cfg = {k: v for k, v in run.config.items() if k != "seed"}
        key = json.dumps(cfg, sort_keys=True, default=str) if run.config else f"path:{run.rundir.path}"
        if key not in groups:
            groups[key] = Group(label="", runs=[], key=key)
        groups[key].runs.append(run)
    out = list(groups.values())
    stems = [_stem(g.runs[0]) for g in out]
    if len(set(stems)) == len(out):
        labels = stems
    else:  # same names: tell groups apart by the config keys that differ
        flats = [_flat({k: v for k, v in g.runs[0].config.items() if k != "seed"}) for g in out]
        keys = sorted({k for f in flats for k in f})
        differ = [k for k in keys if len({_short(f.get(k)) for f in flats}) > 1]
        labels = []
        for stem, f in zip(stems, flats, strict=True):
            diff = ", ".join(f"{k}={_short(f.get(k))}" for k in differ[:3])
            labels.append(diff or stem)
        labels = [lab if labels.count(lab) == 1 else f"{lab} #{i + 1}" for i, lab in enumerate(labels)]
    for i, (g, lab) in enumerate(zip(out, labels, strict=True)):
        g.label = lab[:80]
        g.color = PALETTE[i % len(PALETTE)]
    return out
