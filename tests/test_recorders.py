"""The recording hooks with the displacement and shift parts merged in (needs branches disp and shift).

On the `train` branch alone these fail with ModuleNotFoundError; the lead runs them after the merge.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil

import pytest
import torch

from mechdiag import config as C
from mechdiag import report
from mechdiag.displacement import GEOMETRY_COLUMNS, displacement
from mechdiag.run import RunDir, load_runs
from mechdiag.train.trainer import train
from tests import chromium
from tests.test_train import small


def test_displacement_recorder_matches_the_factors(stories260k, tmp_path):
    importlib.import_module("mechdiag.displacement")  # fail loudly, not with a warning, when absent
    cfg = C.load(None, small(stories260k, "max_steps=2", "save_every=0", "record.displacement_every=1"))
    run = train(cfg, tmp_path / "run")
    rows = run.read("displacement")
    assert sorted({r["step"] for r in rows}) == [1, 2]
    for key in ("name", "layer", "module", "ref_fro", "delta_fro", "rel_fro"):
        assert all(key in r for r in rows), key
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(stories260k), run.final)
    want = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            d = mod.scaling["default"] * (mod.lora_B["default"].weight.double() @ mod.lora_A["default"].weight.double())
            layer = int(name.split(".layers.")[1].split(".")[0])
            want[(layer, name.rsplit(".", 1)[-1])] = (d.norm().item(), mod.base_layer.weight.double().norm().item())
    last = {(r["layer"], r["module"]): r for r in rows if r["step"] == 2}
    assert set(last) == set(want)
    for k, (delta, ref) in want.items():
        assert abs(last[k]["delta_fro"] - delta) <= 1e-5 * max(delta, 1e-12) + 1e-9, k
        assert abs(last[k]["rel_fro"] - delta / ref) <= 1e-5 * max(delta / ref, 1e-12) + 1e-9, k
    assert any(r["rel_fro"] > 0 for r in last.values())


def test_shift_recorder_writes_rows_at_eval(stories260k, tmp_path):
    importlib.import_module("mechdiag.probes.shift")
    cfg = C.load(None, small(stories260k, "max_steps=2", "save_every=0", "record.shift_at_eval=true",
                             "record.shift_n=4"))
    run = train(cfg, tmp_path / "run")
    rows = run.read("shift")
    assert rows and {r["step"] for r in rows} == {2}  # not at the base eval (step 0): nothing to compare
    layers = sorted(r["layer"] for r in rows)
    assert layers == sorted(set(layers)) and len(layers) == 5  # one row per decoder layer
    assert all(r["shift"] >= 0 for r in rows) and any(r["shift"] > 0 for r in rows)
    assert torch.isfinite(torch.tensor([r["shift"] for r in rows])).all()


def test_last_step_is_always_recorded(stories260k, tmp_path):
    """Final diagnostics: a run shorter than the displacement interval still has displacement (and shift) rows
    at its last step, so every run has a heatmap."""
    cfg = C.load(None, small(stories260k, "max_steps=3", "save_every=0", "record.displacement_every=2",
                             "record.shift_at_eval=true", "record.shift_n=2"))
    run = train(cfg, tmp_path / "run")
    assert sorted({r["step"] for r in run.read("displacement")}) == [2, 3]
    assert {r["step"] for r in run.read("shift")} == {3}
    cfg = C.load(None, small(stories260k, "max_steps=2", "save_every=0", "record.displacement_every=10"))
    assert {r["step"] for r in train(cfg, tmp_path / "short").read("displacement")} == {2}


def _strip_geometry(run_path, out):
    """A copy of a real run directory whose displacement rows carry no update geometry (as before it existed)."""
    shutil.copytree(run_path, out, ignore=shutil.ignore_patterns("final", "checkpoints"))
    rows = [{k: v for k, v in r.items() if k not in GEOMETRY_COLUMNS} for r in RunDir(out).read("displacement")]
    RunDir(out).replace_step("displacement", rows[-1]["step"], rows)  # every step's rows, rewritten
    return out


def test_final_displacement_rows_carry_the_spectral_geometry_and_the_report_draws_it(stories260k, tmp_path):
    cfg = C.load(None, small(stories260k, "max_steps=3", "save_every=0", "eval_every=0",
                             "record.displacement_every=2"))
    run = train(cfg, tmp_path / "run")
    rows = run.read("displacement")
    assert sorted({r["step"] for r in rows}) == [2, 3]
    assert not any(k in r for r in rows if r["step"] == 2 for k in GEOMETRY_COLUMNS)  # the final step only
    final = {r["name"]: r for r in rows if r["step"] == 3}
    want = displacement(stories260k, run.final, spectral=True).set_index("name")
    assert set(final) == set(want.index[want["lora_rank"].notna()])
    for name, r in final.items():
        w = want.loc[name]
        assert r["overlap_k"] == w.overlap_k == cfg.lora.r, name
        assert abs(r["subspace_overlap"] - w.subspace_overlap) <= 1e-9 * abs(w.subspace_overlap), name
        assert r["intruders"] == w.intruders, name
    overlaps = [r["subspace_overlap"] for r in final.values()]
    assert all(0 < v < 1 for v in overlaps) and len(set(overlaps)) > 1

    out = report.write_report(load_runs([run.path]), tmp_path / "geo.html")
    html = out.read_text()
    assert "update geometry at step 3" in html and f"k = {cfg.lora.r}" in html
    figs = [json.loads(b) for b in re.findall(r'class=fig-data[^>]*>(.*?)</script>', html, re.S)]
    geo = [f for f in figs if "update geometry" in json.dumps(f["layout"].get("title", {}))]
    assert len(geo) == 1 and [t["type"] for t in geo[0]["data"]] == ["heatmap", "heatmap"]
    cell = geo[0]["data"][0]
    name = next(n for n in final if ".layers.0." in n and n.endswith(f"{cell['x'][0]}.weight"))
    assert cell["z"][cell["y"].index(0)][0] == pytest.approx(final[name]["subspace_overlap"], rel=1e-3)
    page = chromium.load(out, size=(1400, 3000))
    assert page.console == [] and page.html_attr("data-report-status") == "ok", page.html_attr("data-errors")
    assert page.html_attr("data-rendered") == page.html_attr("data-figures")

    bare = report.render(load_runs([_strip_geometry(run.path, tmp_path / "bare")]))
    assert "update geometry" not in bare and "Update geometry" not in bare and "Weight displacement" in bare


def test_a_run_stopped_early_at_a_recorded_step_gets_its_geometry_once(stories260k, tmp_path):
    """max_time_s stops the run after step 1, which the recorder already wrote: its rows are replaced by rows
    with the geometry, each tensor once."""
    cfg = C.load(None, small(stories260k, "max_steps=3", "save_every=0", "eval_every=0", "max_time_s=1e-9",
                             "warmup_ratio=0", "record.displacement_every=1"))
    with pytest.warns(UserWarning, match="max_time_s"):
        run = train(cfg, tmp_path / "run")
    rows = run.read("displacement")
    assert {r["step"] for r in rows} == {1} and len(rows) == len({r["name"] for r in rows})
    assert all(r["delta_fro"] > 0 and r["overlap_k"] == cfg.lora.r and 0 < r["subspace_overlap"] < 1 for r in rows)
