"""The recording hooks with the displacement and shift parts merged in (needs branches disp and shift).

On the `train` branch alone these fail with ModuleNotFoundError; the lead runs them after the merge.
"""

from __future__ import annotations

import importlib

import torch

from mechdiag import config as C
from mechdiag.train.trainer import train
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
