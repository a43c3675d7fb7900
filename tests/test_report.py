"""The HTML report: content, escaping, partial and TRL runs, CLI contract, and a real headless browser."""

from __future__ import annotations

import html
import json
import re
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from mechdiag import report
from mechdiag.errors import UserError
from mechdiag.integrations.readers import read_any_run
from mechdiag.report import default_out
from mechdiag.report.figures import coloured
from mechdiag.run import group_runs, load_run, load_runs
from tests import chromium
from tests.helpers import assert_bad_input
from tests.synth_runs import XSS_IMG, XSS_MARK, XSS_SCRIPT, make_run

MB = 1024 * 1024


def render(paths, **kw) -> str:
    return report.render(load_runs(paths, read_any_run), **kw)


def write_report(paths, out=None, **kw) -> Path:
    return report.write_report(load_runs(paths, read_any_run), out, **kw)


@dataclass
class Finding:
    rule: str
    symptom: str
    evidence: str
    change: str
    confidence: float


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A 200-step comparison: two seeds of the default and one seed of a higher beta."""
    root = tmp_path_factory.mktemp("runs")
    return {"a42": make_run(root / "demo-seed42", 42).path, "a3407": make_run(root / "demo-seed3407", 3407).path,
            "b42": make_run(root / "beta-seed42", 42, overrides=["beta=0.01"]).path}


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory) -> tuple[Path, chromium.Page]:
    """The comparison page loaded once in chromium; its screenshot lands beside it as report.png."""
    out = write_report(list(runs.values()), tmp_path_factory.mktemp("page") / "cmp.html")
    return out, chromium.load(out, screenshot=out.with_name("report.png"), size=(1400, 3000))


def _figures(html: str) -> list[dict]:
    blocks = re.findall(r'<script type="application/json" class=fig-data[^>]*>(.*?)</script>', html, re.S)
    return [json.loads(b) for b in blocks]


def _outside_plotly(html: str) -> str:
    """The page without the inlined plotly.js bundle (the largest script)."""
    scripts = re.findall(r"<script nonce='[^']+'>(.*?)</script>", html, re.S)
    return html.replace(max(scripts, key=len), "")


# ---- in a real browser ------------------------------------------------------------------------------------
def test_browser_renders_every_figure_without_console_messages(page):
    path, p = page
    n = len(_figures(path.read_text()))
    assert n == 6  # eight signals, other signals, two heatmaps (one per config), WDisp + mass, shift
    assert p.console == []  # no error, warning, CSP violation or log of any kind
    assert p.html_attr("data-report-status") == "ok", p.html_attr("data-errors")
    assert p.html_attr("data-figures") == str(n) and p.html_attr("data-rendered") == str(n)
    for k in range(1, n + 1):  # plotly took over every figure div and drew an svg into it
        div = re.search(rf'<div class="fig js-plotly-plot" id="fig-{k}"(.*?)<script', p.dom, re.S)
        assert div and 'class="main-svg"' in div.group(1), k
    assert p.title == "mechdiag report: beta=0.0, beta=0.01"


def test_hostile_completion_is_text_and_never_runs(page):
    path, p = page
    assert p.title != "pwned" and "pwned" not in p.title
    texts = [html.unescape(t) for t in re.findall(r'<pre class="completion">([^<]*)</pre>', p.dom)]
    assert f"{XSS_SCRIPT} {XSS_IMG}" in texts  # shown verbatim, as the text of one element
    assert any(XSS_MARK in t for t in texts)  # the hostile prompt too
    assert not re.search(r"<img\b|<svg onload", p.dom)  # no element was created from the payloads
    assert p.html_attr("data-report-status") == "ok"  # the page's own scripts did run
    assert p.html_attr("data-pwned") is None
    assert not re.search(r"<script>document\.title", path.read_text())
    assert p.console == []  # and nothing tried to run (a blocked attempt would log a CSP violation)


def test_screenshot_png(page):
    path, _ = page
    png = path.with_name("report.png")  # in the fixture's temp dir
    assert chromium.png_size(png) == (1400, 3000)
    assert png.stat().st_size > 50_000  # a blank page compresses to a few kB


def test_console_capture_sees_errors_and_csp_violations(tmp_path):
    """The harness itself: a page that logs an error and trips its CSP must be caught (else `== []` is vacuous)."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><head><meta http-equiv='Content-Security-Policy' content=\"default-src "
                    "'none'; script-src 'nonce-n'\"><script nonce='n'>console.error('boom-42')</script></head>"
                    "<body><script>document.title='ran'</script></body></html>")
    p = chromium.load(page, size=(400, 300), budget_ms=1000)
    assert any("boom-42" in m for m in p.console)
    assert any("Content Security Policy" in m for m in p.console)
    assert p.title != "ran"


