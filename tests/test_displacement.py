"""Weight displacement: planted deltas are found exactly, LoRA factors give the materialised numbers, grouped WDisp
follows the study's formula, the CLI keeps its contract, and the trainer's lora_rows equals the checkpoint path."""

from __future__ import annotations

import io
import json
import math
import shutil

import pandas as pd
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mechdiag.displacement
from mechdiag.displacement import displacement as disp
from mechdiag.displacement import group_wdisp, lora_rows
from mechdiag.errors import UserError
from tests.helpers import assert_bad_input
from tests.tiny_models import FAMILIES, build, save

torch.set_num_threads(1)
F64 = torch.float64


def _write(folder, state, config_from=None):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    if config_from is not None:
        shutil.copy(config_from / "config.json", folder / "config.json")
    return folder


def _state(folder):
    return load_file(folder / "model.safetensors")


def _rel(x, y):
    return abs(x - y) / max(abs(y), 1e-30)


# --- planted deltas ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_planted_deltas_are_found_exactly(tmp_path, family):
    a = save(build(family), tmp_path / "a")
    sd = _state(a)
    names = sorted(sd)
    mat = next(n for n in names if sd[n].ndim == 2 and ".1." in n)  # a block matrix of layer 1
    vec = next(n for n in names if sd[n].ndim == 1)  # a norm or bias
    g = torch.Generator().manual_seed(1)
    planted = {}
    for n in (mat, vec):
        new = (sd[n].double() + 0.01 * torch.randn(sd[n].shape, generator=g, dtype=F64)).float()
        planted[n] = (torch.linalg.vector_norm(new.double() - sd[n].double()).item(),
                      torch.linalg.vector_norm(sd[n].double()).item())
        sd[n] = new
    b = _write(tmp_path / "b", sd, config_from=a)
    df = disp(a, b)
    df = df[df.part_of.isna()]  # a fused tensor's parts: tests/test_parts.py
    assert set(df.loc[df.delta_fro > 0, "name"]) == set(planted)
    for n, (dn, rn) in planted.items():
        row = df.set_index("name").loc[n]
        assert _rel(row.delta_fro, dn) < 1e-6 and _rel(row.ref_fro, rn) < 1e-6
        assert _rel(row.rel_fro, dn / rn) < 1e-6 if rn > 0 else row.rel_fro == math.inf  # Gemma norms start at 0
        assert row.frac_unchanged == 0.0
    assert (df.loc[df.delta_fro == 0, "frac_unchanged"] == 1.0).all()
    assert df["layer"].dropna().between(0, 1).all()


def test_grouped_wdisp_is_the_study_formula(tmp_path):
    a = save(build("llama"), tmp_path / "a")
    sd = _state(a)
    for n in sd:
        if n.endswith(("q_proj.weight", "down_proj.weight")):
            sd[n] = sd[n] * (1.1 if ".0." in n else 0.7)
    b = _write(tmp_path / "b", sd, config_from=a)
    rows = disp(a, b)
    for by in ("module", "layer"):
        g = group_wdisp(rows, by=by)
        for _, r in g.iterrows():
            sel = rows[rows[by].isna()] if pd.isna(r[by]) else rows[rows[by] == r[by]]
            expect = math.sqrt((sel.delta_fro ** 2).sum()) / math.sqrt((sel.ref_fro ** 2).sum() + 1e-12)
            assert _rel(r.wdisp, expect) < 1e-12 or (expect == 0 and r.wdisp == 0)
        assert abs(g.update_mass.sum() - 1.0) < 1e-12
    mass = group_wdisp(rows, by="module").set_index("module")["update_mass"]
    assert set(mass[mass > 0].index) == {"q_proj", "down_proj"}
    one = group_wdisp(rows, by="all")
    overall = math.sqrt((rows.delta_fro ** 2).sum() / (rows.ref_fro ** 2).sum())
    assert len(one) == 1 and _rel(one.wdisp[0], overall) < 1e-9
    assert mechdiag.displacement.displacement(a, b, by="module").equals(group_wdisp(rows, by="module"))


def test_group_functions_on_jsonl_rows_group_per_step():
    rows = pd.DataFrame([
        {"step": s, "name": f"model.layers.{l}.self_attn.{m}.weight", "layer": l, "module": m, "ref_fro": 2.0,
         "delta_fro": float(s * (1 + l) * (2 if m == "v_proj" else 1)), "rel_fro": 0.0}
        for s in (1, 2) for l in (0, 1) for m in ("q_proj", "v_proj")])
    mass = group_wdisp(rows, by="module")
    for s in (1, 2):
        m = mass[mass.step == s].set_index("module")["update_mass"]
        assert m["v_proj"] == pytest.approx(0.8) and m["q_proj"] == pytest.approx(0.2)
    by_layer = group_wdisp(rows, by="layer")
    r = by_layer[(by_layer.step == 2) & (by_layer.layer == 1)].iloc[0]
    assert r.wdisp == pytest.approx(math.sqrt(4 ** 2 + 8 ** 2) / math.sqrt(8 + 1e-12))


