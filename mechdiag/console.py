"""Terminal output for every command: tables that fit the terminal, and progress lines when output is not one.

Tables: numbers are never cut (a numeric column is as wide as its widest number; the significant digits drop
from 4 to 2, then trailing columns are left out, until the table fits); text columns wrap; values are shown as
plain text, never read as rich markup ("[q_proj, v_proj]" stays as written).
Progress (and progress()): a terminal gets a rich bar; a log file or pipe gets one line at most every EVERY_S
seconds.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import shutil
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar
from rich.table import Table
from rich.text import Text

EVERY_S = 10.0
TEXT_MIN = 20  # the narrowest a wrapping text column is allowed to become when deciding what fits
DIGITS = (4, 3, 2)


def note(message: str) -> None:
    """One line on stderr that says what mechdiag changed or assumed, without stopping (errors are UserError)."""
    print(f"mechdiag: note: {message}", file=sys.stderr, flush=True)


def terminal_width() -> int:
    """The terminal's columns ($COLUMNS wins; 100 when there is no terminal, as in a pipe or a log file)."""
    return shutil.get_terminal_size((100, 24)).columns


def number(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, float) and math.isnan(v):
        return "NaN/Inf"  # callers mark a non-finite tensor norm as nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def _is_number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


# Text made only of numbers ("0.56 ± 0.014 (+0.36)"): kept whole like a number, never wrapped mid-figure.
_NUMERIC_TEXT = re.compile(r"[\d.eE+\-±()% ]+|-|inf|nan|NaN/Inf")


def _fixed(v) -> bool:
    return _is_number(v) or (isinstance(v, str) and _NUMERIC_TEXT.fullmatch(v) is not None)


def render_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence], width: int | None = None,
                 digits: int = 4, keep: Sequence[str] = (), styles: Sequence[Sequence[str | None]] | None = None,
                 color: bool = False) -> str:
    """A table as text no wider than `width` (default: the terminal). Cells are values: numbers are formatted
    here, a missing value (None) is "-", everything else is str(value). When columns must go, those named in
    `keep` go last (in that order of importance), the others from the right. styles[r][c] colours a cell (a rich
    colour name, applied as a style, never parsed from the value) when `color` is set."""
    width = width or terminal_width()
    columns = list(columns)
    importance = [columns.index(k) for k in keep if k in columns]
    importance += [i for i in range(len(columns)) if i not in importance]
    numeric = [bool(rows) and all(_is_number(r[i]) for r in rows) for i in range(len(columns))]
    fixed = [bool(rows) and all(_fixed(r[i]) for r in rows) for i in range(len(columns))]

    def layout(n_cols: int, d: int) -> list[tuple[str, bool, list[str], int]]:
        """(header, fixed width, formatted cells, index) of the n_cols most important columns, in their order."""
        return [(columns[i], fixed[i], [number(r[i], d) if numeric[i] or r[i] is None else str(r[i]) for r in rows], i)
                for i in sorted(importance[:n_cols])]

    def need(cols) -> int:
        w = 1
        for head, is_num, cells, _ in cols:
            longest = max([len(c) for c in cells] + [len(head)])
            w += 3 + (longest if is_num else min(longest, TEXT_MIN))
        return w

    # Prefer every column at 4 or 3 significant digits, then fewer columns; 2 digits only as a last resort.
    n_all = len(columns)
    tries = [(n, d) for n in range(n_all, 0, -1) for d in DIGITS[:-1] if d <= digits]
    tries += [(n, DIGITS[-1]) for n in range(n_all, 0, -1)]
    chosen = next((cols for cols in (layout(n, d) for n, d in tries) if need(cols) <= width), None)
    if chosen is None:  # not even one column fits: the most important one anyway, wrapping
        chosen = layout(1, DIGITS[-1])
    hidden = n_all - len(chosen)
    table = Table(title=Text(title) if title else None,
                  caption=Text(f"{hidden} more column(s) need a wider terminal or --format json") if hidden else None)
    for head, is_num, cells, _ in chosen:
        if is_num:  # fixed width: rich never narrows it, so a number is never cut or wrapped
            table.add_column(Text(head), justify="right", overflow="fold", width=max(len(c) for c in cells + [head]))
        else:
            table.add_column(Text(head), justify="left", overflow="fold")
    for j, r in enumerate(zip(*(cells for _, _, cells, _ in chosen), strict=True)):
        table.add_row(*(Text(c, style=(styles[j][i] or "") if color and styles else "")
                        for c, (_, _, _, i) in zip(r, chosen, strict=True)))
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=color, no_color=not color, highlight=False,
            color_system="standard" if color else None).print(table)
    return buf.getvalue()


class Progress:
    """A long job's progress, the one switch every long command and the trainer use. Not on a terminal (nohup, CI
    logs), or with `force`: one line "LABEL: DONE/TOTAL note (Ns)" at most every `every_s` seconds. On a terminal:
    with `bar` a rich bar (the note beside it; `bar_drawn` says so), else nothing."""

    def __init__(self, label: str, total: float | None = None, every_s: float = EVERY_S, stream=None,
                 force: bool = False, bar: bool = False, done: float = 0, transient: bool = True):
        self.label, self.total, self.every_s = label, total, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or not _is_terminal(self.stream)
        self.t0 = time.perf_counter()
        self.last = -math.inf
        self.bar_drawn = bar and not self.enabled
        if self.bar_drawn:
            self.bar = Bar(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TextColumn("{task.fields[note]}"), console=Console(file=self.stream), transient=transient)
            self.bar.start()
            self.task = self.bar.add_task(label, total=total, completed=done, note="")

    def update(self, done: float | None = None, note: str = "", final: bool = False) -> bool:
        """Move the bar, or print a line if due (or `final`); returns whether a line was printed."""
        if self.bar_drawn:
            self.bar.update(self.task, completed=done, note=note)
            return False
        now = time.perf_counter()
        if not self.enabled or (not final and now - self.last < self.every_s):
            return False
        self.last = now
        parts = [f"{self.label}:"]
        if done is not None:
            parts.append(f"{done:g}/{self.total:g}" if self.total else f"{done:g}")
        if note:
            parts.append(note)
        parts.append(f"({now - self.t0:.0f}s)")
        print(" ".join(parts), file=self.stream, flush=True)
        return True

    def close(self) -> None:
        if self.bar_drawn:
            self.bar.stop()
            self.bar_drawn = False


@contextlib.contextmanager
def progress(label: str, total: float, stream=None):
    """update(done, note=""): Progress with a transient bar on a terminal, else lines, for the block."""
    p = Progress(label, total=total, stream=stream, bar=True)
    try:
        yield lambda done, note="": p.update(done, note)
    finally:
        p.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
