"""Checkpoint sources and tensor naming: every family's tensors map to (layer, module); shards, single files and
adapters open; pickles and corrupt files are refused with one clear line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from mechdiag.errors import UserError
from mechdiag.weights import SafeFiles, open_dense, open_side, tensor_site
from tests.helpers import assert_bad_input
from tests.tiny_models import FAMILIES, N_LAYERS, build, save

torch.set_num_threads(1)

# What each family's block tensors must be called (module names as the family spells them).
BLOCK_MODULES = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
              "post_attention_layernorm"},
    "gpt2": {"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj", "ln_1", "ln_2"},
    "neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "input_layernorm",
             "post_attention_layernorm"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_layernorm", "post_attention_layernorm"},
}
BLOCK_MODULES["qwen2"] = BLOCK_MODULES["llama"]
BLOCK_MODULES["gemma"] = BLOCK_MODULES["llama"]
BLOCK_MODULES["qwen3"] = BLOCK_MODULES["llama"] | {"q_norm", "k_norm"}
OUTSIDE = {"llama": {"embed_tokens", "norm", "lm_head"}, "gpt2": {"wte", "wpe", "ln_f", "lm_head"},
           "neox": {"embed_in", "final_layer_norm", "embed_out", "lm_head"}}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_maps_to_layer_and_module(family):
    names = list(build(family).state_dict())
    sites = [tensor_site(n) for n in names]
    block = {m for layer, m in sites if layer is not None}
    outside = {m for layer, m in sites if layer is None}
    assert block == BLOCK_MODULES[family]
    assert outside <= OUTSIDE.get(family, OUTSIDE["llama"]) and outside
    assert {layer for layer, _ in sites if layer is not None} == set(range(N_LAYERS))


@pytest.mark.parametrize("name,site", [
    ("model.layers.12.self_attn.q_proj.weight", (12, "q_proj")),
    ("model.layers.3.self_attn.q_proj.bias", (3, "q_proj")),
    ("transformer.h.7.mlp.c_proj.weight", (7, "mlp.c_proj")),
    ("transformer.h.7.attn.c_proj.bias", (7, "attn.c_proj")),
    ("gpt_neox.layers.0.attention.query_key_value.weight", (0, "query_key_value")),
    ("model.embed_tokens.weight", (None, "embed_tokens")),
    ("lm_head.weight", (None, "lm_head")),
    ("model.norm.weight", (None, "norm")),
])
def test_tensor_site_examples(name, site):
    assert tensor_site(name) == site


def test_sharded_folder_lists_same_tensors_as_single_file(tmp_path):
    m = build("llama")
    one = save(m, tmp_path / "one")
    shards = save(m, tmp_path / "shards", max_shard_size="8KB")
    assert (shards / "model.safetensors.index.json").exists()
    assert len(list(shards.glob("model-*.safetensors"))) >= 2
    files = SafeFiles()
    a, b = open_dense(one, files), open_dense(shards, files)
    assert set(a.entries) == set(b.entries)
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(files.read(a.entries[name].dense), files.read(b.entries[name].dense))
    assert torch.equal(files.read(b.entries[name].dense, 3, 7), files.read(a.entries[name].dense)[3:7])
    single = open_dense(one / "model.safetensors", files)
    assert set(single.entries) == set(a.entries) and single.config.get("model_type") == "llama"


def test_missing_shard_is_reported(tmp_path):
    shards = save(build("llama"), tmp_path / "s", max_shard_size="8KB")
    victim = sorted(shards.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(UserError, match="missing"):
        open_dense(shards, SafeFiles())


def test_pickle_checkpoints_are_refused_without_unpickling(tmp_path):
    folder = tmp_path / "pick"
    folder.mkdir()
    # bytes that would run code if unpickled: the refusal must come before any load
    (folder / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch PWNED'\ntR.")
    with pytest.raises(UserError, match="pickle.*save_pretrained"):
        open_side(folder, SafeFiles())
    with pytest.raises(UserError, match="pickle"):
        open_side(folder / "pytorch_model.bin", SafeFiles())
    assert not (folder / "PWNED").exists()


def test_truncated_and_garbage_safetensors(tmp_path):
    good = save(build("llama"), tmp_path / "good")
    trunc = tmp_path / "trunc"
    shutil.copytree(good, trunc)
    data = (good / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(UserError, match="truncated"):
        open_dense(trunc, SafeFiles())
    (trunc / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match="not a valid safetensors"):
        open_dense(trunc, SafeFiles())


def test_not_a_checkpoint_and_missing(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="not a checkpoint"):
        open_side(tmp_path, SafeFiles())
    with pytest.raises(UserError, match="no such file"):
        open_side(tmp_path / "nope", SafeFiles())
    with pytest.raises(UserError, match="not a checkpoint"):
        open_side(tmp_path / "notes.txt", SafeFiles())


def test_adapter_resolves_base_from_config_or_other_side(tmp_path, stories260k):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(stories260k),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "ad")
    files = SafeFiles()
    side = open_side(tmp_path / "ad", files)  # base_model_name_or_path is the local stories260K folder
    assert side.is_adapter and len(side.entries["model.layers.0.self_attn.q_proj.weight"].lora) == 1
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "someone/not-here"
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="--base"):
        open_side(tmp_path / "ad", files)
    assert open_side(tmp_path / "ad", files, other=stories260k).is_adapter  # `displacement BASE ADAPTER`


def test_cli_bad_safetensors_is_one_line_exit_2(tmp_path, cli, stories260k):
    bad = tmp_path / "bad.safetensors"
    save_file({"x": torch.zeros(4)}, bad)
    bad.write_bytes(bad.read_bytes()[:-4])
    out = tmp_path / "out.json"
    proc = cli("displacement", str(stories260k), str(bad), "--format", "json", "--out", str(out))
    assert_bad_input(proc)
    assert "truncated" in proc.stderr and not out.exists()
