"""Tiny random-init models of several families, built offline, for the weight tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "neox")
# the family matrix of issue 26: FAMILIES plus Gemma-2 (soft-capped logits), Gemma-3 (text: sliding and full layers,
# q/k norms, query_pre_attn_scalar), Nemotron (no gate_proj), Mistral, OLMo-2 and one mixture-of-experts model
# (Qwen3-MoE: fused 3-D experts, a Linear router)
MATRIX = (*FAMILIES, "gemma2", "gemma3", "nemotron", "mistral", "olmo2", "qwen3_moe")
MOE = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe")  # saved per expert; mixtral names them w1/w2/w3
# issue 26's "families the tests do not name" (tests/test_unnamed_families.py): fused q/k/v layouts of their own
# (Falcon's three, Bloom, Persimmon, GPT-BigCode multi-query and not, DBRX, MPT, CodeGen's shards), head transforms
# (Granite's logits_scaling, Cohere's logit_scale), other block and module names (GPT-J, OPT, Phi-1/2, StableLM,
# Starcoder2, GPT-Neo and XGLM), experts (DBRX, OLMoE, Mixtral, Qwen2-MoE; GPT-OSS: stacks stored [E, in, out],
# gate / up interleaved, biases, attention sinks), RecurrentGemma (logits_soft_cap) and Mamba (peft refuses its
# out_proj: exit 2)
UNNAMED = ("falcon", "falcon_mq", "falcon_rw", "bloom", "gpt_bigcode", "gpt_bigcode_mha", "gptj", "opt", "stablelm",
           "starcoder2", "granite", "cohere", "persimmon", "phi", "dbrx", "mpt", "codegen", "olmoe", "mixtral",
           "qwen2_moe", "gpt_oss", "gpt_neo", "xglm", "recurrent_gemma", "mamba")
N_LAYERS = 2


def family_config(family: str, vocab_size: int = 64, bos_token_id: int = 0, eos_token_id: int = 1,
                  pad_token_id: int = 0, positions: int | None = None):
    """A tiny config of `family`; positions: its context, under the family's own key (max_position_embeddings,
    which attribute_map sends to GPT-2's n_positions; MPT's max_seq_len)."""
    cfg = _family_config(family, vocab_size, bos_token_id, eos_token_id, pad_token_id)
    if positions is not None:
        key = next(k for k in ("max_position_embeddings", "max_seq_len") if hasattr(cfg, k))
        setattr(cfg, key, positions)
    return cfg


def _family_config(family, vocab_size, bos_token_id, eos_token_id, pad_token_id):
    import transformers as T

    common = dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=N_LAYERS,
                  num_attention_heads=2, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id)
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
        return T.GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=N_LAYERS, n_head=2,
                            n_positions=32 if vocab_size == 64 else 128, bos_token_id=bos_token_id,
                            eos_token_id=eos_token_id)
    if family == "gemma2":
        return T.Gemma2Config(num_key_value_heads=1, head_dim=8, final_logit_softcapping=2.0, **common)
    if family == "gemma3":  # a window shorter than the prompts, so the sliding layer really slides
        return T.Gemma3TextConfig(num_key_value_heads=1, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                  layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
                                  **common)
    if family == "nemotron":
        return T.NemotronConfig(num_key_value_heads=1, **common)
    if family == "mistral":
        return T.MistralConfig(num_key_value_heads=1, **common)
    if family == "olmo2":
        return T.Olmo2Config(num_key_value_heads=1, **common)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=4,
                                num_experts_per_tok=2, **common)
    if family == "olmoe":
        return T.OlmoeConfig(num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, **common)
    if family == "mixtral":
        return T.MixtralConfig(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, **common)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                shared_expert_intermediate_size=8, **common)
    if family == "neox":
        return T.GPTNeoXConfig(**common)
    return _unnamed_config(family, common)


def _unnamed_config(family: str, common: dict):
    import transformers as T

    ids = {k: common[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    pos = 128 if common["vocab_size"] > 64 else 32
    if family == "falcon":  # Falcon-40B/180B: kv groups [q x heads/kv, k, v]
        return T.FalconConfig(hidden_size=16, num_hidden_layers=N_LAYERS, num_attention_heads=4, num_kv_heads=2,
                              new_decoder_architecture=True, **ids)
    if family == "falcon_mq":  # Falcon-7B: multi-query, parallel attention
        return T.FalconConfig(hidden_size=16, num_hidden_layers=N_LAYERS, num_attention_heads=4, multi_query=True,
                              parallel_attn=True, **ids)
    if family == "falcon_rw":  # Falcon-RW: per-head [q, k, v], ALiBi, sequential attention and MLP, biases
        return T.FalconConfig(hidden_size=16, num_hidden_layers=N_LAYERS, num_attention_heads=2, multi_query=False,
                              alibi=True, parallel_attn=False, bias=True, **ids)
    if family == "bloom":
        return T.BloomConfig(hidden_size=16, n_layer=N_LAYERS, n_head=2, **ids)
    if family in ("gpt_bigcode", "gpt_bigcode_mha"):  # StarCoder: multi-query c_attn (a Linear)
        mq = family == "gpt_bigcode"
        return T.GPTBigCodeConfig(n_embd=16, n_layer=N_LAYERS, n_head=4 if mq else 2, n_positions=pos,
                                  multi_query=mq, **ids)
    if family == "gptj":
        return T.GPTJConfig(n_embd=16, n_layer=N_LAYERS, n_head=2, rotary_dim=4, n_positions=pos, **ids)
    if family == "opt":
        return T.OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=N_LAYERS, num_attention_heads=2,
                           word_embed_proj_dim=16, max_position_embeddings=pos, **ids)
    if family == "stablelm":
        return T.StableLmConfig(num_key_value_heads=1, **common)
    if family == "starcoder2":
        return T.Starcoder2Config(num_key_value_heads=1, **common)
    if family == "granite":  # logits / logits_scaling after the head, and multipliers inside
        return T.GraniteConfig(num_key_value_heads=1, logits_scaling=4.0, embedding_multiplier=2.0,
                               residual_multiplier=0.5, attention_multiplier=0.3, **common)
    if family == "cohere":  # logits * logit_scale after the head; LayerNorm without bias
        return T.CohereConfig(num_key_value_heads=1, logit_scale=0.5, **common)
    if family == "persimmon":
        return T.PersimmonConfig(**common)
    if family == "phi":  # phi-1 / phi-2: q_proj k_proj v_proj dense, fc1 fc2, parallel blocks
        return T.PhiConfig(**common)
    if family == "dbrx":  # Wqkv [q, k, v], clipped; experts as fused parameters
        return T.DbrxConfig(d_model=16, n_heads=2, n_layers=N_LAYERS, max_seq_len=pos, **ids,
                            attn_config=dict(kv_n_heads=1, clip_qkv=8.0, rope_theta=10000.0),
                            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))
    if family == "mpt":  # Wqkv chunk(3), ALiBi
        return T.MptConfig(d_model=16, n_heads=2, n_layers=N_LAYERS, expansion_ratio=2, max_seq_len=pos, **ids)
    if family == "codegen":  # qkv_proj in 4 model-parallel shards of [q, v, k]
        return T.CodeGenConfig(n_embd=16, n_layer=N_LAYERS, n_head=4, rotary_dim=4, n_positions=pos, **ids)
    if family == "gpt_neo":  # intermediate_size None (4 x hidden); global and local attention layers
        return T.GPTNeoConfig(hidden_size=16, num_layers=N_LAYERS, num_heads=2, window_size=4,
                              attention_types=[[["global", "local"], 1]], max_position_embeddings=pos, **ids)
    if family == "xglm":  # the final norm is model.layer_norm
        return T.XGLMConfig(d_model=16, num_layers=N_LAYERS, attention_heads=2, ffn_dim=32,
                            max_position_embeddings=pos, **ids)
    if family == "recurrent_gemma":  # soft-capped logits under its own name (logits_soft_cap)
        return T.RecurrentGemmaConfig(num_key_value_heads=1, lru_width=16, attention_window_size=4, **common)
    if family == "gpt_oss":  # experts stored in x out ([E, H, 2I], is_transposed), gate / up interleaved, biases
        return T.GptOssConfig(num_key_value_heads=1, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention"], **common)
    if family == "mamba":
        return T.MambaConfig(hidden_size=16, num_hidden_layers=N_LAYERS, state_size=4, **ids)
    raise ValueError(family)


def build(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(family)).eval()


def save(model, folder: Path, **kw) -> Path:
    model.save_pretrained(folder, **kw)
    return folder


def family_folder(family: str, folder: Path, seed: int = 0, positions: int | None = None) -> Path:
    """A model folder users could train: a tiny random model of the family sized to the bundled tokenizer, which
    ships beside it (tokenizer.json as is); positions: its context (family_config)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from mechdiag.models import bundled_path, load_tokenizer

    tok = load_tokenizer("bundled")
    torch.manual_seed(seed)
    cfg = family_config(family, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, positions=positions)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    for f in bundled_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder


def adapter_deltas(final, model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (s * B @ A, the base weight), float64, multiplied out from a saved peft adapter folder in peft's
    layout, independently of mechdiag: a module's delta out x in (Conv1D's in x out left to the caller); an expert
    stack's (peft's target_parameters: lora_A [E*r, in], lora_B [out, r*E]) per expert e as
    einsum("o r e, e r i -> e o i", B, A)[e] under the model's name owner.e.param.weight (its transpose, "e i o", on
    a stack stored [E, in, out]); a router's (2-D) owner.weight.
    model: the base in memory (the stacks' names and shapes)."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((Path(final) / "adapter_config.json").read_text())
    sd = load_file(Path(final) / "adapter_model.safetensors")
    out = {}
    for key, A in sd.items():
        if ".lora_A." not in key:
            continue
        B = sd[key.replace(".lora_A.", ".lora_B.")].double()
        A, s = A.double(), cfg["lora_alpha"] / cfg["r"]
        path = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        owner = path.replace(".base_layer", "")
        mod = model.get_submodule(owner)
        params = [t.rpartition(".")[2] for t in cfg.get("target_parameters") or ()
                  if owner == t.rpartition(".")[0] or owner.endswith("." + t.rpartition(".")[0])]
        out_in, in_out = (B.shape[0], A.shape[1]), (A.shape[1], B.shape[0])
        fit = [p for p in params if getattr(mod, p).shape[-2:] in (out_in, in_out)]
        if not fit:  # a module LoRA
            out[path + ".weight"] = (s * (B @ A), mod.weight.detach().double())
            continue
        assert len(fit) == 1, (key, fit)
        w = getattr(mod, fit[0]).detach().double()
        if w.ndim == 2:
            out[f"{owner}.{fit[0]}"] = (s * (B @ A), w)
            continue
        E = w.shape[0]
        # peft's einsum: [E, out, in] stacks get B_e A_e, [E, in, out] ones (is_transposed: GPT-OSS) its transpose
        how = "e o i" if w.shape[-2:] == out_in and not getattr(mod, "is_transposed", False) else "e i o"
        delta = s * torch.einsum(f"o r e, e r i -> {how}", B.reshape(B.shape[0], -1, E), A.reshape(E, -1, A.shape[1]))
        for e in range(E):
            out[f"{owner}.{e}.{fit[0]}.weight"] = (delta[e], w[e])
    assert out
    return out
