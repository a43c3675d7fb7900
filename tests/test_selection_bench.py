"""bench/selection.py at a tiny configuration on the bundled base: every selection trains on the same steps,
random selections match the recommended one's trainable parameters, and the table counts improved pairs."""

from __future__ import annotations

import json

from bench import selection as S
from mechdiag.config import ALL_MODULES


def test_random_selections_match_the_parameter_count():
    n_layers, per = S.site_params("bundled", 16)
    assert n_layers == 3 and set(per) == set(ALL_MODULES)
    assert per["q_proj"] == 16 * (128 + 128) and per["gate_proj"] == 16 * (128 + 384)
    target = S.lora_params([0, 2], ["v_proj", "o_proj"], per)
    exclude = {((0, 2), ("o_proj", "v_proj"))}
    picks = S.random_selections(n_layers, per, target, exclude, 3, seed=0)
    assert len(picks) == 3 and len({(tuple(a), tuple(b)) for a, b in picks}) == 3
    for layers, modules in picks:
        assert S.lora_params(layers, modules, per) == target
        assert (tuple(layers), tuple(sorted(modules))) != ((0, 2), ("o_proj", "v_proj"))


def test_tiny_selection_bench(tmp_path):
    out = tmp_path / "sel"
    result = S.main(["--model", "bundled", "--steps", "1", "--n-random", "1", "--seeds", "42", "--ood-n", "8",
                     "--set", "eval_n=8", "--set", "prompts_per_step=2", "--set", "group_size=2",
                     "--set", "threads=1", "--set", "record.shift_at_eval=false", "--out", str(out)])
    names = [r["selection"] for r in result["table"]]
    assert names == ["uniform", "recommended", "random-1"]
    assert json.loads((out / "selection.json").read_text())["table"][0]["selection"] == "uniform"
    assert (out / "uniform-42" / "attribution.jsonl").exists()  # the recommendation read causal evidence
    for name in names:
        folder = out / f"{name}-42"
        if name == "recommended" and not folder.exists():  # no LoRA rule fired: it is the uniform run
            assert result["table"][1]["params"] == result["table"][0]["params"] and not result["recommend_fired"]
            continue
        assert json.loads((folder / "summary.json").read_text())["steps"] == 1
    uni = result["table"][0]
    assert uni["pairs_improved_vs_uniform"] == 0 and result["pairs"] == 6
    # random draws match the recommended parameter count, or come nearest when only the recommendation itself does
    assert result["table"][2]["params"] == result["table"][1]["params"] or result["table"][1]["params"] == uni[
        "params"]
    for row in result["table"]:
        for key in ("heldout.accuracy", "ood_steps.accuracy", "ood_numbers.accuracy"):
            mean, std = row[key]
            assert 0.0 <= mean <= 1.0 and std == 0.0  # one seed
