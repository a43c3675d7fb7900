"""Issue 26: fused modules as logical parts (Phi-3 qkv_proj / gate_up_proj, NeoX query_key_value, GPT-2 c_attn),
computed from the LoRA factors and from dense checkpoints, checked against the dense float64 delta sliced as each
family's modeling code slices its output; recommend's text in the family's own names."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from mechdiag import config as configlib
from mechdiag import recommend as R
from mechdiag.config import LoraConfig
from mechdiag.displacement import compare, group_wdisp, lora_rows, rows_frame
from mechdiag.metrics import update_mass, wdisp
from mechdiag.report.heatmap import displacement_grid
from mechdiag.run import RunDir, load_runs
from mechdiag.train.lora import apply_lora
from tests.synth import write_run
from tests.tiny_models import build, family_config, save

torch.set_num_threads(1)
F64 = torch.float64
FUSED = {"phi3": ["qkv_proj", "gate_up_proj"], "neox": ["query_key_value"], "gpt2": ["c_attn"]}


def _slices(family: str, module: str, out_first: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each part of a fused output, sliced as transformers' modeling code does (out_first: out x ...)."""
    cfg = family_config(family)
    if module == "gate_up_proj":  # Phi3MLP: gate, up_states = up_states.chunk(2, dim=-1)
        return dict(zip(("gate", "up"), out_first.chunk(2, dim=0), strict=True))
    if module == "qkv_proj":  # Phi3Attention: q = [:query_pos], k = next kv*head_dim, v = the rest
        hd = cfg.hidden_size // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        return {"q": out_first[:q], "k": out_first[q:q + kv], "v": out_first[q + kv:]}
    if module == "query_key_value":  # GPTNeoXAttention: view(..., heads, 3 * head_size).chunk(3, dim=-1)
        heads = cfg.num_attention_heads
        v = out_first.reshape(heads, 3 * (cfg.hidden_size // heads), *out_first.shape[1:])
        return {p: c.reshape(-1, *out_first.shape[1:]) for p, c in zip("qkv", v.chunk(3, dim=1), strict=True)}
    if module == "c_attn":  # GPT2Attention: c_attn(x).split(split_size, dim=2)
        return dict(zip("qkv", out_first.split(cfg.n_embd, dim=0), strict=True))
    raise ValueError(module)


def _tuned(family):
    peft_model = apply_lora(build(family), LoraConfig(r=2, alpha=4))
    torch.manual_seed(1)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.data.normal_()
    return peft_model.eval()


def _out_first(w: torch.Tensor, family: str) -> torch.Tensor:
    return w.T if family == "gpt2" and w.ndim == 2 else w  # Conv1D stores in x out


@pytest.mark.parametrize("family", sorted(FUSED))
def test_lora_parts_from_factors_equal_the_sliced_product(family):
    peft_model = _tuned(family)
    rows = lora_rows(peft_model, geometry=True)
    parts = {r["name"]: r for r in rows if r.get("part_of")}
    seen = set()
    for name, mod in peft_model.named_modules():
        module = name.rsplit(".", 1)[-1]
        if module not in FUSED[family] or not hasattr(mod, "lora_A"):
            continue
        w = mod.get_base_layer().weight.detach().double()
        delta = mod.scaling["default"] * (mod.lora_B["default"].weight.double() @ mod.lora_A["default"].weight.double())
        delta = delta.detach()  # out x in, whatever the storage
        base = _slices(family, module, _out_first(w, family))
        for part, d in _slices(family, module, delta).items():
            row = parts[name.removeprefix("base_model.model.") + f".weight[{part}]"]
            assert row["module"] == f"{module}.{part}" and row["part_of"] == module
            assert row["delta_fro"] == pytest.approx(float(d.norm()), rel=1e-9)
            assert row["ref_fro"] == pytest.approx(float(base[part].norm()), rel=1e-6)
            assert row["overlap_k"] == 2 and 0 <= row["subspace_overlap"] <= 1
            seen.add(part)
    assert seen == ({"q", "k", "v", "gate", "up"} if family == "phi3" else {"q", "k", "v"})
    # the parts of a fused tensor hold its whole squared update: q + k + v = qkv exactly
    whole = {r["name"]: r for r in rows if not r.get("part_of")}
    for wname, w in whole.items():
        mine = [r for r in parts.values() if r["name"].startswith(wname + "[")]
        if mine:
            assert math.fsum(r["delta_fro"] ** 2 for r in mine) == pytest.approx(w["delta_fro"] ** 2, rel=1e-12)
    # update mass: parts are shares of the whole-tensor total, never counted twice
    mass = update_mass(rows, "module")
    assert all("." not in m or m in ("attn.c_proj", "mlp.c_proj") for m in mass)
    with_parts = update_mass(rows, "module", parts=True)
    assert math.fsum(v for k, v in with_parts.items() if k in mass) == pytest.approx(1.0)
    fused = FUSED[family][0]
    assert math.fsum(v for k, v in with_parts.items() if k.startswith(fused + ".")) == \
        pytest.approx(with_parts[fused], rel=1e-12)


@pytest.mark.parametrize("family", sorted(FUSED))
def test_checkpoint_parts_adapter_and_full_finetune(tmp_path, family):
    """compare() on a saved adapter (factors) and on a dense fine-tuned checkpoint (streamed) gives each part's
    norms of the float64 difference, sliced as the modeling code slices."""
    base = save(build(family), tmp_path / "base")
    peft_model = _tuned(family)
    peft_model.save_pretrained(tmp_path / "adapter")
    sd = load_file(base / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    tuned = {k: (v.double() + 0.01 * torch.randn(v.shape, generator=g, dtype=F64)).float() for k, v in sd.items()}
    (tmp_path / "full").mkdir()
    save_file(tuned, tmp_path / "full" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "full" / "config.json").write_text((base / "config.json").read_text())

    adapter = {r["name"]: r for r in compare(base, tmp_path / "adapter", spectral=True)}
    full = {r["name"]: r for r in compare(base, tmp_path / "full")}
    lora = {name.removeprefix("base_model.model."): mod for name, mod in peft_model.named_modules()
            if hasattr(mod, "lora_A") and hasattr(mod, "get_base_layer")}
    checked = 0
    for key, w in sd.items():
        module = key.split(".")[-2]
        if module not in FUSED[family]:
            continue
        ref = _slices(family, module, _out_first(w.double(), family))
        moved = _slices(family, module, _out_first((tuned[key] - w).double(), family))  # float32 difference
        for part in ref:
            row = full[f"{key}[{part}]"]
            assert row["delta_fro"] == pytest.approx(float(moved[part].norm()), rel=1e-9)
            assert row["ref_fro"] == pytest.approx(float(ref[part].norm()), rel=1e-9)
            assert row["frac_unchanged"] == 0.0 and row["module"] == f"{module}.{part}"
        mod = lora.get(key.removesuffix(".weight"))
        if mod is None or not key.endswith(".weight"):
            continue
        d = mod.scaling["default"] * (mod.lora_B["default"].weight.double() @ mod.lora_A["default"].weight.double())
        for part, dp in _slices(family, module, d.detach()).items():
            row = adapter[f"{key}[{part}]"]
            assert row["delta_fro"] == pytest.approx(float(dp.norm()), rel=1e-9)
            s = torch.linalg.svdvals(dp)
            assert row["sigma_1"] == pytest.approx(float(s[0]), rel=1e-9)
            checked += 1
    assert checked == 2 * 3 * len(FUSED[family]) - (2 if family == "phi3" else 0)  # gate_up: 2 parts

    # grouped: layers and the whole model count each fused tensor once; modules list its parts
    df = rows_frame(list(full.values()))
    whole = df[df["part_of"].isna()]
    by_layer, by_all = group_wdisp(df, "layer"), group_wdisp(df, "all")
    assert by_layer["delta_fro"].tolist() == pytest.approx(group_wdisp(whole, "layer")["delta_fro"].tolist())
    assert by_all["delta_fro"].iloc[0] == pytest.approx(math.sqrt((whole["delta_fro"] ** 2).sum()))
    by_module = group_wdisp(df, "module").set_index("module")
    fused = FUSED[family][0]
    assert {f"{fused}.q", f"{fused}.k", f"{fused}.v"} <= set(by_module.index) if fused != "gate_up_proj" else True
    whole_mass = by_module.loc[[m for m in by_module.index if m not in set(df["module"][df["part_of"].notna()])]]
    assert whole_mass["update_mass"].sum() == pytest.approx(1.0)


def test_recommend_speaks_the_family_names_of_fused_parts(tmp_path):
    """Phi-3 has no v_proj: the study's module set is qkv_proj.v + o_proj there, and the refined targets stay
    modules peft can adapt (qkv_proj, o_proj), not their parts."""

    phi3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    cfg = configlib.load(overrides=["beta=0.005", "learning_rate=2e-3", f"lora.target_modules=[{','.join(phi3)}]"])
    path = tmp_path / "run"
    write_run(path, cfg, module_mass={"qkv_proj": 8.0, "o_proj": 8.0, "gate_up_proj": 1.0, "down_proj": 1.0},
              reward=(1.5, 1.6), kl=0.01)
    rd = RunDir(path)
    last = max(r["step"] for r in rd.read("displacement"))
    parts = [{**r, "name": f"{r['name']}[{p}]", "module": f"qkv_proj.{p}", "part_of": "qkv_proj",
              "delta_fro": r["delta_fro"] / 3 ** 0.5} for r in rd.read("displacement")
             if r["module"] == "qkv_proj" and r["step"] == last for p in "qkv"]
    rd.append("displacement", parts)
    r = R.recommend(load_runs([path]))
    f = next(f for f in r.findings if f.rule == "reduced_modules")
    assert "study: qkv_proj.v + o_proj" in f.reason and " v_proj" not in f.reason
    assert sorted(next(c.new for c in r.changes if c.key == "lora.target_modules")) == ["o_proj", "qkv_proj"]


def test_heatmap_has_a_column_per_part(tmp_path):
    base = save(build("phi3"), tmp_path / "base")
    peft_model = _tuned("phi3")
    peft_model.save_pretrained(tmp_path / "adapter")
    df = rows_frame(compare(base, tmp_path / "adapter"))
    grid = displacement_grid(df)
    assert {"qkv_proj", "qkv_proj.q", "qkv_proj.k", "qkv_proj.v", "gate_up_proj.gate", "gate_up_proj.up"} <= \
        set(grid.columns)
    row = df[(df["module"] == "qkv_proj.v") & (df["layer"] == 1)].iloc[0]
    expected = wdisp(row["delta_fro"] ** 2, row["ref_fro"] ** 2)  # the study's WDisp, delta_w included
    assert grid.loc["1", "qkv_proj.v"] == pytest.approx(expected, rel=1e-12)
