"""The study's comparison table of `mechdiag eval` as text: benchmark x metric rows, base and tuned columns, and
the "N of M benchmark-metric configurations improve" line (rows come from mechdiag.evaluate.compare)."""

from __future__ import annotations

import math

import click

from mechdiag.metrics import is_score

BASE = "base"  # the column of the untrained model


def summary(rows: list[dict]) -> list[dict]:
    """Per tuned group: how many benchmark x score-metric configurations improve / regress on the base."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["model"] == BASE or not is_score(r["metric"]) or r["status"] is None:
            continue
        s = out.setdefault(r["model"], {"model": r["model"], "improve": 0, "regress": 0, "same": 0, "total": 0})
        s[r["status"]] += 1
        s["total"] += 1
    return list(out.values())


def summary_line(s: dict) -> str:
    return (f"{s['model']}: {s['improve']} of {s['total']} benchmark-metric configurations improve on the base "
            f"({s['regress']} regress, {s['same']} equal)")


def _fmt(v: float | None, metric: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if metric == "completion_length" else f"{v:.3f}"


def render_table(rows: list[dict], color: bool = False) -> str:
    """The study's table: benchmark x metric rows, base and tuned columns, Δ marked (+ green, - red)."""

    cols = list(dict.fromkeys(r["model"] for r in rows))
    cols = [BASE] + [c for c in cols if c != BASE] if BASE in cols else cols
    by = {(r["benchmark"], r["metric"], r["model"]): r for r in rows}
    keys = list(dict.fromkeys((r["benchmark"], r["metric"]) for r in rows))
    seeds = {c: max((r["seeds"] for r in rows if r["model"] == c), default=1) for c in cols}
    head = ["benchmark", "metric"] + [c if seeds[c] == 1 else f"{c} (x{seeds[c]})" for c in cols]
    body: list[list[tuple[str, str | None]]] = []
    for b, m in keys:
        line: list[tuple[str, str | None]] = [(b, None), (m, None)]
        for c in cols:
            r = by.get((b, m, c))
            if r is None:
                line.append(("", None))
                continue
            text = _fmt(r["value"], m) + (f" ± {_fmt(r['std'], m)}" if r["std"] is not None else "")
            if c != BASE and r["delta"] is not None and math.isfinite(r["delta"]):
                mark = {"improve": "▲", "regress": "▼"}.get(r["status"], " ")
                if r["status"] == "same":
                    text += " ="
                else:
                    text += f" {mark}{r['delta']:+.3f}" if m != "completion_length" else f" {mark}{r['delta']:+.1f}"
            line.append((text, {"improve": "green", "regress": "red"}.get(r["status"])))
        body.append(line)
    widths = [max(len(h), *(len(row[i][0]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
           "  ".join("-" * w for w in widths)]
    prev = None
    for row in body:
        cells = []
        for i, ((text, colour), w) in enumerate(zip(row, widths, strict=True)):
            if i == 0 and text == prev:
                text = ""
            cell = text.ljust(w)
            cells.append(click.style(cell, fg=colour) if color and colour else cell)
        prev = row[0][0]
        out.append("  ".join(cells).rstrip())
    for s in summary(rows):
        out.append(summary_line(s))
    return "\n".join(out)


