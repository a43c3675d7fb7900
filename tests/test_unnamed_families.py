"""Issue 26, "the same holds on families the tests do not name": causal-LM families beyond the matrix, each with a
quirk of its own (tests/tiny_models.UNNAMED: fused q/k/v layouts, head transforms, other block and module names,
experts, GPT-OSS's [E, in, out] expert stacks with gate / up interleaved), through every cell of
tests/family_cells.py as the matrix is: train (native and TRL), displacement (by tensor, module, layer, --spectral;
fused parts sliced as the family's own modeling code slices them), shift (its last layer equal to the model's own
logits: Granite's logits_scaling and Cohere's logit_scale included), attribute, recommend and training its refined
config, report and eval. Families that cannot work give one clear line and exit 2 (NOT_SUPPORTED)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from mechdiag.models import load_tokenizer
from mechdiag.probes.capture import Probe, pad_batch
from tests import family_cells as cells
from tests.tiny_models import UNNAMED, build, family_config, family_folder

torch.set_num_threads(1)


def _own_split(family: str, attn: torch.nn.Module, out: int) -> dict[str, set[int]]:
    """part -> output features of a fused q/k/v module, read off the family's own split: an output whose feature j
    holds the value j goes through the attention's own forward (Falcon: _forward_split), its own split method
    (Bloom, Persimmon), or the lines of its forward (GPT-BigCode, DBRX, MPT, CodeGen) with the module's own sizes."""
    x = torch.arange(out, dtype=torch.float64).view(1, 1, out)
    if family.startswith("falcon"):
        q, k, v = _forward_split(attn, "query_key_value", x)
    elif family == "persimmon":
        q, k, v = attn._split_heads(x)
    elif family == "bloom":
        q, k, v = attn._reshape(x)
    elif family.startswith("gpt_bigcode"):
        if attn.multi_query:
            q, k, v = x.unsqueeze(1).split((attn.embed_dim, attn.kv_dim, attn.kv_dim), dim=3)
        else:
            q, k, v = x.view(1, 1, attn.num_heads, 3 * attn.head_dim).transpose(1, 2).split(3 * [attn.head_dim], 3)
    elif family == "dbrx":
        q, k, v = x.split([attn.hidden_size, attn.num_key_value_heads * attn.head_dim,
                           attn.num_key_value_heads * attn.head_dim], dim=2)
    elif family == "mpt":
        q, k, v = x.chunk(3, dim=2)
    elif family == "codegen":
        local = attn.head_dim * attn.num_attention_heads // attn.mp_num
        q, v, k = x.view(1, 1, -1, 3 * local).split(local, dim=-1)
    else:
        raise ValueError(family)
    return {p: {int(i) for i in t.reshape(-1).tolist()} for p, t in zip("qkv", (q, k, v), strict=True)}


