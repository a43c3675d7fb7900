"""LoRA on chosen layers x modules (peft), and the exact list of modules it trains (for --dry-run)."""

from __future__ import annotations

import contextlib

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.tuners.lora import LoraLayer

from mechdiag import blocks
from mechdiag.config import ALL_MODULES, LoraConfig, parse_layers
from mechdiag.errors import UserError, first_line
from mechdiag.weights import tensor_site


def n_layers(model) -> int:
    return len(blocks.find_blocks(model)[1])


def default_targets(model) -> list[str]:
    """The study's module set where the family has all of it, else peft's "all-linear": every Linear / Conv1D
    in the blocks (GPT-2 c_attn..., Phi-3 qkv_proj / gate_up_proj, NeoX query_key_value, Nemotron without gate);
    plus a mixture-of-experts' expert stacks (experts.gate_up_proj, experts.down_proj: the MLP Linears before
    transformers 5 stacked them), not its router (all-linear leaves a TopKRouter out; name `gate` to adapt it)."""
    linear = list(dict.fromkeys(t for _, _, t in blocks.adaptable_modules(model)))
    stacks = list(dict.fromkeys(t for _, _, t in blocks.adaptable_parameters(model) if not blocks.is_router(t)))
    return (list(ALL_MODULES) if set(ALL_MODULES) <= set(linear) else linear) + stacks


def resolve(model, lora: LoraConfig) -> tuple[list[str], list[int]]:
    """Validated (target_modules, layer indices) for this model; the default targets fit the family."""
    known = blocks.target_names(model)
    wanted = default_targets(model) if list(lora.target_modules) == list(ALL_MODULES) else list(lora.target_modules)
    missing = [m for m in wanted if m not in known and not any(k.endswith("." + m) for k in known)]
    if missing:
        raise UserError(f"lora.target_modules: the model has no module {', '.join(map(repr, missing))}; its "
                        f"adaptable modules are {', '.join(known) or 'none'}")
    return wanted, parse_layers(lora.layers, n_layers(model))


def peft_config(model, lora: LoraConfig) -> PeftLoraConfig:
    """peft's LoraConfig for our lora section on this model (both backends): Linear / Conv1D targets as
    target_modules on the chosen layers, expert stacks and routers as target_parameters, named in full for the
    chosen layers (peft's layers_to_transform does not apply to parameters). `lora.target_modules` becomes the
    modules it really adapts (the family's defaults resolved): what config.yaml records and every reader filters
    by."""
    names, layers = resolve(model, lora)
    lora.target_modules = names
    chosen = set(layers)
    params = [(q, t) for q, layer, t in blocks.adaptable_parameters(model) if t in names and layer in chosen]
    modules = [n for n in names if n not in {t for _, t in params}]
    if params and lora.dropout:  # peft's ParamWrapper cannot drop out its input (x is not factored out of B A x)
        raise UserError(f"lora.dropout={lora.dropout}: LoRA on {params[0][1]} (an expert stack / router, peft's "
                        "target_parameters) needs lora.dropout=0")
    path, _ = blocks.find_blocks(model)
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_rslora=lora.use_rslora,
                          target_modules=_unwidened(model, modules, chosen),
                          target_parameters=[q for q, _ in params] or None,
                          layers_to_transform=layers, layers_pattern=path.rsplit(".", 1)[-1], bias="none",
                          task_type="CAUSAL_LM",
                          fan_in_fan_out=any(isinstance(m, blocks.Conv1D) for m in model.modules()))


def _unwidened(model, modules: list[str], chosen: set[int]) -> list[str]:
    """Module targets peft adapts as asked. peft >= 0.22 reads a module name that is also a parameter's name
    outside the Linears (qwen2_moe's down_proj: the shared expert's Linear and experts.down_proj, the routed
    stack) as both, the stack on every layer (its transformers-4 reading); such a name is given as the full paths
    of its Linears on the chosen layers, which only they match."""
    params = {pname for _, mod in model.named_modules() if not blocks.is_adaptable(mod)
              for pname, _ in mod.named_parameters(recurse=False)}
    out = []
    for m in modules:
        if m.rsplit(".", 1)[-1] in params:
            out += [name for name, layer, t in blocks.adaptable_modules(model) if t == m and layer in chosen]
        else:
            out.append(m)
    return out