def test_partial_run_renders_and_says_what_is_missing(tmp_path):
    run = make_run(tmp_path / "crashed", 42, steps=30, streams=("metrics",), summary=False)
    out = write_report([run.path], tmp_path / "partial.html")
    html = out.read_text()
    for what in ("No evaluations recorded", "No weight displacement recorded", "No activation shift recorded",
                 "No benchmark evaluation recorded", "No sample completions recorded",
                 "No base or final evaluation recorded"):
        assert what in html, what
    figs = _figures(html)
    assert len(figs) == 2  # the eight signals and the other train signals
    notes = [a["text"] for a in figs[0]["layout"].get("annotations", []) if a.get("text") == "not recorded"]
    assert len(notes) == 4  # the four eval panels
    p = chromium.load(out)
    assert p.console == [] and p.html_attr("data-report-status") == "ok"
    assert p.html_attr("data-rendered") == "2"


def test_user_signals_plotted_in_a_browser(tmp_path):
    run = make_run(tmp_path / "with-signal", 42, steps=30, streams=("metrics",), summary=False)
    run.register("reward_gap")
    run.append("reward_gap", [{"step": s, "gap": s / 10} for s in (1, 2, 3)] + [{"step": 3, "double_acc": 0.5}])
    html = write_report([run.path], tmp_path / "sig.html").read_text()
    assert "<section id=user-signals><h2>User signals</h2><h3>reward_gap</h3>" in html
    fig = _figures(html)[-1]
    assert [a["text"] for a in fig["layout"]["annotations"]] == ["gap", "double_acc"]
    assert [(t["x"], t["y"]) for t in fig["data"]] == [([1, 2, 3], [0.1, 0.2, 0.3]), ([3], [0.5])]
    p = chromium.load(tmp_path / "sig.html")
    assert p.console == [] and p.html_attr("data-rendered") == "3"
    no_signal = write_report([make_run(tmp_path / "plain", 42, steps=30).path], tmp_path / "plain.html")
    assert "User signals" not in no_signal.read_text()


# ---- page content -----------------------------------------------------------------------------------------
def test_page_size_and_self_contained(tmp_path):
    runs = [make_run(tmp_path / f"long-seed{s}", s, steps=200, layers=8, disp_every=10).path for s in (42, 3407)]
    out = write_report(runs, tmp_path / "long.html")
    size = out.stat().st_size
    assert size <= 6 * MB, size
    html = out.read_text()
    assert html.count("plotly.js v") == 1  # the bundle's banner: inlined once
    rest = _outside_plotly(html)
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|<iframe\b", rest)
    assert not re.search(r"https?://", rest)
    assert "default-src 'none'" in html  # nothing may be fetched at view time
    assert len(rest) < 1 * MB


def test_eight_signals_with_seed_bands(runs):
    fig = _figures(render([runs["a42"], runs["a3407"]]))[0]
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    for t in ("train reward", "reward CV (within groups)", "KL to reference", "completion clipped ratio",
              "eval accuracy", "eval reward", "eval entropy", "eval completion length"):
        assert t in titles
    bands = [t for t in fig["data"] if t.get("fill") == "toself"]
    lines = [t for t in fig["data"] if t.get("fill") != "toself"]
    assert len(bands) == 8 and len(lines) == 8  # two seeds -> one band and one mean line per panel
    reward = lines[0]
    assert len(reward["x"]) == 200 and reward["x"][0] == 1


def test_other_signals_include_reward_components(runs):
    fig = _figures(render([runs["a42"]]))[1]
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles[:2] == ["reward: correctness", "reward: format"]
    assert "groups with zero reward std" in titles and "tokens / s" in titles


def test_long_runs_are_binned(tmp_path):
    run = make_run(tmp_path / "huge", 1, steps=1200, streams=("metrics",), summary=False)
    fig = _figures(render([run.path]))[0]
    assert max(len(t["x"]) for t in fig["data"]) == 400


