"""Several runs side by side: group them by how their configs differ (seeds pooled), report held-out eval
metrics as mean +- std over seeds, and say which treatment helped on which metric against a baseline group."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mechdiag import config as configlib
from mechdiag.config import Config
from mechdiag.errors import UserError
from mechdiag.run import RunDir

# Config keys that never define a treatment: the seed is what we pool over; the rest are bookkeeping.
IGNORED_KEYS = ("seed", "threads", "hooks", "save_every", "record.")
# Metrics where higher is better (the others, e.g. entropy or completion_length, are shown but not judged).
HIGHER_IS_BETTER = ("accuracy", "eval_reward", "pass@")


@dataclass
class Run:
    """Everything the rules and the comparison read from one run directory, loaded once."""

    path: Path
    cfg: Config
    metrics: list[dict]
    eval: list[dict]
    displacement: list[dict]
    shift: list[dict]
    summary: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)  # completions (what no_signal reads its cause from)

    @property
    def name(self) -> str:
        return self.path.name


def load_run(path) -> Run:
    try:
        from mechdiag.integrations.readers import foreign_kind, read_foreign
    except ImportError:
        foreign_kind = None
    if foreign_kind is not None and foreign_kind(path):  # TRL or verl: read into the run-directory shape first
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mechdiag-foreign-") as tmp:
            run = load_run(read_foreign(path, Path(tmp) / Path(path).name).path)
        run.path = Path(path)
        return run
    rd = RunDir(path)  # UserError if missing
    if not rd.config_path.is_file():
        raise UserError(f"{rd.path} has no config.yaml: not a run directory")
    cfg = configlib.load(rd.config_path)
    streams = {name: rd.read(name) for name in ("metrics", "eval", "displacement", "shift", "samples")}
    for name, rows in streams.items():
        bad = next((r for r in rows if not isinstance(r, dict)), None)
        if bad is not None:
            raise UserError(f"corrupt {rd.stream(name)}: a line is not a JSON object")
    if not streams["metrics"] and not streams["eval"]:
        raise UserError(f"{rd.path} has neither metrics.jsonl nor eval.jsonl records: nothing to diagnose")
    return Run(rd.path, cfg, streams["metrics"], streams["eval"], streams["displacement"], streams["shift"],
               rd.summary(), streams["samples"])


def load_runs(paths) -> list[Run]:
    if not paths:
        raise UserError("give at least one run directory")
    return [load_run(p) for p in paths]


# ---- held-out metrics ------------------------------------------------------------------------------------
def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _from_summary(summary: dict, which: str) -> dict:
    """summary.json's {"base": {...}} / {"final": {...}}, or its flat base_accuracy / final_accuracy keys."""
    rec = summary.get(which)
    if isinstance(rec, dict) and rec:
        return rec
    return {k.removeprefix(f"{which}_"): v for k, v in summary.items() if k.startswith(f"{which}_")}


def final_eval(run: Run) -> dict[str, float]:
    """The last eval record's numbers (summary.json's final ones where the eval stream is empty)."""
    rows = sorted((r for r in run.eval if _is_number(r.get("step"))), key=lambda r: r["step"])
    rec = rows[-1] if rows else _from_summary(run.summary, "final")
    return {k: float(v) for k, v in rec.items() if k != "step" and _is_number(v)}


def base_eval(run: Run) -> dict[str, float]:
    """Metrics of the untrained model: summary.json's base ones, else the eval record at the first step."""
    rec = _from_summary(run.summary, "base")
    if not rec:
        rows = sorted((r for r in run.eval if _is_number(r.get("step"))), key=lambda r: r["step"])
        rec = rows[0] if len(rows) > 1 else {}
    return {k: float(v) for k, v in rec.items() if k != "step" and _is_number(v)}


# ---- grouping by config difference -----------------------------------------------------------------------
def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("weights", "options"):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _treatment_items(cfg: Config) -> dict:
    flat = _flatten(cfg.model_dump(mode="json"))
    return {k: v for k, v in flat.items() if not k.startswith(IGNORED_KEYS)}


