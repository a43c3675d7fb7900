"""`mechdiag demo` for real (tiny settings): two seeds trained, the base-vs-tuned evaluation filled on the
held-out and out-of-distribution arith splits, and the page clean in headless chromium."""

from __future__ import annotations

import re

from mechdiag.demo import EVAL_TASKS, run_demo
from tests import chromium


def test_demo_fills_the_base_vs_tuned_evaluation(tmp_path):
    lines = []
    out = run_demo(tmp_path / "demo", tmp_path / "demo.html", max_steps=2, echo=lines.append, eval_n=4)
    assert any(line.startswith("evaluated base and 2 seeds") for line in lines), lines
    html = out.read_text()
    assert "No benchmark evaluation recorded" not in html
    table = html[html.index("<table class='cmp bench'>"):]
    table = table[:table.index("</table>")]
    assert all(f"<th class=bench>{t}</th>" in table for t in EVAL_TASKS), table
    assert "base" in table and "demo" in table
    assert re.search(r"<b>tuned, step 2</b>", html)  # eval completions of step 0 and the last step, paired
    page = chromium.load(out, size=(1400, 3000))
    assert page.console == [] and page.html_attr("data-report-status") == "ok", page.html_attr("data-errors")
    assert page.html_attr("data-rendered") == page.html_attr("data-figures")