def test_heatmap_layers_by_modules_with_steps(runs):
    figs = _figures(render([runs["a42"], runs["a3407"]]))
    heat = next(f for f in figs if f["data"][0]["type"] == "heatmap")
    z = heat["data"][0]["z"]
    assert len(z) == 4 and len(z[0]) == 7  # layers x modules
    assert heat["data"][0]["x"][:2] == ["q_proj", "k_proj"]
    steps = heat["layout"]["sliders"][0]["steps"]
    assert [s["label"] for s in steps] == [str(s) for s in range(20, 201, 20)]
    # the last slider step shows the initial z; later layers moved more in the synthetic runs
    assert steps[-1]["args"][0]["z"][0] == z
    assert z[3][3] > z[0][3]
    mass = next(f for f in figs if any(t["type"] == "bar" for t in f["data"]))
    bar = next(t for t in mass["data"] if t["type"] == "bar")
    assert abs(sum(bar["y"]) - 1) < 1e-3
    assert max(zip(bar["y"], bar["x"], strict=True))[1] in ("v_proj", "o_proj")


def test_heatmap_cell_pools_weight_and_bias(tmp_path):
    run = make_run(tmp_path / "wb", 1, steps=5, streams=())
    run.append("displacement", [
        {"step": 5, "name": "model.layers.0.self_attn.q_proj.weight", "layer": 0, "module": "q_proj",
         "ref_fro": 3.0, "delta_fro": 0.3, "rel_fro": 0.1},
        {"step": 5, "name": "model.layers.0.self_attn.q_proj.bias", "layer": 0, "module": "q_proj",
         "ref_fro": 4.0, "delta_fro": 0.0, "rel_fro": 0.0},
        {"step": 5, "name": "model.layers.0.self_attn.k_proj.weight", "layer": 0, "module": "k_proj",
         "rel_fro": 0.25}])
    heat = _figures(render([run.path]))[0]["data"][0]
    assert heat["x"] == ["q_proj", "k_proj"]
    assert heat["z"] == [[0.06, 0.25]]  # sqrt(0.09 / 25) pooled; rel_fro where the norms are missing


def test_shift_intervals(runs):
    figs = _figures(render([runs["a42"]]))
    shift = figs[-1]
    tr = shift["data"][0]
    assert tr["x"] == [0.0, 1.0, 2.0, 3.0]
    err = tr["error_y"]
    assert all(abs(a - 0.1 * y) < 1e-3 for a, y in zip(err["array"], tr["y"], strict=True))


def test_eval_table_colours_improvements_and_regressions(runs):
    html = render([runs["a42"], runs["a3407"]])
    table = html[html.index("class='cmp bench'"):]
    table = table[:table.index("</table>")]
    gsm = re.search(r"<th class=bench>gsm8k</th>(.*?)</tr>", table).group(1)
    cells = re.findall(r"<td class='([^']*)'", gsm)
    assert cells == ["", "up", "", "down"]  # pass@1: base, tuned (better); pass@3: base, tuned (worse)
    assert "0.4" in gsm


def test_summary_base_vs_final(runs):
    html = render([runs["a42"], runs["a3407"]])
    row = re.search(r"<td>accuracy</td><td>(.*?)</td><td>(.*?)</td><td class='(\w*)'>(.*?)</td>", html)
    assert row and row.group(3) == "up" and float(row.group(4)) > 0.4
    assert "<td>completion_length</td>" in html and "class=''>-9</td>" in html  # length: no colour


def test_summary_flat_keys_and_eval_fallback(tmp_path):
    flat = make_run(tmp_path / "flat", 1, steps=20, streams=(), summary=False)
    flat.write_summary({"base_accuracy": 0.2, "final_accuracy": 0.1})
    html = render([flat.path])
    assert re.search(r"<td>accuracy</td><td>0.2</td><td>0.1</td><td class='down'>-0.1</td>", html)
    ev = make_run(tmp_path / "ev", 1, steps=40, streams=("eval",), summary=False)
    html = render([ev.path])
    assert "from eval.jsonl" in html  # base = the step-0 eval, final = the last one
    assert re.search(r"<td>accuracy</td><td>0\.1\d*</td><td>0\.3\d*</td><td class='up'>", html)


