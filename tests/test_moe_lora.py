"""Issue 26, MoE under LoRA: `mechdiag train` (native and TRL) puts LoRA on transformers 5's 3-D expert stacks
and the router (peft's target_parameters) beside attention; the merged sampler decodes what the peft model does;
the trainer's records and `mechdiag displacement` of the saved adapter (on the base as transformers saves it, one
tensor per expert, or as 3-D stacks) equal the factors multiplied out in float64 in peft's layout
(tests.tiny_models.adapter_deltas)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from mechdiag import config as C
from mechdiag.cli import main
from mechdiag.integrations.trl_args import lora_targets
from mechdiag.run import RunDir
from mechdiag.train.lora import apply_lora, default_targets, merge_into
from tests.tiny_models import adapter_deltas, build, family_folder

torch.set_num_threads(1)
SMALL = ["task.name=tests.toy:Toy", "group_size=2", "prompts_per_step=2", "max_completion_tokens=6",
         "max_prompt_tokens=64", "eval_n=2", "threads=1", "learning_rate=0.05", "record.shift_n=1",
         "record.displacement_every=1", "lora.r=2", "lora.alpha=4", "max_time_s=null", "eval_every=100"]
TARGETS = "lora.target_modules=[q_proj,v_proj,experts.gate_up_proj,experts.down_proj,gate]"
FAMILIES = ("qwen3_moe", "mixtral")  # both 3-D stacks in memory; saved per expert (Mixtral: block_sparse_moe w1..3)


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def _sets(*items):
    return [x for s in items for x in ("--set", s)]


def _train(folder, out, backend="native", *extra):
    code, _, err = cli("train", "--backend", backend, "--out", out, "--max-steps", "2",
                       *_sets(f"model.name_or_path={folder}", *SMALL, *extra))
    assert code == 0, err[-3000:]
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    folder = family_folder(request.param, tmp / "model")
    run = _train(folder, tmp / "native", "native", TARGETS)
    base = AutoModelForCausalLM.from_pretrained(folder)
    return request.param, folder, run, adapter_deltas(run / "final", base), base, tmp


def _last(run):
    recs = RunDir(run).read("displacement")
    last = max(r["step"] for r in recs)
    return {r["name"]: r for r in recs if r["step"] == last}


def _json(*args):
    code, out, err = cli("displacement", *args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def _check_rows(rows, deltas):
    """Every adapted weight's row (and an expert's gate / up halves) equals the float64 product."""
    for name, (d, w) in deltas.items():
        r = rows[name]
        assert r["delta_fro"] == pytest.approx(float(d.norm()), rel=1e-9), name
        assert r["ref_fro"] == pytest.approx(float(w.norm()), rel=1e-9), name
        if ".experts." in name:
            e = int(name.split(".experts.")[1].split(".")[0])
            assert r["expert"] == e and r["module"] == "experts." + name.rsplit(".", 2)[1]
        if name.endswith("gate_up_proj.weight"):
            for part, half in zip(("gate", "up"), d.chunk(2, dim=0), strict=True):
                p = rows[f"{name}[{part}]"]
                assert p["delta_fro"] == pytest.approx(float(half.norm()), rel=1e-9)
                assert p["part_of"] == "experts.gate_up_proj" and p["module"] == f"experts.gate_up_proj.{part}"


def test_train_puts_lora_on_experts_and_router_and_records_them_exactly(trained):
    family, folder, run, deltas, _, _ = trained
    cfg = json.loads((run / "final" / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == {"q_proj", "v_proj"}
    assert {t.split("layers.", 1)[1] for t in cfg["target_parameters"]} == {
        f"{layer}.mlp.{p}" for layer in (0, 1) for p in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")}
    # read back (a foreign run's adapter, a TRL script's LoraConfig) as the names we train
    assert lora_targets(cfg["target_modules"], cfg["target_parameters"]) == [
        "q_proj", "v_proj", "experts.down_proj", "experts.gate_up_proj", "gate"]
    assert sum(".experts." in n for n in deltas) == 2 * 2 * 4  # layers x stacks x experts
    assert all(float(d.norm()) > 0 for d, _ in deltas.values())  # two steps moved every factor pair
    rows = _last(run)
    _check_rows(rows, deltas)
    router = rows["model.layers.0.mlp.gate.weight"]
    assert router["module"] == "gate" and router["expert"] is None
    assert {n for n, r in rows.items() if not r.get("part_of")} == set(deltas)


def test_displacement_of_the_adapter_equals_the_product_and_the_records(trained):
    family, folder, run, deltas, _, _ = trained
    rows = {r["name"]: r for r in _json(folder, run, "--spectral")}
    _check_rows(rows, deltas)
    records = _last(run)
    for name, rec in records.items():  # the trainer's last step is the saved adapter, row for row
        assert rows[name]["delta_fro"] == pytest.approx(rec["delta_fro"], rel=1e-9), name
        assert rows[name]["ref_fro"] == pytest.approx(rec["ref_fro"], rel=1e-9), name
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert rows[name]["sigma_1"] == pytest.approx(float(torch.linalg.svdvals(deltas[name][0])[0]), rel=1e-6)
    moved = {n for n, r in rows.items() if r["delta_fro"] > 0 and not r.get("part_of")}
    assert moved == set(deltas)

    by_module = {g["module"]: g for g in _json(folder, run, "--by", "module")}
    for module in ("experts.gate_up_proj", "experts.down_proj"):
        mine = [d for n, (d, _) in deltas.items() if n.endswith(module.split(".")[1] + ".weight")]
        assert len(mine) == 8 and by_module[module]["n_tensors"] == 8
        assert by_module[module]["delta_fro"] == pytest.approx(math.sqrt(math.fsum(float(d.norm()) ** 2
                                                                                   for d in mine)), rel=1e-9)
    assert by_module["gate"]["n_tensors"] == 2 and "experts.gate_proj" not in by_module
    per = {g["module"]: g for g in _json(folder, run, "--by", "module", "--experts")}
    for e in range(4):
        mine = [d for n, (d, _) in deltas.items() if f".experts.{e}.gate_up_proj." in n + "."]
        assert len(mine) == 2 and per[f"experts.{e}.gate_up_proj"]["n_tensors"] == 2
        assert per[f"experts.{e}.gate_up_proj"]["delta_fro"] == pytest.approx(
            math.sqrt(math.fsum(float(d.norm()) ** 2 for d in mine)), rel=1e-9)
        assert f"experts.{e}.gate_up_proj.gate" in per
    assert "experts.gate_up_proj" not in per


def test_displacement_on_a_base_saved_as_3d_stacks(trained):
    """The same base saved as transformers 5 holds it in memory (mlp.experts.gate_up_proj [E, 2I, H]): each
    expert's slice of the stack is its row, with the same numbers."""
    family, folder, run, deltas, base, tmp = trained
    stacked = tmp / "stacked"
    base.save_pretrained(stacked, save_original_format=False)
    from safetensors import safe_open  # noqa: PLC0415 - only to show what the folder holds

    with safe_open(stacked / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    rows = {r["name"]: r for r in _json(stacked, run, "--base", stacked)}
    _check_rows(rows, deltas)


def test_merged_sampler_decodes_as_the_peft_model():
    for family in FAMILIES:
        model = build(family)
        plain = copy.deepcopy(model)
        assert {"experts.gate_up_proj", "experts.down_proj"} <= set(default_targets(model))
        assert "gate" not in default_targets(model)  # all-linear leaves a TopKRouter out
        peft_model = apply_lora(model, C.LoraConfig(r=2, alpha=4, target_modules=[
            "q_proj", "experts.gate_up_proj", "experts.down_proj", "gate"]))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        merge_into(peft_model, plain)
        ids = torch.randint(0, 64, (2, 7), generator=g)
        with torch.no_grad():
            want, got, before = peft_model(ids).logits, plain(ids).logits, build(family)(ids).logits
        assert (want - before).abs().max() > 1e-2  # the adapter changes the logits ...
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # ... and the merged copy by as much


def test_trl_backend_trains_expert_lora(tmp_path):
    folder = family_folder("qwen3_moe", tmp_path / "model")
    run = _train(folder, tmp_path / "trl", "trl", TARGETS)
    assert RunDir(run).summary()["steps"] == 2
    deltas = adapter_deltas(run / "final", AutoModelForCausalLM.from_pretrained(folder))
    assert sum(".experts." in n for n in deltas) == 16 and "model.layers.1.mlp.gate.weight" in deltas
    _check_rows(_last(run), deltas)


def test_expert_targets_bad_input_is_one_line(tmp_path):
    folder = family_folder("qwen3_moe", tmp_path / "model")
    for extra, want in ((["lora.target_modules=[experts.nope]"], "experts.gate_up_proj"),
                        ([TARGETS, "lora.dropout=0.1"], "lora.dropout=0")):
        code, _, err = cli("train", "--out", tmp_path / "bad", "--max-steps", "1",
                           *_sets(f"model.name_or_path={folder}", *SMALL, *extra))
        assert code == 2 and want in err and len(err.strip().splitlines()) == 1, err


def test_attribute_ablates_the_expert_adapters(trained):
    """attribute zeroes each site's lora_B: the expert stacks and the router are sites, so with every site off the
    model it evaluates is the base, and with the experts alone on, their update is all that moved."""
    from mechdiag.attribute import Attribution  # noqa: PLC0415 - loads the run's model

    family, folder, run, deltas, base, _ = trained
    att = Attribution(run, n=1)
    experts = [n for n in att.sites if ".experts." in n]
    assert len(experts) == 4 and "model.layers.0.mlp.gate.weight" in att.sites
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(ids).logits
        att.keep([])
        torch.testing.assert_close(att.eval_model()(ids).logits, want, rtol=0, atol=1e-5)
        att.keep(experts)
        assert (att.eval_model()(ids).logits - want).abs().max() > 1e-4
        att.keep(att.sites)
