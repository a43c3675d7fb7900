"""`mechdiag report`: one offline HTML page per run or comparison of runs."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from mechdiag import atomic
from mechdiag.errors import UserError
from mechdiag.report.load import Group, group_runs, load_run

__all__ = ["default_out", "findings_for", "write_report", "render"]


def default_out(run_paths: list[str | os.PathLike]) -> Path:
    """reports/NAME.html for one run, reports/A-vs-B.html for a comparison (names shortened)."""
    names = []
    for p in run_paths:
        n = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(p).resolve().name) or "run"
        if n not in names:
            names.append(n)
    stem = "-vs-".join(names) if len(names) <= 3 else f"{names[0]}-and-{len(names) - 1}-more"
    return Path("reports") / f"{stem[:120]}.html"


def findings_for(groups: list[Group]):
    """Findings of mechdiag.recommend for all runs, and the note shown when there are none."""
    try:
        from mechdiag.recommend import recommend
    except ImportError:
        return [], "Recommendations unavailable (mechdiag.recommend is not installed in this build)."
    findings = list(recommend([r.rundir for g in groups for r in g.runs]))
    return findings, "No recommendation: no rule fired on these runs."


def render(run_paths: list[str | os.PathLike], findings=None) -> str:
    """The report page for these run directories, as a string."""
    from mechdiag.report.html import render_page

    if not run_paths:
        raise UserError("report needs at least one run directory")
    with contextlib.ExitStack() as stack:  # holds temporary run dirs read from TRL output directories
        runs = [load_run(p, stack) for p in run_paths]
        groups = group_runs(runs)
        if findings is None:
            findings, note = findings_for(groups)
        else:
            note = "No recommendation: no rule fired on these runs."
        return render_page(groups, findings, note)


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