def test_findings_rendered_escaped(runs):
    f = Finding(rule="high_kl", symptom="KL 0.3 > 0.1 <b>", evidence="<script>x()</script> kl max 0.3",
                change="beta: 0.005 -> 0.01", confidence=0.8)
    html = render([runs["a42"]], findings=[f])
    assert "<script>x()" not in html and "&lt;script&gt;x()&lt;/script&gt;" in html
    assert "<code>beta: 0.005 -&gt; 0.01</code>" in html and "<td>80%</td>" in html
    assert "<ol class=top><li><b>beta: 0.005 -&gt; 0.01</b>" in html


def test_recommend_called_with_all_run_dirs(runs, monkeypatch):
    seen = []
    monkeypatch.setattr(report, "recommend", lambda loaded: seen.append([r.path for r in loaded]) or [
        Finding("low_cv", "reward CV 0.02", "cv", "temperature: 1.0 -> 1.2", 0.5)])
    html = render([runs["a42"], runs["b42"]])
    assert seen == [[runs["a42"], runs["b42"]]]
    assert "temperature: 1.0 -&gt; 1.2" in html


def test_recommendation_object_with_changes_and_refined_config(runs, monkeypatch):
    """The shape mechdiag.recommend returns: Recommendation(cfg, findings with .changes and .reason)."""
    from mechdiag import config

    @dataclass
    class Change:
        key: str
        old: object
        new: object

        def __str__(self):
            return f"{self.key}: {self.old} -> {self.new}"

    @dataclass
    class Rec:
        cfg: object
        findings: list
        header: str = "refined by mechdiag <test>"

    f = types.SimpleNamespace(rule="high_kl", symptom="KL high", evidence="kl 0.3", reason="closer to base",
                              changes=[Change("beta", 0.005, 0.01), Change("epsilon_high", None, 0.3)],
                              confidence=0.7)
    monkeypatch.setattr(report, "recommend", lambda loaded: Rec(config.load(None, ["beta=0.01"]), [f]))
    html = render([runs["a42"]])
    assert "<code>beta: 0.005 -&gt; 0.01; epsilon_high: None -&gt; 0.3</code>" in html
    assert "closer to base" in html and "<td>70%</td>" in html
    assert "# refined by mechdiag &lt;test&gt;" in html and "beta: 0.01" in html


def test_recommender_refusing_the_runs_leaves_the_report(runs, monkeypatch):
    def recommend(paths):
        raise UserError("run has no config.yaml: not a run directory")

    monkeypatch.setattr(report, "recommend", recommend)
    html = render([runs["a42"]])
    assert "Recommendations unavailable for these runs: run has no config.yaml" in html
    assert len(_figures(html)) == 5  # one config: one heatmap


def test_run_labels_and_names_escaped(tmp_path):
    a = make_run(tmp_path / "x" / "<img src=x onerror=alert(1)>", 1, steps=20, streams=("metrics",))
    html = render([a.path])
    assert "<img src=x" not in _outside_plotly(html)
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


# ---- grouping ---------------------------------------------------------------------------------------------
def test_grouping_by_config_and_labels(tmp_path):
    same = [make_run(tmp_path / "a" / "run", 42, steps=5, streams=()),
            make_run(tmp_path / "b" / "run", 42, steps=5, streams=(), overrides=["lora.layers=first2+last2"])]
    seeds = [make_run(tmp_path / "demo_42", 42, steps=5, streams=()),
             make_run(tmp_path / "demo_3407", 3407, steps=5, streams=())]
    g = group_runs([load_run(r.path) for r in seeds])
    assert [x.label for x in g] == ["demo"] and len(g[0].runs) == 2
    g = coloured(group_runs([load_run(r.path) for r in same]))
    assert [x.label for x in g] == ["lora.layers=all", "lora.layers=first2+last2"]
    assert g[0].color != g[1].color


def test_odd_text_survives(tmp_path):
    run = make_run(tmp_path / "odd", 1, steps=5, streams=())
    # a lone surrogate is valid JSON (another writer's file) but cannot be encoded as UTF-8
    (run.path / "samples.jsonl").write_text('{"step": 5, "group": 0, "prompt": "p\\u0000", "completion": '
                                            '"a\\ud800b ' + "x" * 5000 + '", "split": "train", "reward": null}\n')
    html = write_report([run.path], tmp_path / "odd.html").read_text(encoding="utf-8")
    assert "a\ufffdb" in html
    assert "2004 more characters" in html  # long completions are cut with a note


