"""The second bundled base, `bundled:deep`: 8 layers, small on disk, the bundled tokenizer, loadable wherever a
model name is (train config included), and its card's greedy accuracy inside the 20-60% band it was built for."""

from __future__ import annotations

import json

import torch

from mechdiag.models import (
    BUNDLED_ASSETS,
    bundled_path,
    checkpoint_folder,
    generate,
    load_model_and_tokenizer,
    load_tokenizer,
)
from mechdiag.tasks import get_task

torch.set_num_threads(1)


def test_deep_asset_is_small_and_has_eight_layers():
    folder = bundled_path("bundled:deep")
    assert folder != bundled_path() and set(BUNDLED_ASSETS) == {"bundled", "bundled:deep"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "base_card.json"} <= {p.name for p in
                                                                                        folder.iterdir()}
    assert sum(p.stat().st_size for p in folder.iterdir()) < 5 * 2**20
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] >= 8


def test_deep_loads_with_the_bundled_tokenizer_and_answers_in_band():
    model, tok = load_model_and_tokenizer("bundled:deep")
    assert model.config.num_hidden_layers >= 8
    assert tok("Q: 3+4\nA: ").input_ids == load_tokenizer("bundled")("Q: 3+4\nA: ").input_ids
    card = json.loads((bundled_path("bundled:deep") / "base_card.json").read_text())
    assert 0.20 <= card["heldout_greedy_accuracy"] <= 0.60
    # the card's figure is the model's: greedy on the first 100 held-out problems lands in the same band
    task = get_task("arith")
    ex = task.examples("test", 100)
    comps = generate(model, tok, [task.prompt(e, tok) for e in ex], 64, do_sample=False, batch_size=100)
    acc = sum(task.correct(c, e) for c, e in zip(comps, ex, strict=True)) / len(ex)
    assert 0.10 <= acc <= 0.70


def test_train_accepts_the_deep_name(cli, tmp_path):
    proc = cli("train", "--set", "model.name_or_path=bundled:deep", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "layers.7." in proc.stdout


def test_deep_name_is_a_model_form_everywhere(cli, tmp_path):
    """`bundled:deep` resolves like `bundled` in displacement, shift and eval (models.checkpoint_folder)."""
    deep = bundled_path("bundled:deep")
    assert checkpoint_folder("bundled:deep") == deep
    proc = cli("displacement", "bundled:deep", str(deep), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert any(r.get("layer") == 7 for r in rows) and all(r["delta_fro"] == 0 for r in rows)
    proc = cli("shift", "bundled:deep", str(deep), "--task", "arith", "--n", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) >= 8
    proc = cli("eval", "bundled:deep", "--task", "arith", "--n", "2", "--k", "1", "--max-new-tokens", "4",
               "--format", "json", "--out", str(tmp_path / "e"))
    assert proc.returncode == 0, proc.stderr
    assert any(r["metric"] == "accuracy" for r in json.loads(proc.stdout))
