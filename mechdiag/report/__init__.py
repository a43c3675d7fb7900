"""`mechdiag report`: one offline HTML page per run or comparison of runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mechdiag import atomic
from mechdiag.errors import UserError
from mechdiag.report.load import Group, group_runs, load_run

__all__ = ["Advice", "advise", "advice_from", "default_out", "render", "write_report"]


def default_out(run_paths: list[str | os.PathLike]) -> Path:
    """reports/NAME.html for one run, reports/A-vs-B.html for a comparison (names shortened)."""
    names = []
    for p in run_paths:
        n = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(p).resolve().name) or "run"
        if n not in names:
            names.append(n)
    stem = "-vs-".join(names) if len(names) <= 3 else f"{names[0]}-and-{len(names) - 1}-more"
    return Path("reports") / f"{stem[:120]}.html"


@dataclass
class Shown:
    """A finding as the page shows it, whatever the recommender's own class looks like."""

    rule: str
    symptom: str
    evidence: str
    change: str
    confidence: float | None
    reason: str = ""


@dataclass
class Advice:
    findings: list[Shown] = field(default_factory=list)
    note: str = ""  # shown where there is no finding
    refined_yaml: str | None = None  # the refined config, when the recommender returns one


def _shown(f) -> Shown:
    change = getattr(f, "change", None)
    if change is None:  # mechdiag.recommend: a list of Change(key, old, new)
        change = "; ".join(str(c) for c in getattr(f, "changes", None) or []) or "none (advice only)"
    ev = getattr(f, "evidence", "")
    return Shown(rule=str(getattr(f, "rule", "")), symptom=str(getattr(f, "symptom", "")),
                 evidence=ev if isinstance(ev, str) else json.dumps(ev, default=str, ensure_ascii=False),
                 change=str(change), confidence=getattr(f, "confidence", None), reason=str(getattr(f, "reason", "")))


def advice_from(result) -> Advice:
    """Findings (and the refined config) from what recommend returned: a Recommendation or a list of findings."""
    findings = getattr(result, "findings", result)
    advice = Advice([_shown(f) for f in findings or []], "No recommendation: no rule fired on these runs.")
    cfg = getattr(result, "cfg", None)
    if cfg is not None and hasattr(cfg, "model_dump"):
        from mechdiag.config import to_yaml

        advice.refined_yaml = to_yaml(cfg, getattr(result, "header", "") or "")
    return advice


def advise(groups: list[Group]) -> Advice:
    """Ask mechdiag.recommend about all runs. Not installed, or the runs are not enough for it (a UserError,
    e.g. a run with no metrics or no config.yaml): the page says so and the rest of the report stands."""
    try:
        from mechdiag.recommend import recommend
    except ImportError:
        return Advice(note="Recommendations unavailable (mechdiag.recommend is not installed in this build).")
    try:
        result = recommend([r.rundir.path for g in groups for r in g.runs])
    except UserError as e:
        return Advice(note=f"Recommendations unavailable for these runs: {e}")
    return advice_from(result)


def render(run_paths: list[str | os.PathLike], findings=None) -> str:
    """The report page for these run directories, as a string. `findings`: an Advice, or what recommend
    returned (a Recommendation or a list of findings), to skip asking again; None asks mechdiag.recommend."""
    from mechdiag.report.html import render_page

    if not run_paths:
        raise UserError("report needs at least one run directory")
    with contextlib.ExitStack() as stack:  # holds temporary run dirs read from TRL output directories
        runs = [load_run(p, stack) for p in run_paths]
        groups = group_runs(runs)
        if findings is None:
            advice = advise(groups)
        else:
            advice = findings if isinstance(findings, Advice) else advice_from(findings)
        return render_page(groups, advice)


def write_report(run_paths: list[str | os.PathLike], out: str | os.PathLike | None = None,
                 findings=None) -> Path:
    """Write the report atomically and return its path (default: reports/NAME.html under the cwd)."""
    out = Path(out) if out is not None else default_out(run_paths)
    if out.suffix.lower() not in (".html", ".htm"):
        if out.is_dir() or not out.suffix:
            out = out / default_out(run_paths).name
        else:
            raise UserError(f"--out must be an .html file or a folder, got {out}")
    atomic.write_text(out, render(run_paths, findings=findings))
    return out
