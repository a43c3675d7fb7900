"""LoRA on chosen layers x modules (peft), and the exact list of modules it trains (for --dry-run)."""

from __future__ import annotations

import difflib
import re

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.tuners.lora import LoraLayer

from mechdiag.config import LoraConfig, parse_layers
from mechdiag.errors import UserError

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def n_layers(model) -> int:
    n = getattr(model.config, "num_hidden_layers", None)
    if n is None:
        raise UserError("the model config has no num_hidden_layers; cannot resolve lora.layers")
    return int(n)


def linear_names(model) -> set[str]:
    """Short names of the Linear modules inside the decoder layers (what target_modules may name)."""
    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and _LAYER.search(name + ".")}


def resolve(model, lora: LoraConfig) -> tuple[list[str], list[int]]:
    """Validated (target_modules, layer indices) for this model."""
    known = linear_names(model)
    for m in lora.target_modules:
        if m not in known:
            near = difflib.get_close_matches(m, sorted(known), n=1)
            raise UserError(f"lora.target_modules: the model has no module {m!r}"
                            + (f" (did you mean {near[0]}?)" if near else f"; it has {', '.join(sorted(known))}"))
    return list(lora.target_modules), parse_layers(lora.layers, n_layers(model))


def apply_lora(model, lora: LoraConfig):
    """Wrap `model` with a peft LoRA adapter on the chosen layers x modules; only the factors train."""

    modules, layers = resolve(model, lora)
    pcfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_rslora=lora.use_rslora,
                          target_modules=modules, layers_to_transform=layers, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, pcfg)


def lora_modules(model) -> list[dict]:
    """The exact modules carrying a LoRA adapter: name, layer, module, shape, trainable parameters."""

    rows = []
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and hasattr(mod, "base_layer"):
            m = _LAYER.search(name + ".")
            base = mod.get_base_layer()
            params = sum(p.numel() for n, p in mod.named_parameters() if "lora_" in n)
            rows.append({"name": name.removeprefix("base_model.model."), "layer": int(m.group(1)) if m else None,
                         "module": name.rsplit(".", 1)[-1], "in": base.in_features, "out": base.out_features,
                         "params": params})
    return rows


def trainable_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def merge_into(peft_model, plain) -> None:
    """Write the effective weights W + s B A of every LoRA module into `plain`, an adapter-free copy of the base.

    Sampling through plain Linear layers skips peft's per-module overhead (about 30% of decode time on small
    models); the product B A is formed here only because the sampler needs the weight itself.
    """

    targets = dict(plain.named_modules())
    for name, mod in peft_model.named_modules():
        if not (isinstance(mod, LoraLayer) and hasattr(mod, "base_layer")):
            continue
        dst = targets[name.removeprefix("base_model.model.")]
        w = mod.get_base_layer().weight
        delta = sum(mod.scaling[a] * (mod.lora_B[a].weight @ mod.lora_A[a].weight) for a in mod.active_adapters)
        dst.weight.copy_(w + delta.to(w.dtype))
