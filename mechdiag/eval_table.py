"""The study's comparison table of `mechdiag eval` as text: benchmark x metric rows, base and tuned columns, and
the "N of M benchmark-metric configurations improve" line (rows come from mechdiag.evaluate.compare)."""

from __future__ import annotations

import math

from mechdiag.console import render_table as render_text_table
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


def render_table(rows: list[dict], color: bool = False, width: int | None = None) -> str:
    """The study's table: benchmark x metric rows, base and tuned columns, Δ marked (▲ green, ▼ red), fitted to
    the terminal by mechdiag.console (cells are plain text; on a narrow terminal the base column goes first, as
    each tuned cell carries its Δ against it)."""
    cols = list(dict.fromkeys(r["model"] for r in rows))
    cols = [BASE] + [c for c in cols if c != BASE] if BASE in cols else cols
    by = {(r["benchmark"], r["metric"], r["model"]): r for r in rows}
    keys = list(dict.fromkeys((r["benchmark"], r["metric"]) for r in rows))
    seeds = {c: max((r["seeds"] for r in rows if r["model"] == c), default=1) for c in cols}
    head = ["benchmark", "metric"] + [c if seeds[c] == 1 else f"{c} (x{seeds[c]})" for c in cols]
    body: list[list[str]] = []
    styles: list[list[str | None]] = []
    prev = None
    for b, m in keys:
        line, style = ["" if b == prev else b, m], [None, None]
        prev = b
        for c in cols:
            r = by.get((b, m, c))
            if r is None:
                line.append("")
                style.append(None)
                continue
            text = _fmt(r["value"], m) + (f" ± {_fmt(r['std'], m)}" if r["std"] is not None else "")
            if c != BASE and r["delta"] is not None and math.isfinite(r["delta"]):
                mark = {"improve": "▲", "regress": "▼"}.get(r["status"], " ")
                if r["status"] == "same":
                    text += " ="
                else:
                    text += f" {mark}{r['delta']:+.3f}" if m != "completion_length" else f" {mark}{r['delta']:+.1f}"
            line.append(text)
            style.append({"improve": "green", "regress": "red"}.get(r["status"]))
        body.append(line)
        styles.append(style)
    keep = head[:2] + head[3:] + head[2:3]  # base last: each tuned cell carries its Δ against it
    table = render_text_table(None, head, body, width=width, keep=keep, styles=styles, color=color)
    return table + "".join(summary_line(s) + "\n" for s in summary(rows)) + sandbox_line(rows)


def sandbox_line(rows: list[dict]) -> str:
    """The sandbox mode each benchmark's code ran under (bwrap, landlock, guard-only; none: no model code ran)."""
    modes: dict[str, list[str]] = {}
    for b, m in dict.fromkeys((r["benchmark"], r["sandbox"]) for r in rows if "sandbox" in r):
        modes.setdefault(m, []).append(b)
    if not modes:
        return ""
    return "sandbox: " + "; ".join(f"{m} ({', '.join(bs)})" for m, bs in modes.items()) + "\n"
