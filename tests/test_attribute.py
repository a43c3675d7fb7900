"""mechdiag attribute on a real (short) GRPO run of the bundled base: exact reference rows, parts, in-place toggling,
--save into the run, the report section, the two rules, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mechdiag import attribute as A
from mechdiag.evidence import Signals
from mechdiag.metrics import attribution_reference, causal_shares, last_step, update_mass
from mechdiag.recommend import reduced_layers, reduced_modules
from mechdiag.run import RunDir, load_runs
from tests.helpers import assert_bad_input, invoke_cli, run_cli

# lr 5e-3 for 4 steps moves held-out accuracy on 48 problems, so the "none" and "all" rows differ
TRAIN = ["max_steps=4", "prompts_per_step=8", "eval_n=48", "threads=1", "learning_rate=5e-3", "max_time_s=null",
         "record.shift_at_eval=false", "save_every=0", "record.displacement_every=2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("attr") / "run"
    proc = run_cli("train", *[x for s in TRAIN for x in ("--set", s)], "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def saved(lora_run) -> tuple[Path, list[dict]]:
    proc = invoke_cli("attribute", str(lora_run), "--by", "both", "--format", "json", "--save")
    assert proc.returncode == 0, proc.stderr
    return lora_run, json.loads(proc.stdout)


def assert_exact_ends(rows: list[dict], summary: dict) -> None:
    """Part "none" is the run's final model and part "all" its base, to the last bit of summary.json."""
    assert summary["final_accuracy"] != summary["base_accuracy"]  # the two ends are distinguishable
    none, allr = attribution_reference(rows, "none"), attribution_reference(rows, "all")
    assert none["accuracy_without"] == summary["final_accuracy"]
    assert none["reward_without"] == summary["final_eval_reward"]
    assert allr["accuracy_without"] == summary["base_accuracy"]
    assert allr["reward_without"] == summary["base_eval_reward"]


def test_reference_rows_reproduce_the_summary_exactly(saved):
    run, rows = saved
    summary = json.loads((run / "summary.json").read_text())
    assert_exact_ends(rows, summary)
    none, allr = attribution_reference(rows, "none"), attribution_reference(rows, "all")
    # keeping everything is the tuned model, keeping nothing the base
    assert allr["accuracy_only"] == summary["final_accuracy"] and none["accuracy_only"] == summary["base_accuracy"]
    assert none["output_kl_without"] == 0.0 and allr["output_kl_only"] == 0.0
    assert allr["output_kl_without"] > 0 and none["output_kl_only"] == allr["output_kl_without"]


def test_rows_cover_every_layer_and_module(saved):
    _, rows = saved
    assert all(list(r) == A.COLUMNS for r in rows)
    layers = [r for r in rows if r["by"] == "layer"]
    modules = [r for r in rows if r["by"] == "module"]
    assert [r["layer"] for r in layers] == [0, 1, 2]  # the bundled base has 3 layers, all adapted
    assert [r["module"] for r in modules] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]
    for group in (layers, modules):
        assert sum(r["disp_share"] for r in group) == pytest.approx(1.0, abs=1e-12)
        assert all(r["output_kl_without"] > 0 and r["output_kl_only"] > 0 for r in group)
        assert all(0 <= r["accuracy_without"] <= 1 and 0 <= r["accuracy_only"] <= 1 for r in group)
    assert sum(causal_shares(rows, "layer").values()) == pytest.approx(1.0)


def test_disp_share_is_the_recorded_update_mass(saved):
    """The final adapter's shares equal those of the displacement stream at the last step (same quantity)."""
    run, rows = saved
    recorded = update_mass(last_step(RunDir(run).read("displacement")), "layer")
    for r in rows:
        if r["by"] == "layer":
            assert r["disp_share"] == pytest.approx(recorded[r["layer"]], rel=1e-9)


def test_toggling_restores_the_adapter(lora_run):
    import torch
    from safetensors.torch import load_file

    att = A.Attribution(lora_run, n=8)
    rows = att.rows("layer")
    assert len(rows) == 2 + 3
    saved = load_file(lora_run / "final" / "adapter_model.safetensors")
    state = {n: p for n, p in att.model.named_parameters() if "lora_B" in n}
    assert state
    for name, p in state.items():
        key = name.replace(".default", "")
        assert torch.equal(p.detach(), saved[key]), name


def test_save_writes_the_stream_and_report_shows_it(saved, tmp_path):
    run, rows = saved
    assert RunDir(run).read("attribution") == rows
    html = tmp_path / "r.html"
    proc = invoke_cli("report", str(run), "--out", str(html))
    assert proc.returncode == 0, proc.stderr
    page = html.read_text()
    assert "Attribution: causal vs displacement share" in page
    assert "Spearman rank correlation (displacement vs causal, by layer)" in page
    assert "No attribution recorded" not in page