def _fmt(v) -> str:
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_fmt(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    return str(v)


@dataclass
class Group:
    label: str
    runs: list[Run]


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs whose configs agree except for seed-like keys form a group, labelled by the keys that vary across
    all runs (first run's group first: it is the baseline of `helped`)."""
    items = [_treatment_items(r.cfg) for r in runs]
    keys = sorted({k for it in items for k in it})
    varying = [k for k in keys if len({_fmt(it.get(k)) for it in items}) > 1]
    groups: dict[tuple, Group] = {}
    for run, it in zip(runs, items, strict=True):
        sig = tuple(_fmt(it.get(k)) for k in varying)
        if sig not in groups:
            label = ", ".join(f"{k}={v}" for k, v in zip(varying, sig, strict=True)) or "all runs"
            groups[sig] = Group(label, [])
        groups[sig].runs.append(run)
    return list(groups.values())


# ---- side by side ----------------------------------------------------------------------------------------
def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def judged(metric: str) -> bool:
    return any(metric.startswith(p) for p in HIGHER_IS_BETTER)


def verdict(delta: float, std_a: float, std_b: float, n_a: int, n_b: int) -> str:
    """helped / hurt when the difference of means exceeds the sum of the seed stds (a deliberately conservative
    band: with two seeds per group a std is a rough estimate); with one seed on a side only the sign is known."""
    if n_a < 2 or n_b < 2:
        return ("helped" if delta > 0 else "hurt" if delta < 0 else "no change") + " (1 seed)"
    if abs(delta) <= std_a + std_b:
        return "within seed noise"
    return "helped" if delta > 0 else "hurt"


def side_by_side(runs: list[Run]) -> list[dict]:
    """One flat record per (group, metric): mean and std over seeds of the final held-out metrics, their mean
    gain over the untrained model (vs_base), the difference to the baseline group (the first run's) and its
    verdict."""
    groups = group_runs(runs)
    stats, gains = [], []
    for g in groups:
        finals = [final_eval(r) for r in g.runs]
        bases = [base_eval(r) for r in g.runs]
        metrics = sorted({k for f in finals for k in f})
        per, gain = {}, {}
        for m in metrics:
            vals = [f[m] for f in finals if m in f]
            per[m] = (*_mean_std(vals), len(vals))
            diffs = [f[m] - b[m] for f, b in zip(finals, bases, strict=True) if m in f and m in b]
            gain[m] = sum(diffs) / len(diffs) if diffs else None
        stats.append(per)
        gains.append(gain)
    base = stats[0]
    out = []
    for g, per, gain in zip(groups, stats, gains, strict=True):
        for m, (mean, std, n) in per.items():
            rec = {"kind": "comparison", "group": g.label, "runs": len(g.runs), "seeds": n, "metric": m,
                   "mean": mean, "std": std, "vs_base": gain[m], "baseline": groups[0].label, "delta": None,
                   "verdict": ""}
            if g is groups[0]:
                rec["verdict"] = "baseline"
            elif m in base:
                b_mean, b_std, b_n = base[m]
                rec["delta"] = mean - b_mean
                rec["verdict"] = verdict(mean - b_mean, std, b_std, n, b_n) if judged(m) else "not judged"
            out.append(rec)
    return out


def helped_lines(records: list[dict]) -> list[str]:
    """One line per non-baseline group: the judged metrics it helped and hurt."""
    lines = []
    by_group: dict[str, list[dict]] = {}
    for r in records:
        if r["verdict"] not in ("baseline", "not judged", "") and r["delta"] is not None:
            by_group.setdefault(r["group"], []).append(r)
    for group, recs in by_group.items():
        parts = [f"{r['metric']} {r['delta']:+.4g} ({r['verdict']})" for r in recs]
        lines.append(f"{group} vs {recs[0]['baseline']}: " + "; ".join(parts))
    return lines