def test_missing_keys_tolerated(tmp_path):
    run = make_run(tmp_path / "nokl", 42, steps=20, streams=(), summary=False)
    run.append("metrics", [{"step": s, "reward": 0.1 * s, "loss": None} for s in range(1, 21)])
    run.append("eval", [{"step": 20, "accuracy": None}])
    run.append("samples", [{"step": 5, "completion": None, "split": "eval"}])
    run.append("displacement", [{"step": 10, "name": "lm_head", "layer": None, "module": None,
                                 "ref_fro": 1.0, "delta_fro": 0.1}])
    html = render([run.path])
    figs = _figures(html)
    notes = [a for a in figs[0]["layout"]["annotations"] if a["text"] == "not recorded"]
    assert len(notes) == 7  # only train reward was recorded
    assert len(figs) == 2  # no heatmap (no layer x module rows), but the WDisp line from the lm_head row


# ---- TRL output directories -------------------------------------------------------------------------------
def test_trl_output_dir_read_through_reader(tmp_path):
    trl_dir = tmp_path / "trl-out"
    trl_dir.mkdir()
    (trl_dir / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 0.5}]}))
    html = render([trl_dir])
    assert "<span class=tag>trl</span>" in html and "trl-out" in html
    assert len(_figures(html)) == 1


# ---- CLI --------------------------------------------------------------------------------------------------
def test_cli_report_default_out(cli, runs, tmp_path):
    proc = cli("report", str(runs["a42"]), str(runs["a3407"]), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "reports" / "demo-seed42-vs-demo-seed3407.html"
    assert proc.stdout.strip() == str(Path("reports") / out.name)
    assert out.stat().st_size > 4 * MB and out.read_text().rstrip().endswith("</html>")
    assert default_out([runs["a42"]]) == Path("reports/demo-seed42.html")


def test_out_folder_gets_default_name(runs, tmp_path):
    assert write_report([runs["a42"]], tmp_path / "dir") == tmp_path / "dir" / "demo-seed42.html"
    assert (tmp_path / "dir" / "demo-seed42.html").is_file()


def test_cli_report_bad_input(cli, runs, tmp_path):
    assert_bad_input(cli("report", str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    assert_bad_input(cli("report", str(tmp_path / "empty")))
    assert_bad_input(cli("report", str(runs["a42"]), "--out", str(tmp_path / "r.pdf")))
    assert not (tmp_path / "r.pdf").exists()
    bad = make_run(tmp_path / "corrupt", 1, steps=3, streams=("metrics",))
    (bad.path / "eval.jsonl").write_text("{not json\n")
    assert_bad_input(cli("report", str(bad.path)))


# ---- demo (against a stand-in trainer; the real one is exercised after merge) ------------------------------
def test_demo_trains_two_seeds_and_writes_report(tmp_path, monkeypatch):
    from mechdiag import demo
    from mechdiag.demo import SEEDS, run_demo

    calls = []

    def train(cfg, out_dir):
        calls.append((cfg.seed, cfg.max_steps, cfg.record.displacement_every, Path(out_dir).name))
        return make_run(Path(out_dir), cfg.seed, steps=cfg.max_steps, eval_every=cfg.eval_every,
                        disp_every=cfg.record.displacement_every)

    monkeypatch.setattr(demo, "train", train)  # synthetic runs: the demo's own steps, not minutes of training
    lines = []
    out = run_demo(tmp_path / "demo", tmp_path / "demo.html", max_steps=20, echo=lines.append, eval_n=0)
    assert SEEDS == (42, 3407)
    assert calls == [(42, 20, 5, "demo-seed42"), (3407, 20, 5, "demo-seed3407")]
    assert out == tmp_path / "demo.html"
    html = out.read_text()
    assert "mechdiag report: demo</title>" in html and "n=2 seeds" in html
    assert lines[-1].startswith("demo done in")
    run_demo(tmp_path / "demo", tmp_path / "demo.html", max_steps=20, echo=lines.append, eval_n=0)  # replaces
    (tmp_path / "other" / "demo-seed42").mkdir(parents=True)
    with pytest.raises(UserError, match="not a previous demo run"):
        run_demo(tmp_path / "other", tmp_path / "x.html", max_steps=20, echo=lines.append, eval_n=0)
