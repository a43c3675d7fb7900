"""Logical parts of fused modules, as index sets over their output features, and the study's module roles.

A fused module stores several projections in one tensor: Phi-3's qkv_proj (q, then k, then v), GPT-NeoX's
query_key_value (per head [q, k, v]: the [heads, 3, head_dim] view of modeling_gpt_neox), GPT-2's c_attn (Conv1D:
q, k, v thirds of its output columns) and gate_up_proj (gate half, then up half). Each part is a set of output
features; `displacement` reports it beside the stored tensor as MODULE.PART (qkv_proj.v), from the LoRA factors
restricted to the part's rows of B (the slice of B A is B[rows] A), never from the product.

A part row carries `part_of` (the stored module): sums over whole tensors (per layer, the whole model) leave part
rows out, or they would count a fused tensor twice.
"""

from __future__ import annotations

import torch

# the study's module set, by role; a family's own name of each role (fused parts included)
ROLES = {
    "q_proj": ("q_proj", "qkv_proj.q", "query_key_value.q", "c_attn.q"),
    "k_proj": ("k_proj", "qkv_proj.k", "query_key_value.k", "c_attn.k"),
    "v_proj": ("v_proj", "qkv_proj.v", "query_key_value.v", "c_attn.v"),
    "o_proj": ("o_proj", "dense", "attn.c_proj", "out_proj"),
    "gate_proj": ("gate_proj", "gate_up_proj.gate", "experts.gate_proj", "experts.w1"),  # Mixtral: w1, w3, w2
    "up_proj": ("up_proj", "gate_up_proj.up", "dense_h_to_4h", "c_fc", "experts.up_proj", "experts.w3"),
    "down_proj": ("down_proj", "dense_4h_to_h", "mlp.c_proj", "experts.down_proj", "experts.w2"),
}


def family_name(role: str, modules) -> str | None:
    """The name this model gives the study's `role` (v_proj -> qkv_proj.v on Phi-3), among `modules`; None if
    the model has none."""
    have = set(modules)
    return next((m for m in ROLES.get(role, (role,)) if m in have), None)


def _text(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def output_parts(module: str, out_features: int, config: dict) -> list[tuple[str, torch.Tensor]]:
    """[(part name, indices of its output features)] of a fused module with `out_features` outputs, [] when the
    module is not fused or its layout does not fit the config (then only the stored tensor is reported)."""
    cfg = _text(config or {})
    kind = cfg.get("model_type")
    hidden = cfg.get("hidden_size") or cfg.get("n_embd")
    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    if module == "gate_up_proj" and out_features % 2 == 0:
        half = out_features // 2
        return [("gate", torch.arange(0, half)), ("up", torch.arange(half, out_features))]
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return []
    head_dim = cfg.get("head_dim") or hidden // heads
    if module == "qkv_proj":
        kv = cfg.get("num_key_value_heads") or heads
        q, k = heads * head_dim, kv * head_dim
        if out_features != q + 2 * k:
            return []
        return [("q", torch.arange(0, q)), ("k", torch.arange(q, q + k)), ("v", torch.arange(q + k, q + 2 * k))]
    if module == "query_key_value" and kind == "gpt_neox" and out_features == 3 * heads * head_dim:
        per_head = torch.arange(heads)[:, None] * 3 * head_dim
        return [(p, (per_head + j * head_dim + torch.arange(head_dim)[None, :]).reshape(-1))
                for j, p in enumerate("qkv")]
    if module == "c_attn" and kind == "gpt2" and out_features == 3 * hidden:
        return [(p, torch.arange(j * hidden, (j + 1) * hidden)) for j, p in enumerate("qkv")]
    return []


def output_axis(config: dict, ndim: int) -> int:
    """The axis of a stored tensor that holds the output features: 1 for GPT-2's Conv1D weights (in x out),
    else 0 (Linear weights are out x in; biases are 1-D)."""
    return 1 if ndim == 2 and _text(config or {}).get("model_type") == "gpt2" else 0
