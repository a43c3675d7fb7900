"""Issue 26: mixture-of-experts checkpoints (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE with a shared expert), as
transformers saves them (one tensor per expert): displacement by tensor, by module with the experts aggregated
(experts.up_proj) or one module each (--experts), the router its own module, checked against float64 sums of the
saved tensors' differences."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

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
