"""Issue 26: mixture-of-experts checkpoints (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE with a shared expert), as
transformers saves them (one tensor per expert): displacement by tensor, by module with the experts aggregated
(experts.up_proj) or one module each (--experts), the router its own module, checked against float64 sums of the
saved tensors' differences."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mechdiag.cli import main
from tests.tiny_models import MOE, build, save

torch.set_num_threads(1)
F64 = torch.float64
EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|bias)$")


def _cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module", params=MOE)
def moe_pair(request, tmp_path_factory):
    """A base and a fully fine-tuned copy (every tensor moved), as saved by transformers."""
    tmp = tmp_path_factory.mktemp(request.param)
    base = save(build(request.param), tmp / "base")
    sd = load_file(base / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    tuned = {k: (v.double() + 0.01 * (1 + (EXPERT.search(k) is not None)) * torch.randn(v.shape, generator=g,
                                                                                          dtype=F64)).float()
             for k, v in sd.items()}
    (tmp / "tuned").mkdir()
    save_file(tuned, tmp / "tuned" / "model.safetensors", metadata={"format": "pt"})
    (tmp / "tuned" / "config.json").write_text((base / "config.json").read_text())
    return request.param, base, tmp / "tuned", sd, tuned


def _json(*args):
    code, out, err = _cli("displacement", *args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def test_moe_displacement_by_tensor_module_and_expert(moe_pair):
    family, base, tuned_dir, sd, tuned = moe_pair
    diff = {k: float(torch.linalg.vector_norm((tuned[k] - sd[k]).double())) for k in sd}  # float32 difference
    ref = {k: float(torch.linalg.vector_norm(sd[k].double())) for k in sd}

    rows = {r["name"]: r for r in _json(base, tuned_dir)}
    experts = {k: EXPERT.search(k) for k in sd if EXPERT.search(k)}
    assert len({m.group(1) for m in experts.values()}) == 4  # four experts per layer, saved one by one
    for k, m in experts.items():
        r = rows[k]
        assert r["module"] == f"experts.{m.group(2)}" and r["expert"] == int(m.group(1)) and r["layer"] in (0, 1)
        assert r["delta_fro"] == pytest.approx(diff[k], rel=1e-12) and r["ref_fro"] == pytest.approx(ref[k], rel=1e-12)
    router = [k for k in sd if k.endswith("mlp.gate.weight") or k.endswith("block_sparse_moe.gate.weight")]
    assert len(router) == 2 and all(rows[k]["module"] == "gate" and rows[k]["expert"] is None for k in router)
    if family == "qwen2_moe":  # the shared expert is its own module, not folded into the routed ones
        assert rows["model.layers.0.mlp.shared_expert.up_proj.weight"]["module"] == "shared_expert.up_proj"

    # by module, aggregated: sqrt of the sum over both layers and all experts
    want = defaultdict(lambda: [0.0, 0.0])
    for k in sd:
        mod = rows[k]["module"]
        want[mod][0] += diff[k] ** 2
        want[mod][1] += ref[k] ** 2
    by_module = {r["module"]: r for r in _json(base, tuned_dir, "--by", "module")}
    assert set(by_module) == set(want)
    for mod, (d, w) in want.items():
        assert by_module[mod]["delta_fro"] == pytest.approx(math.sqrt(d), rel=1e-9)
        assert by_module[mod]["ref_fro"] == pytest.approx(math.sqrt(w), rel=1e-9)
    total = math.fsum(d for d, _ in want.values())
    down = "experts.w2" if family == "mixtral" else "experts.down_proj"
    assert by_module[down]["update_mass"] == pytest.approx(want[down][0] / total, rel=1e-9)
    assert by_module[down]["n_tensors"] == 2 * 4

    # --experts: each expert its own module, experts.E.down_proj over both layers
    per = {r["module"]: r for r in _json(base, tuned_dir, "--by", "module", "--experts")}
    for e in range(4):
        name = down.replace("experts.", f"experts.{e}.")
        keys = [k for k, m in experts.items() if m.group(1) == str(e) and f"experts.{m.group(2)}" == down]
        assert len(keys) == 2 and per[name]["n_tensors"] == 2
        assert per[name]["delta_fro"] == pytest.approx(math.sqrt(math.fsum(diff[k] ** 2 for k in keys)), rel=1e-9)
    assert down not in per and "gate" in per


def test_moe_spectral_and_layers(moe_pair):
    _, base, tuned_dir, sd, tuned = moe_pair
    rows = {r["name"]: r for r in _json(base, tuned_dir, "--spectral")}
    k = next(k for k in sd if EXPERT.search(k))
    s = torch.linalg.svdvals((tuned[k] - sd[k]).double())
    assert rows[k]["sigma_1"] == pytest.approx(float(s[0]), rel=1e-6)
    by_layer = {r["layer"]: r for r in _json(base, tuned_dir, "--by", "layer")}
    for layer in (0, 1):
        keys = [k for k in sd if f"layers.{layer}." in k]
        d = math.fsum(float(torch.linalg.vector_norm((tuned[k] - sd[k]).double())) ** 2 for k in keys)
        assert by_layer[layer]["delta_fro"] == pytest.approx(math.sqrt(d), rel=1e-9)


def test_lora_on_expert_parameters_is_reported_per_expert_exactly():
    """peft's target_parameters puts LoRA on the 3-D expert stacks (Qwen3MoeExperts.gate_up_proj [E, 2I, H]):
    lora_rows gives each expert's update from the factors, equal to peft's own dense get_delta_weight, named as
    transformers saves experts, with gate/up halves, all aggregated as experts.gate_up_proj."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - peft's own config, not mechdiag's

    from mechdiag.displacement import group_wdisp, lora_rows  # noqa: PLC0415

    torch.manual_seed(0)
    model = get_peft_model(build("qwen3_moe"), LoraConfig(r=2, lora_alpha=4, target_modules=[],
                                                          target_parameters=["experts.gate_up_proj",
                                                                             "experts.down_proj"],
                                                          init_lora_weights=False))
    rows = lora_rows(model, geometry=True)
    by_name = {r["name"]: r for r in rows}
    checked = 0
    for path, mod in model.named_modules():
        if not hasattr(mod, "get_delta_weight") or not hasattr(mod, "num_experts"):
            continue
        with torch.no_grad():
            peft_delta = mod.get_delta_weight("default").double()  # peft's own, in float32: [E, ...] as stored
            param = mod.get_param().double()
            E = param.shape[0]
            A = mod.lora_A["default"].weight.double().reshape(E, -1, param.shape[-1] if mod._did_swap_in_out_features
                                                               else param.shape[-2])
            B = mod.lora_B["default"].weight.double()
            B = B.reshape(B.shape[0], -1, E)
            spec = "o r e, e r i -> e o i" if mod._did_swap_in_out_features else "o r e, e r i -> e i o"
            delta = torch.einsum(spec, B, A) * mod.scaling["default"]  # the same product in float64
        assert delta.shape == param.shape
        assert torch.allclose(delta, peft_delta, rtol=1e-5, atol=1e-7)
        prefix = path.removeprefix("base_model.model.").replace(".base_layer", "")  # peft nests the wrappers
        for e in range(param.shape[0]):
            r = by_name[f"{prefix}.{e}.{mod.parameter_name}.weight"]
            assert r["module"] == f"experts.{mod.parameter_name}" and r["expert"] == e and r["layer"] in (0, 1)
            assert r["delta_fro"] == pytest.approx(float(delta[e].norm()), rel=1e-9)
            assert r["ref_fro"] == pytest.approx(float(param[e].norm()), rel=1e-6)
            assert 0 <= r["subspace_overlap"] <= 1
            if mod.parameter_name == "gate_up_proj":  # Qwen3MoeExperts: gate, up = linear(x, W[e]).chunk(2, -1)
                for part, half in zip(("gate", "up"), delta[e].chunk(2, dim=0), strict=True):
                    p = by_name[f"{prefix}.{e}.gate_up_proj.weight[{part}]"]
                    assert p["delta_fro"] == pytest.approx(float(half.norm()), rel=1e-9)
                    assert p["part_of"] == "experts.gate_up_proj"
            checked += 1
    assert checked == 2 * 2 * 4  # layers x stacks x experts
    assert not [r["name"] for r in rows if "base_layer" in r["name"]]  # named as transformers saves experts
    g = group_wdisp(pd.DataFrame(rows), "module").set_index("module")
    want = math.sqrt(math.fsum(r["delta_fro"] ** 2 for r in rows if r["module"] == "experts.down_proj"))
    assert g.loc["experts.down_proj", "delta_fro"] == pytest.approx(want, rel=1e-12)
    assert g.loc["experts.down_proj", "n_tensors"] == 8


