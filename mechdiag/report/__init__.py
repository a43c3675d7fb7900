"""`mechdiag report`: one offline HTML page per run or comparison of runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mechdiag import atomic
from mechdiag.errors import UserError
from mechdiag.recommend import recommend
from mechdiag.report.figures import coloured
from mechdiag.report.html import Advice, advice_from, render_page
from mechdiag.run import Group, Run, group_runs

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


def advise(groups: list[Group]) -> Advice:
    """Ask mechdiag.recommend about all runs. When the runs are not enough for it (a UserError, e.g. a run with
    no metrics or no config.yaml) the page says so and the rest of the report stands."""
    try:
        result = recommend([r for g in groups for r in g.runs])
    except UserError as e:
        return Advice(note=f"Recommendations unavailable for these runs: {e}")
    return advice_from(result)


def render(runs: list[Run], findings=None) -> str:
    """The report page for these loaded runs, as a string. `findings`: an Advice, or what recommend returned (a
    Recommendation or a list of findings), to skip asking again; None asks mechdiag.recommend."""
    if not runs:
        raise UserError("report needs at least one run directory")
    groups = group_runs(runs)
    if findings is None:
        advice = advise(groups)
    else:
        advice = findings if isinstance(findings, Advice) else advice_from(findings)
    return render_page(coloured(groups), advice)


def write_report(runs: list[Run], out: str | os.PathLike | None = None, findings=None) -> Path:
    """Write the report atomically and return its path (default: reports/NAME.html under the cwd)."""
    paths = [r.path for r in runs]
    out = Path(out) if out is not None else default_out(paths)
    if out.suffix.lower() not in (".html", ".htm"):
        if out.is_dir() or not out.suffix:
            out = out / default_out(paths).name
        else:
            raise UserError(f"--out must be an .html file or a folder, got {out}")
    atomic.write_text(out, render(runs, findings=findings))
    return out