def test_stories260k_against_perturbed_copy(tmp_path, stories260k):
    sd = _state(stories260k)
    g = torch.Generator().manual_seed(0)
    expected = {}
    for n in sd:
        if n.endswith(("v_proj.weight", "o_proj.weight")):
            new = sd[n] + 1e-3 * torch.randn(sd[n].shape, generator=g)
            expected[n] = torch.linalg.vector_norm(new.double() - sd[n].double()).item()
            sd[n] = new
    b = _write(tmp_path / "b", sd, config_from=stories260k)
    df = disp(stories260k, b).set_index("name")
    assert "lm_head.weight" not in df.index  # tied: counted once, as the embedding
    assert len(df) == 47
    for n, dn in expected.items():
        assert _rel(df.loc[n, "delta_fro"], dn) < 1e-6
    assert (df.drop(index=list(expected))["delta_fro"] == 0).all()
    mods = group_wdisp(df.reset_index(), by="module").set_index("module")
    assert set(mods.index[mods.wdisp > 0]) == {"v_proj", "o_proj"}


def test_sharded_checkpoint_gives_same_rows(tmp_path):
    m = build("qwen2")
    a = save(m, tmp_path / "a")
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight.mul_(1.5)
        m.model.layers[0].self_attn.q_proj.bias.add_(0.25)
    b1 = save(m, tmp_path / "b1")
    b2 = save(m, tmp_path / "b2", max_shard_size="8KB")
    assert len(list(b2.glob("model-*-of-*.safetensors"))) >= 2
    r1, r2 = disp(a, b1), disp(a, b2)
    pd.testing.assert_frame_equal(r1, r2)
    assert (r1.delta_fro > 0).sum() == 2


def test_sub_ulp_changes_counted_apart_from_unchanged(tmp_path):
    a = save(build("llama"), tmp_path / "a")
    sd = _state(a)
    n = "model.layers.0.mlp.gate_proj.weight"
    w = sd[n].clone().view(-1)
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w)[1] - 8)  # one bf16 ULP at |w| in [2^(e-1), 2^e)
    w[:10] += ulp[:10] / 4  # below one bf16 ULP
    w[10:25] += 1.0  # real changes
    sd[n] = w.view_as(sd[n])
    b = _write(tmp_path / "b", sd, config_from=a)
    row = disp(a, b).set_index("name").loc[n]
    numel = w.numel()
    assert row.frac_sub_ulp == pytest.approx(10 / numel) and row.frac_unchanged == pytest.approx((numel - 25) / numel)


def _counts_f64(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """frac_unchanged, frac_sub_ulp from the definitions, in float64: one bf16 ULP of w is 2^(floor(log2|w|) - 7),
    with floor(log2|w|) taken as -126 for zero and subnormal w."""
    a64, b64 = a.to(F64).reshape(-1), b.to(F64).reshape(-1)
    d = (b64 - a64).abs()
    e = torch.frexp(a64)[1] - 1
    e = torch.where(a64 == 0, torch.full_like(e, -126), e.clamp_min(-126))
    ulp = torch.ldexp(torch.ones_like(a64), e - 7)
    unchanged = d == 0
    return unchanged.double().mean().item(), ((d < ulp) & ~unchanged).double().mean().item()


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_change_counts_match_float64_definition(tmp_path, dtypes, monkeypatch):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 96, generator=g) * 0.02
    w.view(-1)[:64] = torch.ldexp(torch.ones(64), torch.arange(-70, -6).repeat(1)[:64])  # powers of two
    w.view(-1)[64:80] = 0.0
    w.view(-1)[80:96] = torch.tensor([2.0 ** -130, -(2.0 ** -140), 2.0 ** -149, 1e-39] * 4)  # f32 subnormals
    w.view(-1)[96:100] = torch.tensor([2.0 ** -126, -(2.0 ** -126), 2.0 ** -125, 2.0 ** -120])
    a = w.to(dtypes[0])
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(a.float())[1] - 8)
    step = torch.randint(-3, 4, w.shape, generator=g).float() * 0.25 * ulp  # multiples of a quarter ULP
    b = (a.float() + step)
    b.view(-1)[:64] = a.float().view(-1)[:64] * (1 - 2.0 ** -9)  # just below a power of two: sub-ULP in bf16
    b.view(-1)[64:68] = -0.0  # +0 -> -0: unchanged
    b.view(-1)[68:72] = 2.0 ** -140  # zero -> subnormal: below one ULP (2^-133)
    b.view(-1)[72:76] = 2.0 ** -133  # exactly one ULP of a zero weight: not below
    b.view(-1)[100:116] = -a.float().view(-1)[100:116]  # sign flips
    b.view(-1)[116:120] = a.float().view(-1)[116:120] + 2.0 ** -145  # sub-ULP on ordinary weights
    b = b.to(dtypes[1])
    n = "model.layers.0.mlp.up_proj.weight"
    save_file({n: a.contiguous()}, tmp_path / "a.safetensors")
    save_file({n: b.contiguous()}, tmp_path / "b.safetensors")
    want_unchanged, want_sub_ulp = _counts_f64(a, b)
    assert 0 < want_unchanged < 1 and want_sub_ulp > 0
    # the C kernel, then the torch path in one chunk and in chunks that split rows unevenly
    for kernel, chunk in (("1", None), ("0", None), ("0", 1000)):
        monkeypatch.setenv("MECHDIAG_KERNEL", kernel)
        row = mechdiag.displacement.tensor_row(*_one_tensor_files(tmp_path, n), chunk_elems=chunk)
        assert row["frac_unchanged"] == want_unchanged and row["frac_sub_ulp"] == want_sub_ulp
        d64 = b.to(F64) - a.to(F64)
        # squares are exact in float64 on both paths; b - a is rounded to float32 when a has more bits than b
        tol = 1e-6 if dtypes == (torch.float32, torch.bfloat16) else 1e-12
        assert _rel(row["delta_fro"], d64.norm().item()) < tol
        assert _rel(row["ref_fro"], a.to(F64).norm().item()) < 1e-12


