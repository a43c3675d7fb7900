"""The report as a newcomer reads it: base vs tuned completions of a real run, one direction table, the keys that
differ between runs, integer layer ticks, labels in their own panels, and a clip panel that says why it is 0."""

from __future__ import annotations

import json
import re

import pytest

from mechdiag import report
from mechdiag.metrics import direction
from mechdiag.run import load_runs
from tests import chromium
from tests.synth_runs import make_run


def render(paths) -> str:
    return report.render(load_runs(paths))


def write_report(paths, out):
    return report.write_report(load_runs(paths), out)


def _figures(html: str) -> list[dict]:
    blocks = re.findall(r'<script type="application/json" class=fig-data[^>]*>(.*?)</script>', html, re.S)
    return [json.loads(b) for b in blocks]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("views")
    return [make_run(root / "demo-seed42", 42).path, make_run(root / "beta-seed42", 42, overrides=["beta=0.01"]).path]


def test_real_run_shows_step0_and_last_step_completions_in_chromium(tiny_run, tmp_path):
    out = write_report([tiny_run], tmp_path / "tiny.html")
    html = out.read_text()
    assert "No eval completions recorded" not in html
    pairs = re.findall(r"<div class=pair>(.*?)</div></div></div>", html, re.S)
    assert pairs and all("<b>prompt</b>" in p and "<b>base</b>" in p and "<b>tuned, step 6</b>" in p
                         for p in pairs)
    assert all("no base completion recorded" not in p for p in pairs)  # step 0 pairs with the last step
    page = chromium.load(out, size=(1400, 3000))
    assert page.console == [] and page.html_attr("data-report-status") == "ok", page.html_attr("data-errors")
    assert page.html_attr("data-rendered") == page.html_attr("data-figures")


def test_one_direction_table_entropy_is_neutral():
    assert direction("accuracy") == direction("pass@3") == direction("reward/correctness") == 1
    assert direction("truncation_rate") == -1
    assert direction("entropy") == direction("completion_length") == direction("kl") == 0


def test_eval_table_fits_its_card_and_does_not_colour_entropy(tmp_path):
    run = make_run(tmp_path / "r", 1)
    (run.path / "eval_benchmarks.jsonl").write_text("")
    run.append("eval_benchmarks", [
        {"benchmark": "arith/test", "metric": m, "model": model, "value": v, "step": 0}
        for m, base, tuned in [("accuracy", 0.2, 0.5), ("entropy", 1.0, 0.4)]
        for model, v in [("base", base), ("tuned", tuned)]])
    html = render([run.path])
    table = html[html.index("<div class=scroll><table class='cmp bench'>"):]
    table = table[:table.index("</table>")]
    row = re.search(r"<th class=bench>arith/test</th>(.*?)</tr>", table).group(1)
    assert re.findall(r"<td class='([^']*)'", row) == ["", "up", "", ""]  # accuracy up; entropy not judged
    assert ".scroll{max-width:100%;overflow-x:auto}" in html


def test_runs_table_shows_differing_keys_and_figures_read_right(pair):
    html = render(pair)
    runs = html[html.index("<table class=runs>"):]
    runs = runs[:runs.index("</table>")]
    assert "<th class=diff>β</th>" in runs and "beta" in html[html.index("highlighted: config keys"):][:200]
    figs = _figures(html)
    heat = [f for f in figs if any(t.get("type") == "heatmap" for t in f["data"])]
    assert heat and all(f["layout"]["yaxis"].get("dtick") == 1 for f in heat)  # integer layer ticks
    other = next(f for f in figs if any("policy clip fraction" in a.get("text", "")
                                        for a in f["layout"].get("annotations", [])))
    why = [a for a in other["layout"]["annotations"] if "by construction" in a.get("text", "")]
    titles = {a["text"]: a for a in other["layout"]["annotations"] if a.get("text") == "policy clip fraction"}
    assert len(why) == 1 and "num_iterations = 1" in why[0]["text"]
    # the note sits in the clip panel: its axes are those of the panel titled "policy clip fraction"
    panel_x = other["layout"][why[0]["xref"].split()[0].replace("x", "xaxis", 1)]["domain"]
    assert panel_x[0] <= titles["policy clip fraction"]["x"] <= panel_x[1]


def test_not_recorded_lands_in_its_own_panel(tmp_path):
    run = make_run(tmp_path / "r", 1)
    # no eval stream: the four eval panels of the eight signals say "not recorded", the train panels do not
    (run.path / "eval.jsonl").write_text("")
    fig = next(f for f in _figures(render([run.path])) if any(
        a.get("text") == "KL to reference" for a in f["layout"].get("annotations", [])))
    notes = [a for a in fig["layout"]["annotations"] if a.get("text") == "not recorded"]
    titles = [a for a in fig["layout"]["annotations"] if a.get("text") not in ("not recorded", None)]
    assert notes
    for n in notes:
        dom_x = fig["layout"][n["xref"].split()[0].replace("x", "xaxis", 1)]["domain"]
        dom_y = fig["layout"][n["yref"].split()[0].replace("y", "yaxis", 1)]["domain"]
        title = next(t for t in titles if dom_x[0] <= t["x"] <= dom_x[1] and abs(t["y"] - dom_y[1]) < 0.05)
        assert title["text"] not in ("reward", "KL to reference"), title["text"]  # an eval panel, not a train one