@contextlib.contextmanager
def peft_refusals(pcfg: PeftLoraConfig):
    """peft's refusal of some targets on some families (out_proj, conv1d on Mamba), raised while it wraps the
    model (here, or inside TRL's GRPOTrainer), as one UserError line."""
    try:
        yield
    except ValueError as e:
        if not str(e).startswith("[PEFT:"):
            raise
        raise UserError(f"lora.target_modules {sorted(pcfg.target_modules or [])}: peft cannot adapt them on this "
                        f"model: {first_line(e)} (set lora.target_modules to the modules it can)") from e


def apply_lora(model, lora: LoraConfig):
    """Wrap `model` with a peft LoRA adapter on the chosen layers x modules; only the factors train."""
    pcfg = peft_config(model, lora)
    with peft_refusals(pcfg):
        return get_peft_model(model, pcfg)


def _is_param_lora(mod) -> bool:
    """peft's ParamWrapper (target_parameters): LoRA on one parameter of its base module (an expert stack)."""
    return hasattr(mod, "get_param") and hasattr(mod, "parameter_name")


def site_name(name: str, mod) -> str:
    """The name lora_modules gives the LoRA layer `mod` at `name` in the peft model: the module's path, or for
    a parameter's LoRA the parameter's (model.layers.0.mlp.experts.gate_up_proj: peft nests one wrapper per
    parameter on the same module, .base_layer each)."""
    short = name.removeprefix("base_model.model.")
    return short.replace(".base_layer", "") + "." + mod.parameter_name if _is_param_lora(mod) else short


def lora_modules(model) -> list[dict]:
    """The exact modules carrying a LoRA adapter: name, layer, module, shape, trainable parameters."""

    rows = []
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and _is_param_lora(mod):  # one wrapper per parameter, nested on one module
            short = site_name(name, mod)
            params = sum(p.numel() for m in (mod.lora_A, mod.lora_B) for p in m.parameters())
            rows.append({"name": short, "layer": blocks.layer_index(short), "module": tensor_site(short)[1],
                         "in": int(mod.in_features), "out": int(mod.out_features), "params": params})
        elif isinstance(mod, LoraLayer) and hasattr(mod, "base_layer"):
            short = name.removeprefix("base_model.model.")
            base = mod.get_base_layer()
            params = sum(p.numel() for n, p in mod.named_parameters() if "lora_" in n)
            out_f, in_f = base.weight.shape[::-1] if getattr(mod, "fan_in_fan_out", False) else base.weight.shape
            rows.append({"name": short, "layer": blocks.layer_index(short), "module": tensor_site(short)[1],
                         "in": int(in_f), "out": int(out_f), "params": params})
    return rows


def trainable_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def merge_into(peft_model, plain):
    """Write the effective weights W + s B A of every LoRA module into `plain`, an adapter-free copy of the base,
    and return it: the module that decodes (`peft_model` itself when there is no copy, plain None).

    Sampling through plain Linear layers skips peft's per-module overhead (about 30% of decode time on small
    models); the product B A is formed here only because the sampler needs the weight itself.
    """
    if plain is None:
        return peft_model
    targets = dict(plain.named_modules())
    for name, mod in peft_model.named_modules():
        if not (isinstance(mod, LoraLayer) and hasattr(mod, "base_layer")):
            continue
        if _is_param_lora(mod):  # an expert stack / router: peft's own delta, [E, out, in] as the stack stores it
            dst = getattr(targets[name.removeprefix("base_model.model.").replace(".base_layer", "")],
                          mod.parameter_name)
            w = mod.get_param()
            dst.copy_(w + sum(mod.get_delta_weight(a) for a in mod.active_adapters).to(w.dtype))
            continue
        dst = targets[name.removeprefix("base_model.model.")]
        w = mod.get_base_layer().weight
        delta = sum(mod.scaling[a] * (mod.lora_B[a].weight @ mod.lora_A[a].weight) for a in mod.active_adapters)
        if getattr(mod, "fan_in_fan_out", False):  # Conv1D stores the weight as in x out
            delta = delta.T
        dst.weight.copy_(w + delta.to(w.dtype))
    return plain