def test_fused_kernel_is_built():
    """The C kernel ships with the package (setup.py); a build without a compiler would silently run 5x slower."""
    assert mechdiag.displacement._diffkernel is not None, "mechdiag._diffkernel not built: install needs a C compiler"
    assert mechdiag.displacement.kernel_enabled() or mechdiag.displacement.os.environ.get("MECHDIAG_KERNEL") == "0"


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float16)])
@pytest.mark.parametrize("numel", [1, 7, 8, 4095, 4096 * 3 + 13])
@pytest.mark.parametrize("poison", [None, math.nan, math.inf])
def test_fused_kernel_equals_torch_path(tmp_path, monkeypatch, dtypes, numel, poison):
    """Every length (vector tails, block edges), dtype pair (float16 has no kernel: the torch path runs) and
    non-finite weight gives the same row from both paths: counts exactly, norms to 1e-12."""
    g = torch.Generator().manual_seed(numel)
    a = torch.randn(numel, generator=g).to(dtypes[0])
    b = (a.float() + 1e-2 * torch.randn(numel, generator=g) * (torch.rand(numel, generator=g) < 0.5)).to(dtypes[1])
    b[0] = a[0].float() + 1.0  # at least one real change
    if poison is not None:
        b[numel // 2] = poison
    n = "model.layers.0.mlp.up_proj.weight"
    save_file({n: a}, tmp_path / "a.safetensors")
    save_file({n: b}, tmp_path / "b.safetensors")
    rows = []
    for kernel in ("1", "0"):
        monkeypatch.setenv("MECHDIAG_KERNEL", kernel)
        rows.append(mechdiag.displacement.tensor_row(*_one_tensor_files(tmp_path, n)))
    fast, slow = rows
    assert fast["nonfinite"] == slow["nonfinite"] == (poison is not None)
    assert fast["frac_unchanged"] == slow["frac_unchanged"] and fast["frac_sub_ulp"] == slow["frac_sub_ulp"]
    if poison is None:
        assert fast["frac_unchanged"] < 1 and fast["delta_fro"] > 0
        for col in ("ref_fro", "delta_fro", "rel_fro"):
            assert _rel(fast[col], slow[col]) < 1e-12, col


def _one_tensor_files(tmp_path, name):
    from mechdiag.weights import Entry, SafeFiles, TensorRef

    files = SafeFiles()
    ea = Entry(TensorRef(str(tmp_path / "a.safetensors"), name), [])
    eb = Entry(TensorRef(str(tmp_path / "b.safetensors"), name), [])
    return files, name, ea, eb


def test_dense_spectral_matches_svd(tmp_path):
    a = save(build("llama"), tmp_path / "a")
    sd = _state(a)
    g = torch.Generator().manual_seed(3)
    for n in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"):  # tall and wide
        sd[n] = sd[n] + 0.1 * torch.randn(sd[n].shape, generator=g)
    b = _write(tmp_path / "b", sd, config_from=a)
    df = disp(a, b, spectral=True).set_index("name")
    ref = _state(a)
    for n in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        s = torch.linalg.svdvals(sd[n].double() - ref[n].double())
        p = s / s.sum()
        assert _rel(df.loc[n, "sigma_1"], s[0].item()) < 1e-6
        assert _rel(df.loc[n, "stable_rank"], ((s ** 2).sum() / s[0] ** 2).item()) < 1e-5
        assert _rel(df.loc[n, "effective_rank"], torch.exp(-(p * p.log()).sum()).item()) < 1e-5
    assert df.loc["model.layers.1.mlp.up_proj.weight", "sigma_1"] == 0.0


def test_nan_weights_flag_the_row(tmp_path, cli):
    a = save(build("llama"), tmp_path / "a")
    sd = _state(a)
    n = "model.layers.1.self_attn.k_proj.weight"
    sd[n][0, 0] = float("nan")
    sd["model.layers.0.self_attn.k_proj.weight"][1, 1] = float("inf")
    b = _write(tmp_path / "b", sd, config_from=a)
    df = disp(a, b).set_index("name")
    assert df.loc[n, "nonfinite"] and math.isnan(df.loc[n, "rel_fro"])
    assert df["nonfinite"].sum() == 2
    assert group_wdisp(df.reset_index(), by="all").n_tensors[0] == len(df) - 2
    proc = cli("displacement", str(a), str(b), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rec = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rec[n]["nonfinite"] is True and rec[n]["rel_fro"] is None


def test_tied_lm_head_counted_once(tmp_path):
    cfg_model = build("gemma")  # tie_word_embeddings=True: lm_head is not saved
    a = save(cfg_model, tmp_path / "a")
    sd = _state(a)
    assert "lm_head.weight" not in sd
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # a tool that saved the tied copy anyway
    b = _write(tmp_path / "b", sd, config_from=a)
    df = disp(a, b)
    assert "lm_head.weight" not in set(df.name) and (df.module == "embed_tokens").sum() == 1


# --- LoRA adapters ----------------------------------------------------------------------------------------------


def _adapter(base_dir, out, seed, **cfg):
    """Save a random-init PEFT adapter (B non-zero) and the merge_and_unload of the same weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                           LoraConfig(init_lora_weights=False, **cfg))
    model.save_pretrained(out / "adapter")
    model.merge_and_unload().save_pretrained(out / "merged")
    return out / "adapter", out / "merged"


def _factors(adapter, module_key):
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        A = f.get_tensor(f"base_model.model.{module_key}.lora_A.weight").double()
        B = f.get_tensor(f"base_model.model.{module_key}.lora_B.weight").double()
    return B, A


ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_CASES = {
    "plain": dict(r=4, lora_alpha=16, target_modules=ALL_PROJ),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ALL_PROJ),
    "patterns": dict(r=4, lora_alpha=8, target_modules=ALL_PROJ, alpha_pattern={"v_proj": 3},
                     rank_pattern={"down_proj": 2, "layers.1.self_attn.q_proj": 3}),
    "embedding": dict(r=2, lora_alpha=4, target_modules=["embed_tokens", "o_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories260k):
    root = tmp_path_factory.mktemp("lora")
    return {k: _adapter(stories260k, root / k, seed=i, **cfg) for i, (k, cfg) in enumerate(LORA_CASES.items())}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_adapter_equals_merged(adapters, stories260k, case):
    adapter, merged = adapters[case]
    ra = disp(stories260k, adapter).set_index("name")
    rm = disp(stories260k, merged).set_index("name")
    assert list(ra.index) == list(rm.index)
    moved = rm.index[rm.delta_fro > 0]
    assert len(moved) >= 5 and (ra.loc[rm.index.difference(moved), "delta_fro"] == 0).all()
    for col in ("ref_fro", "delta_fro", "rel_fro"):
        rel = ((ra.loc[moved, col] - rm.loc[moved, col]).abs() / rm.loc[moved, col]).max()
        assert rel < 1e-5, (col, rel)


def test_adapter_scaling_rank_and_alpha_patterns(adapters, stories260k):
    for case, key, scale in [("plain", "model.layers.0.self_attn.q_proj", 16 / 4),
                             ("rslora", "model.layers.2.mlp.up_proj", 8 / math.sqrt(4)),
                             ("patterns", "model.layers.3.mlp.down_proj", 8 / 2),
                             ("patterns", "model.layers.1.self_attn.q_proj", 8 / 3),
                             ("patterns", "model.layers.0.self_attn.v_proj", 3 / 4)]:
        adapter, _ = adapters[case]
        B, A = _factors(adapter, key)
        delta = scale * B @ A  # materialised, float64
        row = disp(stories260k, adapter).set_index("name").loc[key + ".weight"]
        assert _rel(row.delta_fro, torch.linalg.vector_norm(delta).item()) < 1e-9, (case, key)
        assert row.lora_rank == A.shape[0]


def test_adapter_spectral_from_factors(adapters, stories260k):
    adapter, _ = adapters["patterns"]
    df = disp(stories260k, adapter, spectral=True).set_index("name")
    key = "model.layers.1.self_attn.q_proj"
    B, A = _factors(adapter, key)
    s = torch.linalg.svdvals((8 / 3) * B @ A)[:3]
    p = s / s.sum()
    row = df.loc[key + ".weight"]
    assert _rel(row.sigma_1, s[0].item()) < 1e-9
    assert _rel(row.stable_rank, ((s ** 2).sum() / s[0] ** 2).item()) < 1e-9
    assert _rel(row.effective_rank, torch.exp(-(p * p.log()).sum()).item()) < 1e-9
    assert row.effective_rank <= 3 + 1e-9


def test_adapter_vs_adapter_is_exact(adapters, stories260k):
    (a1, m1), (a2, m2) = adapters["plain"], adapters["rslora"]
    ra = disp(a1, a2, base=stories260k, spectral=True).set_index("name")
    rm = disp(m1, m2, spectral=True).set_index("name")
    key = "model.layers.2.self_attn.k_proj"
    B1, A1 = _factors(a1, key)
    B2, A2 = _factors(a2, key)
    W0 = _state(stories260k)[key + ".weight"].double()
    delta = 4.0 * B2 @ A2 - 4.0 * B1 @ A1  # plain: 16/4, rslora: 8/sqrt(4)
    row = ra.loc[key + ".weight"]
    assert _rel(row.delta_fro, torch.linalg.vector_norm(delta).item()) < 1e-9
    assert _rel(row.ref_fro, torch.linalg.vector_norm(W0 + 4.0 * B1 @ A1).item()) < 1e-8
    assert _rel(row.sigma_1, torch.linalg.svdvals(delta)[0].item()) < 1e-9
    assert row.lora_rank == 8
    moved = rm.index[rm.delta_fro > 0]
    assert ((ra.loc[moved, "delta_fro"] - rm.loc[moved, "delta_fro"]).abs() / rm.loc[moved, "delta_fro"]).max() < 1e-5


def test_gpt2_fan_in_fan_out_adapter(tmp_path):
    base = save(build("gpt2"), tmp_path / "base")
    adapter, merged = _adapter(base, tmp_path, seed=5, r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"],
                               fan_in_fan_out=True)
    ra, rm = disp(base, adapter).set_index("name"), disp(base, merged).set_index("name")
    moved = rm.index[(rm.delta_fro > 0) & rm.part_of.isna()]  # c_attn's q, k, v parts: tests/test_parts.py
    assert {tuple(n.split(".")[-2:]) for n in moved} == {("c_attn", "weight"), ("c_fc", "weight")}
    assert ((ra.loc[moved, "delta_fro"] - rm.loc[moved, "delta_fro"]).abs() / rm.loc[moved, "delta_fro"]).max() < 1e-5


# --- lora_rows: the trainer's in-memory path ---------------------------------------------------------------------


def test_lora_rows_equals_checkpoint_path(tmp_path, stories260k):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(stories260k),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                      rank_pattern={"down_proj": 2}, init_lora_weights=False))
    rows = lora_rows(model)
    assert len(rows) == 15 and set(rows[0]) == {"name", "layer", "module", "ref_fro", "delta_fro", "rel_fro"}
    assert rows[0]["name"] == "model.layers.0.self_attn.q_proj.weight" and rows[0]["layer"] == 0
    assert rows[0]["module"] == "q_proj"
    model.save_pretrained(tmp_path / "ad")
    ck = disp(stories260k, tmp_path / "ad").set_index("name")
    for r in rows:
        for col in ("ref_fro", "delta_fro", "rel_fro"):
            assert _rel(r[col], ck.loc[r["name"], col]) < 1e-9, (r["name"], col)
    by = group_wdisp(pd.DataFrame(rows), by="module").set_index("module")
    assert set(by.index) == {"q_proj", "v_proj", "down_proj"}
    # the cached ||W0|| follows in-place changes of the base weight
    w = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    with torch.no_grad():
        w.mul_(2.0)
    assert _rel(lora_rows(model)[0]["ref_fro"], 2 * rows[0]["ref_fro"]) < 1e-9


# --- CLI contract -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    a = save(build("llama"), root / "a")
    sd = _state(a)
    sd["model.layers.1.self_attn.o_proj.weight"] = sd["model.layers.1.self_attn.o_proj.weight"] * 1.5
    return a, _write(root / "b", sd, config_from=a)


def test_cli_formats(pair, tmp_path, cli):
    a, b = pair
    proc = cli("displacement", str(a), str(b), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    recs = json.loads(proc.stdout)
    assert {"name", "layer", "module", "ref_fro", "delta_fro", "rel_fro"} <= set(recs[0])
    moved = [r for r in recs if r["delta_fro"] > 0]
    assert [r["name"] for r in moved] == ["model.layers.1.self_attn.o_proj.weight"]
    assert moved[0]["rel_fro"] == pytest.approx(0.5, rel=1e-6) and moved[0]["layer"] == 1
    grouped = json.loads(cli("displacement", str(a), str(b), "--by", "module", "--format", "json").stdout)
    assert {r["module"]: r["wdisp"] > 0 for r in grouped}["o_proj"] and "wdisp" in grouped[0]
    csv = cli("displacement", str(a), str(b), "--by", "layer", "--format", "csv").stdout
    assert csv.splitlines()[0].startswith("layer,n_tensors")
    pq, html = tmp_path / "r.parquet", tmp_path / "h.html"
    proc = cli("displacement", str(a), str(b), "--format", "parquet", "--out", str(pq), "--html", str(html))
    assert proc.returncode == 0, proc.stderr
    assert len(pd.read_parquet(pq)) == len(recs)
    page = html.read_text()
    assert "heatmap" in page and len(page) > 1_000_000  # plotly.js inlined: works offline
    table = cli("displacement", str(a), str(b), "--spectral", columns=400)
    assert table.returncode == 0 and "o_proj" in table.stdout and "sigma_1" in table.stdout


def test_heatmap_grid_is_layers_by_modules(pair):
    from mechdiag.report.heatmap import OUTSIDE, displacement_grid, displacement_heatmap

    df = disp(*pair)
    grid = displacement_grid(df)
    assert list(grid.index) == ["0", "1", OUTSIDE]
    assert grid.loc["1", "o_proj"] == pytest.approx(0.5, rel=1e-6) and grid.loc["0", "o_proj"] == 0
    assert displacement_heatmap(df).data[0].type == "heatmap"


def _bad_cases(root, pair, stories260k):
    a, b = pair
    sd = _state(a)
    shape = dict(sd)
    shape["model.layers.0.mlp.up_proj.weight"] = torch.zeros(33, 16)
    one_side = dict(sd)
    del one_side["model.layers.0.mlp.up_proj.weight"]
    empty = root / "empty"
    empty.mkdir()
    adapter = root / "orphan"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                             "base_model_name_or_path": "org/unknown"}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 16)},
              adapter / "adapter_model.safetensors")
    return {
        "missing": (str(a), str(root / "nope"), "no such file"),
        "not_checkpoint": (str(a), str(empty), "not a checkpoint"),
        "shape": (str(a), str(_write(root / "shape", shape, config_from=a)), "shape"),
        "one_side": (str(a), str(_write(root / "one", one_side, config_from=a)), "not in"),
        "architecture": (str(a), str(save(build("gpt2"), root / "gpt2")), "different architectures"),
        "unknown_base": (str(adapter), str(adapter), "--base"),
        "pickle": (str(a), str((root / "w.pt").write_bytes(b"x") and root / "w.pt"), "pickle"),
    }


def test_bad_input_is_one_clear_user_error(pair, tmp_path, stories260k):
    from mechdiag.displacement import compare

    for what, (x, y, msg) in _bad_cases(tmp_path, pair, stories260k).items():
        with pytest.raises(UserError, match=msg.replace("-", "\\-")):
            compare(x, y)
        assert what


def test_cli_bad_input_one_line_exit_2_no_output(pair, tmp_path, cli, stories260k):
    cases = _bad_cases(tmp_path, pair, stories260k)
    for what in ("shape", "unknown_base", "architecture"):  # the exit path is shared; one subprocess costs seconds
        x, y, msg = cases[what]
        out = tmp_path / f"{what}.json"
        proc = cli("displacement", x, y, "--format", "json", "--out", str(out), "--html", str(tmp_path / "h.html"))
        assert_bad_input(proc)
        assert msg in proc.stderr, (what, proc.stderr)
        assert not out.exists() and not (tmp_path / "h.html").exists()


def test_api_errors_are_user_errors(pair):
    with pytest.raises(UserError, match="by must be"):
        disp(*pair, by="row")
    assert isinstance(mechdiag.displacement.displacement(*pair), pd.DataFrame)


def test_progress_and_workers_do_not_change_rows(pair):
    from mechdiag.displacement import compare

    seen = []
    one = compare(*pair, workers=1, progress=lambda done, total: seen.append((done, total)))
    two = compare(*pair, workers=2)
    assert one == two
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == seen[-1][1]
    assert len(seen) == len(one)


@pytest.mark.parametrize("family,cfg,n_rows", [
    ("gpt2", dict(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True), 4),
    ("llama", dict(r=2, lora_alpha=2, target_modules=["embed_tokens", "v_proj"], use_rslora=True), 3),
])
def test_lora_rows_transposed_layers_match_checkpoint(tmp_path, family, cfg, n_rows):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    model = get_peft_model(build(family), LoraConfig(init_lora_weights=False, **cfg))
    rows = [r for r in lora_rows(model) if not r.get("part_of")]  # c_attn's parts: tests/test_parts.py
    base = save(build(family), tmp_path / "base")  # same seed: the same base weights
    model.save_pretrained(tmp_path / "ad")
    ck = disp(base, tmp_path / "ad").set_index("name")
    assert len(rows) == n_rows
    for r in rows:
        assert _rel(r["delta_fro"], ck.loc[r["name"], "delta_fro"]) < 1e-9 and r["delta_fro"] > 0
        assert _rel(r["ref_fro"], ck.loc[r["name"], "ref_fro"]) < 1e-8


# --- update geometry (--spectral): from factors / Grams vs a dense SVD ----------------------------------------------


def _dense_geometry(W, D, k):
    """The definitions, computed the plain way: full SVDs of the reference and of the tuned weight in float64."""
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    overlap = (torch.linalg.matrix_norm(U[:, :k].T @ D @ Vh[:k].T) ** 2 / torch.linalg.matrix_norm(D) ** 2).item()
    Ut, _, Vht = torch.linalg.svd(W + D, full_matrices=False)
    # singular vectors on the smaller side, where the reference's form a complete basis
    base, tuned = (Vh.T, Vht[:10].T) if W.shape[0] >= W.shape[1] else (U, Ut[:, :10])
    best = (base.T @ tuned).abs().max(dim=0).values
    return overlap, int((best < 0.5).sum()), best


def _check_geometry(row, W, D, k):
    overlap, intruders, best = _dense_geometry(W, D, k)
    assert row.overlap_k == k
    assert _rel(row.subspace_overlap, overlap) < 1e-8, (row.name, row.subspace_overlap, overlap)
    assert not ((best - 0.5).abs() < 1e-6).any()  # no vector on the threshold: the count is well defined
    assert row.intruders == intruders, (row.name, row.intruders, intruders)
    return intruders


@pytest.mark.parametrize("case", ["patterns", "embedding"])
def test_update_geometry_from_factors_equals_dense_svd(adapters, stories260k, case):
    adapter, _ = adapters[case]
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    df = disp(stories260k, adapter, spectral=True).set_index("name")
    base = _state(stories260k)
    counts, checked = [], 0
    for name, row in df.iterrows():
        if pd.isna(row.lora_rank):
            assert pd.isna(row.subspace_overlap) and pd.isna(row.intruders)
            continue
        key = name.removesuffix(".weight")
        module = key.split(".")[-1]
        with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
            if module == "embed_tokens":  # stored transposed: W = (B A)^T
                A = f.get_tensor(f"base_model.model.{key}.lora_embedding_A").double()
                B = f.get_tensor(f"base_model.model.{key}.lora_embedding_B").double()
            else:
                B, A = _factors(adapter, key)
        r = A.shape[0]
        alpha = next((v for p, v in cfg.get("alpha_pattern", {}).items() if key.endswith(p)), cfg["lora_alpha"])
        D = (alpha / r) * (B @ A)
        if module == "embed_tokens":
            D = D.T
        counts.append(_check_geometry(row, base[name].double(), D, r))
        checked += 1
    assert checked >= 5
    if case == "patterns":  # random-init factors this large do create intruders in some modules and not in others
        assert max(counts) > 0 and min(counts) == 0, counts


def test_update_geometry_dense_delta_equals_dense_svd(adapters, stories260k):
    _, merged = adapters["plain"]
    df = disp(stories260k, merged, spectral=True).set_index("name")
    base, tuned = _state(stories260k), _state(merged)
    n = 0
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.layers.4.mlp.up_proj.weight", "model.layers.2.self_attn.k_proj.weight"]:
        W = base[name].double()
        D = (tuned[name].float() - base[name].float()).double()
        _check_geometry(df.loc[name], W, D, min(W.shape) // 16)
        n += 1
    assert n == 4 and df.loc["model.norm.weight", "intruders"] is pd.NA


def test_update_geometry_adapter_vs_adapter(adapters, stories260k):
    (a1, _), (a2, _) = adapters["plain"], adapters["rslora"]
    df = disp(a1, a2, base=stories260k, spectral=True).set_index("name")
    key = "model.layers.2.self_attn.k_proj"
    B1, A1 = _factors(a1, key)
    B2, A2 = _factors(a2, key)
    W = _state(stories260k)[key + ".weight"].double() + 4.0 * B1 @ A1
    _check_geometry(df.loc[key + ".weight"], W, 4.0 * B2 @ A2 - 4.0 * B1 @ A1, 8)
    # an adapter against a merged model of another adapter: dense and LoRA parts on both sides of the algebra
    _, m2 = adapters["rslora"]
    df = disp(a1, m2, base=stories260k, spectral=True).set_index("name")
    for key in ("model.layers.2.self_attn.k_proj", "model.layers.4.mlp.down_proj"):
        B1, A1 = _factors(a1, key)
        W0 = _state(stories260k)[key + ".weight"]
        d = (_state(m2)[key + ".weight"].float() - W0.float()).double()
        _check_geometry(df.loc[key + ".weight"], W0.double() + 4.0 * B1 @ A1, d - 4.0 * B1 @ A1, 4)


# --- output heads: tied and untied bases, LoRA on lm_head, modules_to_save ------------------------------------------


def _untied_copy(stories260k, out, head_noise=0.0):
    """stories260K (tied) saved untied: its own lm_head.weight = the embedding (+ noise), tie_word_embeddings false."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories260k, tie_word_embeddings=False)
    torch.manual_seed(3)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight + head_noise * torch.randn_like(
            model.lm_head.weight))
    model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    return out


def test_untied_head_against_tied_base_is_an_lm_head_row(tmp_path, stories260k):
    assert json.loads((stories260k / "config.json").read_text())["tie_word_embeddings"] is True
    tuned = _untied_copy(stories260k, tmp_path / "tuned", head_noise=0.05)
    for a, b in ((stories260k, tuned), (tuned, stories260k)):
        df = disp(a, b).set_index("name")
        row = df.loc["lm_head.weight"]
        emb = _state(stories260k)["model.embed_tokens.weight"].double()
        head = _state(tuned)["lm_head.weight"].double()
        assert row.module == "lm_head" and pd.isna(row.layer)
        assert _rel(row.delta_fro, torch.linalg.vector_norm(head - emb).item()) < 1e-9
        ref = emb if a == stories260k else head
        assert _rel(row.ref_fro, torch.linalg.vector_norm(ref).item()) < 1e-9
        assert df.loc["model.embed_tokens.weight", "delta_fro"] == 0
        assert group_wdisp(df.reset_index(), by="all").wdisp[0] > 0


HEAD_CASES = {"lora": dict(target_modules=["q_proj", "lm_head"]),
              "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
              "lora_embedding_and_head": dict(target_modules=["embed_tokens", "lm_head"])}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("case", list(HEAD_CASES))
def test_head_adapter_equals_merged(tmp_path, stories260k, tied, case):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = stories260k if tied else _untied_copy(stories260k, tmp_path / "base")
    torch.manual_seed(7)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **HEAD_CASES[case]))
    if case == "modules_to_save":  # the trained copy moves
        with torch.no_grad():
            model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.1)
    model.save_pretrained(tmp_path / "adapter")
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    ra = disp(base, tmp_path / "adapter").set_index("name")
    rm = disp(base, tmp_path / "merged").set_index("name")
    assert sorted(ra.index) == sorted(rm.index)
    heads = [n for n in rm.index if n in ("lm_head.weight", "model.embed_tokens.weight") and rm.loc[n, "delta_fro"] > 0]
    assert heads, "the head's update is reported"
    for col in ("ref_fro", "delta_fro"):
        rel = ((ra.loc[rm.index, col] - rm[col]).abs() / rm[col].clip(lower=1e-30)).max()
        assert rel < 1e-5, (col, rel)
    wa = group_wdisp(ra.reset_index(), by="all").wdisp[0]
    wm = group_wdisp(rm.reset_index(), by="all").wdisp[0]
    assert _rel(wa, wm) < 1e-5 and wa > 0


