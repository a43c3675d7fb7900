"""A model's decoder blocks and the modules LoRA can adapt in them, for every causal-LM family.

Blocks are found generically: the outermost ModuleList holding as many modules as the config has layers
(model.layers, transformer.h, gpt_neox.layers, model.decoder.layers, ...), so families not named here work too.
Adaptable modules are torch Linear and transformers' Conv1D (GPT-2, stored transposed: fan_in_fan_out), as in
peft's "all-linear" target, which also leaves the output head out. A mixture-of-experts block adds parameters
that peft adapts through target_parameters: transformers 5's 3-D expert stacks (Qwen3MoeExperts.gate_up_proj
[E, 2I, H], targeted as experts.gate_up_proj, the name displacement gives them) and a router that is not a Linear
(TopKRouter.weight, targeted by the router's own name: gate, router).
"""

from __future__ import annotations

import re

from torch import nn
from transformers.pytorch_utils import Conv1D

from mechdiag.errors import UserError

ADAPTABLE = (nn.Linear, Conv1D)
# the block index in a module or tensor name: the first numeric path component (model.layers.3.mlp ->3)
_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def n_layers_of(config) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    text = getattr(config, "text_config", None)
    return n_layers_of(text) if text is not None and text is not config else None


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, ModuleList) of the decoder blocks: the outermost list whose length is the config's depth,
    else the outermost non-empty ModuleList."""
    want = n_layers_of(getattr(model, "config", None))
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    pool = [(n, m) for n, m in lists if len(m) == want] or lists
    if not pool:
        raise UserError(f"cannot find the decoder blocks of {type(model).__name__}")
    return min(pool, key=lambda nm: nm[0].count("."))


def layer_index(name: str) -> int | None:
    """The block index in a module or tensor name (model.layers.3.mlp.up_proj.weight -> 3), None outside."""
    m = _INDEX.search(name)
    return int(m.group(1)) if m else None


def is_adaptable(module: nn.Module) -> bool:
    return isinstance(module, ADAPTABLE)


def short_name(qualified: str, siblings: set[str] | None = None) -> str:
    """The module name users target: its last component, qualified by its parent where one family uses the same
    name twice in a block (GPT-2's attn.c_proj and mlp.c_proj)."""
    parts = qualified.split(".")
    if len(parts) > 1 and siblings is not None and parts[-1] in siblings:
        return ".".join(parts[-2:])
    return parts[-1]


def adaptable_modules(model: nn.Module) -> list[tuple[str, int, str]]:
    """(qualified name, layer, target name) of every Linear / Conv1D inside the decoder blocks."""
    path, _ = find_blocks(model)
    found = []
    for name, mod in model.named_modules():
        if is_adaptable(mod) and name.startswith(path + "."):
            rest = name[len(path) + 1:]
            found.append((name, int(rest.split(".", 1)[0]), rest.split(".", 1)[1] if "." in rest else rest))
    # a last component used under two parents in one block is ambiguous: qualify it by its parent
    by_last: dict[str, set[str]] = {}
    for _, layer, rest in found:
        if layer == found[0][1]:
            by_last.setdefault(rest.rsplit(".", 1)[-1], set()).add(rest)
    twice = {last for last, rests in by_last.items() if len(rests) > 1}
    return [(name, layer, short_name(rest, twice)) for name, layer, rest in found]


def adaptable_parameters(model: nn.Module) -> list[tuple[str, int, str]]:
    """(qualified parameter name, layer, target name) of the parameters inside the blocks that LoRA adapts as
    parameters (peft's target_parameters): 3-D expert stacks (model.layers.0.mlp.experts.gate_up_proj ->
    experts.gate_up_proj) and the 2-D weight of a router that is not a Linear (model.layers.0.mlp.gate.weight ->
    gate)."""
    path, _ = find_blocks(model)
    found = []
    for name, mod in model.named_modules():
        if is_adaptable(mod) or not name.startswith(path + "."):
            continue
        rest = name[len(path) + 1:]
        layer, last = int(rest.split(".", 1)[0]), name.rsplit(".", 1)[-1]
        for pname, p in mod.named_parameters(recurse=False):
            if p.ndim == 3:
                found.append((f"{name}.{pname}", layer, f"{last}.{pname}"))
            elif p.ndim == 2 and pname == "weight" and "router" in type(mod).__name__.lower():
                found.append((f"{name}.{pname}", layer, last))
    return found


def target_names(model: nn.Module) -> list[str]:
    """The target names LoRA may use on this model, in block order: modules, then expert stacks and routers."""
    return list(dict.fromkeys([t for _, _, t in adaptable_modules(model)]
                              + [t for _, _, t in adaptable_parameters(model)]))


def is_router(target: str) -> bool:
    """A router target (gate, router), as opposed to an expert stack (experts.gate_up_proj)."""
    return "." not in target


def final_norm(model: nn.Module) -> nn.Module:
    """The norm the model applies after its last block (the logit lens reads head(norm(h)))."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for owner in (decoder, getattr(model, "transformer", None), model):
        for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm", "norm_f", "layer_norm"):
            m = getattr(owner, name, None) if owner is not None else None
            if isinstance(m, nn.Module):
                return m
    raise UserError(f"cannot find the final norm of {type(model).__name__} (needed for the logit lens)")


def logit_softcap(config) -> float | None:
    """The cap of cap * tanh(z / cap) a family applies to its logits, under its own name (Gemma-2/3
    final_logit_softcapping, RecurrentGemma logits_soft_cap); None without one."""
    text = getattr(config, "text_config", None) or config
    for key in ("final_logit_softcapping", "logits_soft_cap"):
        cap = getattr(text, key, None)
        if isinstance(cap, (int, float)) and cap:
            return float(cap)
    return None


def head_transform(config, logits):
    """The model's own transform after its head: soft-capping (logit_softcap), Cohere's logit_scale, Granite's
    logits_scaling (the lens must end where the model's logits do)."""
    text = getattr(config, "text_config", None) or config
    cap = logit_softcap(config)
    scale = getattr(text, "logit_scale", None)
    div = getattr(text, "logits_scaling", None)
    if isinstance(scale, (int, float)) and getattr(text, "model_type", "").startswith("cohere"):
        logits = logits * scale
    if isinstance(div, (int, float)) and div != 1:
        logits = logits / div
    if cap:
        logits = (logits / cap).tanh() * cap
    return logits
