"""Logical parts of fused modules, as index sets over their output features, and the study's module roles.

A fused module stores several projections in one tensor, each family in its own layout (as its modeling code
splits the output): Phi-3's qkv_proj (q, then k, then v), GPT-NeoX's, Bloom's and Persimmon's query_key_value (per
head [q, k, v]), Falcon's query_key_value (per head, multi-query q then one k and v head, or the new decoder's kv
groups [q x heads/kv, k, v]), GPT-2's c_attn (Conv1D: q, k, v thirds), GPT-BigCode's c_attn (multi-query: q, then
one k and one v head), DBRX's and MPT's Wqkv, CodeGen's qkv_proj (4 shards of [q, v, k]) and gate_up_proj (gate
half, then up half; GPT-OSS interleaves them, in a stack stored [E, in, out]: each expert is read out x in). A fused
module of a family not listed is reported whole. Each part is a set of output features; `displacement` reports it
beside the stored tensor as MODULE.PART (qkv_proj.v), from the LoRA factors restricted to the part's rows of B (the
slice of B A is B[rows] A), never from the product.

A part row carries `part_of` (the stored module): sums over whole tensors (per layer, the whole model) leave part
rows out, or they would count a fused tensor twice.
"""

from __future__ import annotations

import torch

# the study's module set, by role; a family's own name of each role (fused parts included)
ROLES = {
    "q_proj": ("q_proj", "qkv_proj.q", "query_key_value.q", "c_attn.q", "Wqkv.q"),
    "k_proj": ("k_proj", "qkv_proj.k", "query_key_value.k", "c_attn.k", "Wqkv.k"),
    "v_proj": ("v_proj", "qkv_proj.v", "query_key_value.v", "c_attn.v", "Wqkv.v"),
    "o_proj": ("o_proj", "dense", "attn.c_proj", "out_proj"),
    "gate_proj": ("gate_proj", "gate_up_proj.gate", "experts.gate_proj", "experts.w1"),  # Mixtral: w1, w3, w2
    "up_proj": ("up_proj", "gate_up_proj.up", "dense_h_to_4h", "c_fc", "fc1", "fc_in", "experts.up_proj", "experts.w3"),
    "down_proj": ("down_proj", "dense_4h_to_h", "mlp.c_proj", "c_proj", "fc2", "fc_out",
                  "experts.down_proj", "experts.w2"),
}


def family_name(role: str, modules) -> str | None:
    """The name this model gives the study's `role` (v_proj -> qkv_proj.v on Phi-3), among `modules`; None if
    the model has none."""
    have = set(modules)
    return next((m for m in ROLES.get(role, (role,)) if m in have), None)