def _merged_truth(merged: dict[str, torch.Tensor], original: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The merged model's update of a tensor as transformers saves it: an expert's gate_proj / up_proj / down_proj
    is its row of the 3-D stack (gate_up_proj: gate rows, then up rows)."""
    m = EXPERT.search(name)
    if m is None:
        return merged[name] - original[name]
    stack = name[:m.start()] + ".experts." + ("down_proj" if m.group(2) == "down_proj" else "gate_up_proj")
    d = (merged[stack] - original[stack])[int(m.group(1))]
    return d if m.group(2) == "down_proj" else d.chunk(2, dim=0)[m.group(2) == "up_proj"]


def test_users_peft_lora_on_a_name_shared_by_a_linear_and_an_expert_stack(tmp_path):
    """A user's peft LoRA with target_modules down_proj on Qwen2-MoE: the shared expert's down_proj is a Linear,
    the routed experts' stack a parameter of the same name; peft >= 0.22 adapts both and saves a bare "down_proj"
    in target_parameters. displacement reads each as what it is, equal to peft's merge in float64."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - peft's own config, not mechdiag's

    from mechdiag.displacement import displacement  # noqa: PLC0415

    base = save(build("qwen2_moe"), tmp_path / "base")
    original = {n: p.detach().double().clone() for n, p in build("qwen2_moe").named_parameters()}
    pm = get_peft_model(build("qwen2_moe"), LoraConfig(r=2, target_modules=["q_proj", "down_proj"],
                                                       init_lora_weights=False))
    pm.save_pretrained(tmp_path / "adapter")
    merged = {n: p.detach().clone() for n, p in pm.double().merge_and_unload().named_parameters()}
    rows = [r for r in displacement(str(base), str(tmp_path / "adapter")).to_dict(orient="records")
            if not isinstance(r["part_of"], str)]
    moved = set()
    for r in rows:
        want = float(_merged_truth(merged, original, r["name"]).norm())
        assert r["delta_fro"] == pytest.approx(want, rel=1e-9, abs=1e-12), r["name"]
        if want:
            moved.add(r["module"])
    assert {"q_proj", "shared_expert.down_proj"} <= moved  # the Linears moved, and were read as Linears
    assert moved <= {"q_proj", "shared_expert.down_proj", "experts.down_proj"}


def test_native_lora_on_chosen_layers_adapts_only_them(tmp_path):
    """mechdiag's own LoRA on layer 0 of Qwen2-MoE with down_proj and experts.down_proj adapts exactly layer 0's
    shared-expert Linear and expert stack, whatever peft's version reads into a bare name."""
    from mechdiag.config import LoraConfig  # noqa: PLC0415
    from mechdiag.train.lora import apply_lora, lora_modules  # noqa: PLC0415

    for modules, want in ((["down_proj"], {"model.layers.0.mlp.shared_expert.down_proj"}),
                          (["down_proj", "experts.down_proj"], {"model.layers.0.mlp.shared_expert.down_proj",
                                                                "model.layers.0.mlp.experts.down_proj"})):
        pm = apply_lora(build("qwen2_moe"), LoraConfig(layers=[0], target_modules=modules))
        assert {m["name"] for m in lora_modules(pm)} == want