def test_rel_fro_of_a_zero_reference_is_inf_everywhere(tmp_path, stories260k, cli):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(stories260k)
    with torch.no_grad():
        base.model.layers[0].self_attn.q_proj.weight.zero_()
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(5)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    rows = {r["name"]: r for r in lora_rows(model)}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert rows[name]["ref_fro"] == 0 and rows[name]["delta_fro"] > 0
    assert rows[name]["rel_fro"] == math.inf
    model.save_pretrained(tmp_path / "adapter")
    assert disp(tmp_path / "base", tmp_path / "adapter").set_index("name").loc[name, "rel_fro"] == math.inf
    proc = cli("displacement", str(tmp_path / "base"), str(tmp_path / "adapter"), "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert pd.read_csv(io.StringIO(proc.stdout)).set_index("name").loc[name, "rel_fro"] == math.inf
    table = cli("displacement", str(tmp_path / "base"), str(tmp_path / "adapter"))
    head = [c.strip() for c in next(x for x in table.stdout.splitlines() if "┃ rel_fro" in x).split("┃")]
    cells = [c.strip() for c in next(x for x in table.stdout.splitlines() if "q_proj" in x).split("│")]
    assert cells[head.index("rel_fro")] == "inf", (head, cells)  # the table keeps rel_fro whatever the width


def test_head_lora_on_a_tied_base_that_saved_its_head_too(tmp_path, stories260k):
    """Some tools save the tied head's bytes anyway: LoRA on that head still lands on the tied tensor."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sd = _state(stories260k)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    base = _write(tmp_path / "base", sd)
    shutil.copy(stories260k / "config.json", base / "config.json")
    torch.manual_seed(9)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(stories260k),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    ra = disp(base, tmp_path / "adapter").set_index("name")
    rm = disp(stories260k, tmp_path / "merged").set_index("name")
    emb = "model.embed_tokens.weight"
    assert "lm_head.weight" not in ra.index and rm.loc[emb, "delta_fro"] > 0
    assert _rel(ra.loc[emb, "delta_fro"], rm.loc[emb, "delta_fro"]) < 1e-5