def _copy_run(run: Path, dest: Path, rows: list[dict] | None) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("attribution.jsonl", "final", "checkpoints"))
    if rows is not None:
        (dest / "attribution.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest


def _signals(path: Path):
    return Signals.from_runs(load_runs([path]))


def _with_kl(rows: list[dict], by: str, kl: dict) -> list[dict]:
    """The recorded rows with the output KL of the `by` parts set (a run whose causal evidence is known)."""
    key = "layer" if by == "layer" else "module"
    return [{**r, "output_kl_without": kl[r[key]]} if r["by"] == by else r for r in rows]


def test_reduced_modules_uses_causal_share_when_recorded(saved, tmp_path):
    run, rows = saved
    s = _signals(run)
    assert s.causal["module"] == pytest.approx(causal_shares(rows, "module"))
    # displacement says MLP; the recorded attribution says v_proj and o_proj: attribution wins and is quoted
    kl = {"q_proj": 0.001, "k_proj": 0.001, "v_proj": 0.05, "o_proj": 0.03, "gate_proj": 0.001, "up_proj": 0.001,
          "down_proj": 0.001}
    s = _signals(_copy_run(run, tmp_path / "causal", _with_kl(rows, "module", kl)))
    s.module_mass = {"gate_proj": 0.45, "up_proj": 0.45, **{m: 0.02 for m in ("q_proj", "k_proj", "v_proj",
                                                                               "o_proj", "down_proj")}}
    f = reduced_modules(s)
    assert f is not None and f.data["source"] == "causal share" and "attribution" in f.evidence
    assert set(f.data["modules"].split(",")) == {"v_proj", "o_proj"}
    # without attribution the same displacement picks the MLP and says its evidence is displacement only
    s = _signals(_copy_run(run, tmp_path / "bare", None))
    s.module_mass = {"gate_proj": 0.45, "up_proj": 0.45, **{m: 0.02 for m in ("q_proj", "k_proj", "v_proj",
                                                                               "o_proj", "down_proj")}}
    f = reduced_modules(s)
    assert f is not None and f.data["source"] == "displacement" and "displacement only" in f.evidence
    assert set(f.data["modules"].split(",")) == {"gate_proj", "up_proj"}


def test_reduced_layers_uses_causal_share_when_recorded(saved, tmp_path):
    run, rows = saved
    n = 8
    ends = {0, 1, 6, 7}
    layer_rows = [{**rows[2], "part": f"layer {i}", "layer": i} for i in range(n)]
    base = [r for r in rows if r["by"] != "layer"] + layer_rows
    end_heavy = {i: (0.2 if i in ends else 0.01) for i in range(n)}
    flat = {i: 0.1 for i in range(n)}

    def signals(path):
        s = _signals(path)
        s.n_layers, s.shift = n, {}
        return s

    # causal concentrated at the ends fires and quotes attribution, though displacement is flat
    s = signals(_copy_run(run, tmp_path / "ends", _with_kl(base, "layer", end_heavy)))
    s.layer_mass = {i: 1 / n for i in range(n)}
    f = reduced_layers(s)
    assert f is not None and f.data["source"] == "causal share" and "attribution" in f.evidence
    # one layer holding the effect still keeps LAYERS_KEPT_MIN (bench/selection.py --study: one layer by attribution
    # learnt nothing at equal parameters), the next largest shares beside it
    one = {i: (0.9 if i == 3 else 0.01 * (i + 1)) for i in range(n)}
    s = signals(_copy_run(run, tmp_path / "one", _with_kl(base, "layer", one)))
    s.layer_mass = {i: 1 / n for i in range(n)}
    f = reduced_layers(s)
    assert f is not None and f.changes[0].new == [3, 5, 6, 7] and "at least 4" in f.reason
    # causal flat overrules displacement concentrated at the ends
    s = signals(_copy_run(run, tmp_path / "flat", _with_kl(base, "layer", flat)))
    s.layer_mass = {i: end_heavy[i] / sum(end_heavy.values()) for i in range(n)}
    assert reduced_layers(s) is None
    # no attribution: displacement alone fires it, and says so
    s = signals(_copy_run(run, tmp_path / "bare", None))
    s.layer_mass = {i: end_heavy[i] / sum(end_heavy.values()) for i in range(n)}
    f = reduced_layers(s)
    assert f is not None and f.data["source"] == "displacement" and "displacement only" in f.evidence


def test_formats_and_out(lora_run, tmp_path):
    out = tmp_path / "a.parquet"
    proc = invoke_cli("attribute", str(lora_run), "--by", "module", "--n", "8", "--format", "parquet", "--out",
                      str(out))
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    df = pd.read_parquet(out)
    assert list(df.columns) == A.COLUMNS and len(df) == 2 + 7
    proc = invoke_cli("attribute", str(lora_run), "--by", "layer", "--n", "8", "--format", "csv")
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == ",".join(A.COLUMNS)


@pytest.mark.parametrize("case", ["missing_final", "not_lora", "out_is_dir", "out_parent_is_file", "parquet_stdout",
                                  "no_run"])
def test_bad_input_exits_2_with_one_line(lora_run, tmp_path, case):
    run = tmp_path / "run"
    args = []
    if case == "missing_final":
        shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("final", "checkpoints"))
    elif case == "not_lora":
        shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("checkpoints"))
        cfg = (run / "config.yaml").read_text().replace("  enabled: true", "  enabled: false")
        (run / "config.yaml").write_text(cfg)
    else:
        run = lora_run
    if case == "out_is_dir":
        args = ["--out", str(tmp_path)]
    elif case == "out_parent_is_file":
        (tmp_path / "nope").write_text("a file, not a folder")
        args = ["--out", str(tmp_path / "nope" / "a.json")]
    elif case == "parquet_stdout":
        args = ["--format", "parquet"]
    elif case == "no_run":
        run = tmp_path / "absent"
    proc = invoke_cli("attribute", str(run), *args)
    assert_bad_input(proc)
    assert not (tmp_path / "nope").is_dir()