def _forward_split(attn: torch.nn.Module, module: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The query, key and value states the attention's own forward hands its attention function when its fused
    module outputs x (rotary as the identity: cos 1, sin 0), whatever private helpers the modeling code splits with."""
    from transformers import AttentionInterface

    seen = []

    def capture(_module, q, k, v, *_args, **_kwargs):
        seen.append((q, k, v))
        return torch.zeros(*q.shape[:-3], 1, q.shape[-3] * q.shape[-1], dtype=q.dtype), None

    attn = copy.deepcopy(attn)  # its config and module are changed below: the caller's model stays as it was
    AttentionInterface.register("mechdiag_capture", capture)
    attn.config._attn_implementation = "mechdiag_capture"
    setattr(attn, module, _Const(x))
    head_dim = attn.head_dim
    hidden = torch.zeros(1, 1, attn.hidden_size, dtype=x.dtype)
    ones, zeros = torch.ones(1, 1, head_dim, dtype=x.dtype), torch.zeros(1, 1, head_dim, dtype=x.dtype)
    attn.double().forward(hidden, attention_mask=None, position_embeddings=(ones, zeros))
    assert len(seen) == 1
    return seen[0]


class _Const(torch.nn.Module):
    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, _x):
        return self.value


# family -> (module, the attention holding it, relative to a block)
FUSED = {"falcon": ("query_key_value", "self_attention"), "falcon_mq": ("query_key_value", "self_attention"),
         "falcon_rw": ("query_key_value", "self_attention"), "bloom": ("query_key_value", "self_attention"),
         "persimmon": ("query_key_value", "self_attn"), "gpt_bigcode": ("c_attn", "attn"),
         "gpt_bigcode_mha": ("c_attn", "attn"), "dbrx": ("Wqkv", "norm_attn_norm.attn"), "mpt": ("Wqkv", "attn"),
         "codegen": ("qkv_proj", "attn")}
# family -> what train's one stderr line says: Mamba's default targets include out_proj, which peft will not adapt;
# with targets it can, Mamba and RecurrentGemma carry a recurrent state our padded batches would run through
RECURRENT = "layers with a recurrent state"
# 4 tokens still give the toy reward a spread within a group (else the adapter never leaves zero)
FAST = ("max_completion_tokens=4", "eval_n=2")
NOT_SUPPORTED = {"mamba": "peft cannot adapt them on this model", "recurrent_gemma": RECURRENT}


def _block0(model):
    from mechdiag.blocks import find_blocks

    return find_blocks(model)[1][0]


@pytest.mark.parametrize("family", sorted(FUSED))
def test_fused_parts_are_the_models_own_split(family):
    """mechdiag.parts' index sets are exactly the q, k, v features the modeling code reads, and cover the output."""
    from mechdiag.parts import output_parts

    cfg = family_config(family)
    model = AutoModelForCausalLM.from_config(cfg)
    module, attn_path = FUSED[family]
    attn = _block0(model).get_submodule(attn_path)
    out = getattr(attn, module).weight.shape[0]
    parts = {p: idx for p, idx in output_parts(module, out, cfg.to_dict())}
    assert set(parts) == {"q", "k", "v"}
    own = _own_split(family, attn, out)
    for p, idx in parts.items():
        assert len(idx) == len(set(idx.tolist())) and set(idx.tolist()) == own[p], (family, p)
    assert sorted(i for idx in parts.values() for i in idx.tolist()) == list(range(out))


@pytest.mark.parametrize("family", sorted(NOT_SUPPORTED))
def test_unsupported_default_targets_exit_2_with_one_line(family, tmp_path):
    """train (either backend: the model and its LoRA are refused before either starts) and eval refuse in one
    line; displacement and shift need no sampling and work on these models."""
    folder = family_folder(family, tmp_path / "model")
    code, _, err = cells.cli("eval", folder, "--task", "tests.toy:Toy", "--n", 2, "--k", 1, "--max-new-tokens", 2,
                             "--out", tmp_path / "eval")
    errors = [ln for ln in err.splitlines() if ln.startswith("mechdiag: error: ")]
    assert code == 2 and len(errors) == 1 and RECURRENT in errors[0] and "Traceback" not in err, err[-2000:]
    for backend in cells.BACKENDS:
        code, _, err = cells.train(folder, tmp_path / backend, backend)
        assert code == 2 and "Traceback" not in err, (backend, err[-2000:])
        errors = [ln for ln in err.splitlines() if ln.startswith("mechdiag: error: ")]
        assert len(errors) == 1 and NOT_SUPPORTED[family] in errors[0], (backend, err[-2000:])
        if family == "mamba":  # the modules peft can adapt there: then the recurrent state is what refuses it
            code, _, err = cells.train(folder, tmp_path / f"{backend}2", backend,
                                       "lora.target_modules=[in_proj,x_proj,dt_proj]")
            errors = [ln for ln in err.splitlines() if ln.startswith("mechdiag: error: ")]
            assert code == 2 and len(errors) == 1 and RECURRENT in errors[0], (backend, err[-2000:])


def test_recurrent_gemma_lens_is_its_own_soft_capped_logits():
    """Not trainable here, but its logit lens (shift) goes through its own soft cap (logits_soft_cap)."""
    model = build("recurrent_gemma")
    assert model.config.logits_soft_cap
    probe = Probe(model)
    batch = pad_batch([[3, 4, 5, 6], [7, 8]], 0)
    cap = probe.run(batch)  # raises where the lens misses the model's logits
    rows = torch.arange(2)
    assert torch.allclose(probe.lens(cap.resid[-1][rows, batch.last]), cap.logits[rows, batch.last], atol=1e-6)
    assert (cap.logits.abs() < model.config.logits_soft_cap).all()


@pytest.fixture(scope="module", params=[f for f in UNNAMED if f not in NOT_SUPPORTED])
def fam(request, tmp_path_factory):
    """One family's model folder and its two trained runs (native, TRL), shared by every cell; shorter completions
    and evals than the matrix's (the cells are the same, their cost is decoding)."""
    return cells.family_runs(request.param, tmp_path_factory.mktemp(request.param), *FAST)


def test_train_native_and_trl_record_exact_displacement(fam):
    _, folder, runs, _ = fam
    cells.check_train_records(folder, runs)


def test_displacement_and_fused_parts_are_the_adapter_files(fam):
    """The matrix's displacement cell, and each fused part's row the rows of the float64 delta the family's own
    code reads as that part (q / k / v of a fused attention; an expert's gate and up)."""
    family, folder, runs, _ = fam
    run = runs["native"]
    rows = cells.check_displacement(folder, run)
    pairs = cells.deltas(run, folder)
    parts = [r for r in rows.values() if r.get("part_of")]
    _check_gate_up(folder, pairs, rows)
    if family not in FUSED:  # only an expert stack's gate / up halves
        assert all(r["part_of"] == "experts.gate_up_proj" for r in parts), family
        return
    module, attn_path = FUSED[family]
    attn = _block0(cells.base(folder)).get_submodule(attn_path)
    own = _own_split(family, attn, getattr(attn, module).weight.shape[0])
    fused = [n for n in pairs if n.endswith(f".{module}.weight")]
    assert fused, family
    for name in fused:  # each part is the dense delta's rows the model reads as q, k, v
        d, w = pairs[name]
        for p, idx in own.items():
            r = rows[f"{name}[{p}]"]
            rows_ = torch.tensor(sorted(idx))
            assert r["module"] == f"{module}.{p}" and r["part_of"] == module
            assert r["delta_fro"] == pytest.approx(float(d[rows_].norm()), rel=1e-9, abs=1e-12)
            assert r["ref_fro"] == pytest.approx(float(w.double()[rows_].norm()), rel=1e-9)
        assert math.fsum(rows[f"{name}[{p}]"]["delta_fro"] ** 2 for p in "qkv") == \
            pytest.approx(rows[name]["delta_fro"] ** 2, rel=1e-9, abs=1e-18)


def _gate_features(experts, n_out: int) -> dict[str, torch.Tensor]:
    """gate / up output features of a gate_up projection as the experts module's own _apply_gate splits them: the
    activation is nonlinear in a gate feature and linear in an up feature, so the diagonal of the Hessian of its
    summed output (at 0.5: inside GPT-OSS's clamps) is nonzero exactly on the gate features."""
    x = torch.full((n_out,), 0.5, dtype=torch.float64)
    h = torch.autograd.functional.hessian(lambda v: experts._apply_gate(v[None]).sum(), x).diagonal()
    gate = (h.abs() > 1e-12).nonzero().reshape(-1)
    up = (h.abs() <= 1e-12).nonzero().reshape(-1)
    assert len(gate) == len(up) == n_out // 2
    return {"gate": gate, "up": up}


def _check_gate_up(folder, pairs, rows):
    """Each expert's gate and up parts are the rows of the float64 delta its own code reads as gate and up (the
    output axis: features of x @ W[e] where the stack is stored [E, in, out], is_transposed, of W[e] x where
    [E, out, in])."""
    names = [n for n in pairs if n.endswith(".gate_up_proj.weight")]
    model = AutoModelForCausalLM.from_pretrained(folder).double() if names else None
    for name in names:
        experts = model.get_submodule(name.rsplit(".", 3)[0])
        d, w = pairs[name]
        axis = 1 if getattr(experts, "is_transposed", False) else 0
        for p, idx in _gate_features(experts, d.shape[axis]).items():
            r = rows[f"{name}[{p}]"]
            assert r["delta_fro"] == pytest.approx(float(d.index_select(axis, idx).norm()), rel=1e-9), (name, p)
            assert r["ref_fro"] == pytest.approx(float(w.double().index_select(axis, idx).norm()), rel=1e-9), name


def test_shift_last_layer_is_the_models_own_logits(fam):
    _, folder, runs, tmp = fam
    cells.check_shift(folder, runs["native"], tmp)


def test_attribute_reference_rows_are_the_summary(fam):
    _, _, runs, _ = fam
    cells.check_attribute(runs)


def test_recommend_then_train_its_refined_config(fam):
    _, folder, runs, tmp = fam
    cells.check_recommend_train(folder, runs["native"], tmp)


def test_report_shows_the_recorded_module_mass(fam):
    _, folder, runs, tmp = fam
    cells.check_report(folder, runs, tmp)


def test_eval_reproduces_the_runs_base_and_final_accuracy(fam):
    _, folder, runs, tmp = fam
    cells.check_eval(folder, runs["native"], tmp)


def test_the_head_transforms_are_exercised():
    """Granite divides its logits by logits_scaling and Cohere multiplies them by logit_scale: the sweep's configs
    really have them (else the shift cell would pass on a plain head)."""
    tok = load_tokenizer("bundled")
    assert family_config("granite", vocab_size=len(tok)).logits_scaling == 4.0
    assert family_config("cohere", vocab_size=len(tok)).logit_scale == 0.5
    assert json.loads(family_config("falcon_mq").to_json_string())["multi_query"] is True
