"""Tiny random-init models of several families, built offline, for the weight tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "neox")
N_LAYERS = 2


def family_config(family: str):
    import transformers as T

    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=N_LAYERS,
                  num_attention_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if family == "llama":
        return T.LlamaConfig(num_key_value_heads=1, **common)
    if family == "qwen2":
        return T.Qwen2Config(num_key_value_heads=1, **common)
    if family == "qwen3":
        return T.Qwen3Config(num_key_value_heads=1, head_dim=8, **common)
    if family == "gemma":
        return T.GemmaConfig(num_key_value_heads=1, head_dim=8, **common)
    if family == "phi3":
        return T.Phi3Config(num_key_value_heads=2, **common)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=64, n_embd=16, n_layer=N_LAYERS, n_head=2, n_positions=32, bos_token_id=0,
                            eos_token_id=1)
    if family == "neox":
        return T.GPTNeoXConfig(**common)
    raise ValueError(family)


def build(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(family)).eval()


def save(model, folder: Path, **kw) -> Path:
    model.save_pretrained(folder, **kw)
    return folder