def _text(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _heads(groups: int, pattern, head_dim: int) -> list[tuple[str, torch.Tensor]]:
    """Parts of an output laid out as `groups` repeats of `pattern` [(part, heads)], each head head_dim features:
    per head [q, k, v] is (heads, [(q,1), (k,1), (v,1)]); q then k then v is (1, [(q,H), (k,KV), (v,KV)])."""
    width = sum(n for _, n in pattern) * head_dim
    starts, at = {}, 0
    for part, n in pattern:
        starts[part] = (at, n * head_dim)
        at += n * head_dim
    return [(part, (torch.arange(groups)[:, None] * width + start + torch.arange(n)[None, :]).reshape(-1))
            for part, (start, n) in starts.items()]


def _first(cfg: dict, *keys):
    return next((cfg[k] for k in keys if isinstance(cfg.get(k), int)), None)


def _qkv_layout(module: str, kind: str | None, cfg: dict, heads: int, head_dim: int):
    """(groups, pattern) of a fused q/k/v output as the family's modeling code splits it, None where not known."""
    per_head = (heads, [("q", 1), ("k", 1), ("v", 1)])
    if module == "qkv_proj":
        if kind in ("phi3", "phi4_multimodal"):  # Phi3Attention: [:q], next kv*head_dim, the rest
            kv = cfg.get("num_key_value_heads") or heads
            return 1, [("q", heads), ("k", kv), ("v", kv)]
        if kind == "codegen":  # 4 model-parallel shards, each [q, v, k] (CodeGenAttention)
            return 4, [("q", heads // 4), ("v", heads // 4), ("k", heads // 4)]
        if kind == "minimax":  # MiniMaxLightningAttention: per head [q, k, v]
            return per_head
    if module == "query_key_value":
        if kind in ("gpt_neox", "bloom", "persimmon"):  # view(heads, 3, head_dim) / (heads, 3 * head_dim)
            return per_head
        if kind == "falcon":  # FalconAttention._split_heads, three layouts
            if cfg.get("new_decoder_architecture"):
                kv = cfg.get("num_kv_heads") or heads
                return kv, [("q", heads // kv), ("k", 1), ("v", 1)]
            return (1, [("q", heads), ("k", 1), ("v", 1)]) if cfg.get("multi_query") else per_head
    if module == "c_attn" and kind == "gpt_bigcode":  # multi-query: split(embed, head_dim, head_dim)
        return (1, [("q", heads), ("k", 1), ("v", 1)]) if cfg.get("multi_query", True) else per_head
    if module == "c_attn" and kind == "gpt2":  # c_attn(x).split(n_embd): thirds
        return 1, [("q", heads), ("k", heads), ("v", heads)]
    if module == "Wqkv" and kind == "dbrx":  # split(hidden, kv * head_dim, kv * head_dim)
        kv = (cfg.get("attn_config") or {}).get("kv_n_heads") or heads
        return 1, [("q", heads), ("k", kv), ("v", kv)]
    if module == "Wqkv" and kind == "mpt":  # chunk(3)
        return 1, [("q", heads), ("k", heads), ("v", heads)]
    return None


def output_parts(module: str, out_features: int, config: dict) -> list[tuple[str, torch.Tensor]]:
    """[(part name, indices of its output features)] of a fused module with `out_features` outputs, [] when the
    module is not fused, its family's layout is not known here, or the layout does not fit the config (then only
    the stored tensor is reported)."""
    cfg = _text(config or {})
    kind = cfg.get("model_type")
    if module == "gate_up_proj" and out_features % 2 == 0:
        if kind == "gpt_oss":  # GptOssExperts: gate = [..., ::2], up = [..., 1::2]
            return [("gate", torch.arange(0, out_features, 2)), ("up", torch.arange(1, out_features, 2))]
        half = out_features // 2  # chunk(2): gate half, then up half
        return [("gate", torch.arange(0, half)), ("up", torch.arange(half, out_features))]
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head", "n_heads")
    if not (hidden and heads):
        return []
    head_dim = cfg.get("head_dim") or hidden // heads
    layout = _qkv_layout(module, kind, cfg, heads, head_dim)
    if layout is None:
        return []
    groups, pattern = layout
    if any(n <= 0 for _, n in pattern) or groups * sum(n for _, n in pattern) * head_dim != out_features:
        return []
    return _heads(groups, pattern, head_dim)


# families whose expert stacks are stored [E, in, out]: transformers' @use_experts_implementation(is_transposed=True)
_EXPERTS_IN_OUT = ("gpt_oss", "aria_text")


def experts_in_out(config: dict) -> bool:
    """Whether the family stores its expert stacks [E, in, out] (GPT-OSS, Aria) rather than [E, out, in]: in memory
    the experts module says so (is_transposed); in files only a square stack needs this to be read the right way."""
    return _text(config or {}).get("model_type") in _EXPERTS_IN_OUT


def output_axis(config: dict, ndim: int) -> int:
    """The axis of a stored tensor that holds the output features: 1 for GPT-2's Conv1D weights (in x out),
    else 0 (Linear weights are out x in; biases are 1-D; an expert of a stack is read out x in whatever the
    stack's layout)."""
    return 1 if ndim == 2 and _text(config or {}).get("model_type") == "gpt2" else 0
