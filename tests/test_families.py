"""Issue 26: every family's blocks, default LoRA targets, merged sampler, LoRA displacement and logit lens."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from mechdiag import blocks
from mechdiag.config import LoraConfig
from mechdiag.displacement import lora_rows
from mechdiag.errors import UserError
from mechdiag.models import load_tokenizer
from mechdiag.probes.capture import Probe, pad_batch
from mechdiag.train.lora import apply_lora, lora_modules, merge_into, resolve
from tests.tiny_models import MATRIX, build, save

EXPECTED_TARGETS = {
    "phi3": ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"],
    "neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "nemotron": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
    # transformers 5 stores the experts as fused 3-D parameters (adapted through peft's target_parameters) and
    # the router as a parameter, not Linear (not in all-linear)
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"],
}
STUDY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tuned(family):
    model = build(family)
    plain = copy.deepcopy(model)
    peft_model = apply_lora(model, LoraConfig(r=2, alpha=4))
    torch.manual_seed(1)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.data.normal_()
    return peft_model.eval(), plain


@pytest.mark.parametrize("family", MATRIX)
def test_family_lora_merge_lens_and_displacement(family):
    peft_model, plain = _tuned(family)
    targets, layers = resolve(build(family), LoraConfig())
    assert targets == EXPECTED_TARGETS.get(family, STUDY) and layers == [0, 1]
    mods = lora_modules(peft_model)
    assert len(mods) == 2 * len(targets) and {m["layer"] for m in mods} == {0, 1}

    # the merged sampler's weights give the adapter's own logits (Conv1D transposed)
    merge_into(peft_model, plain)
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft_model(ids).logits
        assert torch.allclose(plain(ids).logits, want, atol=1e-5)

    # displacement from the factors vs a dense float64 (W + s B A) - W
    rows = {r["name"]: r for r in lora_rows(peft_model) if not r.get("part_of")}  # parts: tests/test_parts.py
    experts = getattr(peft_model.config, "num_experts", 1)  # an expert stack: one row per expert
    assert len(rows) == sum(experts if m["module"].startswith("experts.") else 1 for m in mods)
    for name, mod in peft_model.named_modules():
        if hasattr(mod, "parameter_name"):  # expert stacks: tests/test_moe.py, tests/test_moe_lora.py
            continue
        if hasattr(mod, "lora_A") and hasattr(mod, "get_base_layer") and "default" in mod.lora_A:
            w = mod.get_base_layer().weight.double()
            d = mod.scaling["default"] * (mod.lora_B["default"].weight.double() @ mod.lora_A["default"].weight.double())
            d = d.T if mod.fan_in_fan_out else d
            assert d.shape == w.shape
            row = rows[name.removeprefix("base_model.model.") + ".weight"]
            assert row["delta_fro"] == pytest.approx(float(d.detach().norm()), rel=1e-9)
            assert row["ref_fro"] == pytest.approx(float(w.detach().norm()), rel=1e-6)
            assert row["layer"] == blocks.layer_index(name.removeprefix("base_model.model."))

    # the last block's lens is the model's own logits (Gemma-2 soft-capping included)
    probe = Probe(peft_model)
    batch = pad_batch([[3, 4, 5, 6], [7, 8]], 0)
    cap = probe.run(batch)
    rows_ = torch.arange(2)
    lens = probe.lens(cap.resid[-1][rows_, batch.last])
    assert torch.allclose(lens, cap.logits[rows_, batch.last], atol=1e-5)
    assert probe.n_layers == 2


def test_gemma2_lens_needs_the_softcap():
    model = build("gemma2")
    model.config.final_logit_softcapping = 0.05  # tiny random logits: a cap small enough to bend them
    probe = Probe(model)
    batch = pad_batch([[3, 4, 5, 6]], 0)
    cap = probe.run(batch)
    h = cap.resid[-1][0, -1]
    raw = probe.head(probe.norm(h))
    assert not torch.allclose(raw, cap.logits[0, -1], atol=1e-3)  # without the cap the lens would be wrong
    assert torch.allclose(probe.lens(h), cap.logits[0, -1], atol=1e-6)


def test_a_missing_target_lists_every_module():
    with pytest.raises(UserError) as e:
        resolve(build("gpt2"), LoraConfig(target_modules=["q_proj", "c_attn"]))
    msg = str(e.value)
    assert "'q_proj'" in msg and all(m in msg for m in EXPECTED_TARGETS["gpt2"])


def test_gpt2_c_proj_alone_matches_both_parents():
    targets, _ = resolve(build("gpt2"), LoraConfig(target_modules=["c_proj"]))
    assert targets == ["c_proj"]
    mods = lora_modules(apply_lora(build("gpt2"), LoraConfig(r=2, target_modules=["attn.c_proj"])))
    assert {m["module"] for m in mods} == {"attn.c_proj"} and len(mods) == 2


@pytest.mark.parametrize("tokenizer_config", [{}, {"tokenizer_class": "Qwen2Tokenizer"}])
def test_qwen2_architecture_with_a_llama_tokenizer_json_encodes_as_the_file(tmp_path, stories260k,
                                                                           tokenizer_config):
    """bench/scale.py's build: a Qwen2 config.json beside a Llama-family tokenizer.json. AutoTokenizer swaps in
    Qwen2Tokenizer (which drops the spaces); models.load_tokenizer gives the file's own ids."""
    folder = save(build("qwen2"), tmp_path / "q")
    shutil.copy(stories260k / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "bos_token": "<s>",
                                                              "eos_token": "</s>"}))
    file_tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok = load_tokenizer(folder)
    texts = ["Once upon a time, there was a little girl named Lily.", "  two  spaces\nand a line", "Tom ran."]
    for text in texts:
        assert tok(text).input_ids == file_tok.encode(text).ids
        assert tok(text, add_special_tokens=False).input_ids == file_tok.encode(text, add_special_tokens=False).ids
    swapped = AutoTokenizer.from_pretrained(folder)
    assert type(swapped).__name__ == "Qwen2Tokenizer"  # the swap this guards against is real
    assert swapped(texts[0]).input_ids != file_tok.encode(texts[0]).ids
