"""Displacement rows of a PEFT model in memory, the trainers' records (native trainer and TRL callback): the
same figures as `mechdiag displacement BASE ADAPTER` on the saved adapter, from the factors of each LoRA layer
(or, for any other peft form, its float64 delta from peft's merge: mechdiag.adapters.module_delta).
"""

from __future__ import annotations

import math
import weakref

import torch

from mechdiag import adapters
from mechdiag.lowrank import geometry_pass, lowrank_factors, lowrank_sumsq, rel_fro, restrict, single_thread, sumsq
from mechdiag.parts import output_axis, output_parts
from mechdiag.weights import tensor_site

_REF_SQ_CACHE: dict[tuple, tuple] = {}  # (id(frozen base weight), part) -> (weakref, version, ||W||^2)


class _Term:
    __slots__ = ("scale", "B", "A")

    def __init__(self, scale, B, A):
        self.scale, self.B, self.A = scale, B, A


def _base_sumsq(w: torch.Tensor, key: str = "", get=None) -> float:
    """||W||^2 of a frozen base weight, or of the slice of it get() returns (a part, one expert) named `key`,
    cached while the weight is unchanged."""
    cache = (id(w), key)
    hit = _REF_SQ_CACHE.get(cache)
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    x = (w if get is None else get()).detach()
    value = sumsq(x.to(torch.float32))  # the checkpoint path's arithmetic, so both give the same numbers
    _REF_SQ_CACHE[cache] = (weakref.ref(w, lambda _, k=cache: _REF_SQ_CACHE.pop(k, None)), w._version, value)
    return value


def lora_rows(model, geometry: bool = False, engine=None) -> list[dict]:
    """One row per LoRA-wrapped weight of an in-memory PEFT model: reference = base weight, tuned = base + the
    active adapters' s*B@A. Factors only, float64; ||W0|| is cached while the base weight is unchanged.
    geometry: also overlap_k, subspace_overlap and intruders, by the routine of `displacement --spectral` (one
    pass over each base weight: the trainers ask for it at the final step only).
    engine: a mechdiag.distributed.Engine when the model is sharded (every rank calls this together; the
    parameters are gathered a module at a time and the frozen base's norms computed once, by name)."""
    with torch.no_grad(), single_thread():
        return _lora_rows(model, geometry, engine)


def _lora_rows(model, geometry: bool, engine=None) -> list[dict]:
    config = getattr(model, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else {}
    rows = []
    if engine is None:
        modules = ((p, m) for p, m in model.named_modules() if _is_tuner_layer(m))
        full = _same
    else:
        cache = engine.base_sq
        modules = engine.lora_modules(model, need_base=lambda p: geometry or _row_name(p) not in cache)
        full = engine.full
    for path, mod in modules:
        if getattr(mod, "merged", False):
            raise ValueError(f"{path}: adapter is merged into the base weight; unmerge before lora_rows")
        if hasattr(mod, "get_param") and hasattr(mod, "num_experts"):  # peft target_parameters (MoE experts)
            rows.extend(_expert_rows(path, mod, config, geometry))
            continue
        if not _plain_lora_layer(mod):  # DoRA, lora_bias, any other peft type: its dense delta (mechdiag.adapters)
            if engine is not None:
                raise RuntimeError(f"{path}: a {type(mod).__name__} adapter is measured from its dense delta, which "
                                   "needs the whole weight; record it unsharded")
            rows.extend(_dense_rows(path, mod, config))
            continue
        terms = _lora_terms(path, mod, full)
        if not terms:
            continue
        name = _row_name(path)
        layer, module = tensor_site(name)
        base_w = None
        if engine is None:
            base_w = mod.get_base_layer().weight
            if base_w.dim() < 2 or not base_w.numel():  # ZeRO-3 / FSDP partition: ||W0|| would read 0
                raise RuntimeError(f"{path}: the base weight is sharded; record under mechdiag.distributed.Engine")
        elif geometry or name not in engine.base_sq:
            base_w = full(mod.get_base_layer().weight)
            engine.base_shape[name] = tuple(base_w.shape)
        shape = tuple(base_w.shape) if base_w is not None else engine.base_shape[name]
        axis = output_axis(config, len(shape))
        sites = [(name, module, "", None)] + [(f"{name}[{part}]", f"{module}.{part}", part, idx)
                                              for part, idx in output_parts(module, shape[axis], config)]
        for row_name, row_module, part, idx in sites:
            get, sub = None, terms
            if idx is not None:
                get = None if base_w is None else (lambda w=base_w, i=idx, a=axis: w.index_select(a, i.to(w.device)))
                sub = restrict(terms, idx.to(terms[0].B.device), axis)
            if engine is None:
                ref_sq = _base_sumsq(base_w, part, get)
            else:  # frozen: computed once from the gathered weight, by name
                if row_name not in engine.base_sq:
                    engine.base_sq[row_name] = sumsq((base_w if get is None else get()).detach().to(torch.float32))
                ref_sq = engine.base_sq[row_name]
            row = _lora_row(row_name, layer, row_module, base_w, sub, geometry, ref_sq, get)
            rows.append({**row, "part_of": module} if part else row)
    return rows


def _is_tuner_layer(m) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: PLC0415 - peft loads with the first model

    return isinstance(m, BaseTunerLayer) and hasattr(m, "get_base_layer") and bool(getattr(m, "active_adapters", ()))


def _plain_lora_layer(mod) -> bool:
    """A LoRA layer whose active adapters are all s B A (no DoRA magnitude, no lora_bias): kept as factors."""
    from peft.tuners.adalora import AdaLoraLayer  # noqa: PLC0415
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    if not isinstance(mod, LoraLayer) or isinstance(mod, AdaLoraLayer):
        return False
    variant, lora_bias = getattr(mod, "lora_variant", {}), getattr(mod, "lora_bias", {})
    return not any(variant.get(a) is not None or lora_bias.get(a) for a in mod.active_adapters)


def _dense_rows(path: str, mod, config: dict) -> list[dict]:
    """Rows of a peft layer whose update is not low-rank: its float64 delta from peft's merge (the definition
    displacement replays from the files, mechdiag.adapters.module_delta), the weight, its parts, and its bias when
    the form moves it."""
    dw, db = adapters.module_delta(mod)
    base = mod.get_base_layer()
    name = _row_name(path)
    layer, module = tensor_site(name)
    w = base.weight.detach()
    axis = output_axis(config, w.dim())
    rows = []
    sites = [(name, module, "", None)] + [(f"{name}[{part}]", f"{module}.{part}", part, idx)
                                          for part, idx in output_parts(module, w.shape[axis], config)]
    for row_name, row_module, part, idx in sites:
        get = None if idx is None else (lambda i=idx: w.index_select(axis, i.to(w.device)))
        d = dw if idx is None else dw.index_select(axis, idx.to(dw.device))
        ref_fro, delta_fro = math.sqrt(_base_sumsq(w, part, get)), float(d.norm())
        row = {"name": row_name, "layer": layer, "module": row_module, "ref_fro": ref_fro, "delta_fro": delta_fro,
               "rel_fro": rel_fro(delta_fro, ref_fro)}
        rows.append({**row, "part_of": module} if part else row)
    if db is not None and bool(db.any()):
        ref_fro, delta_fro = float(base.bias.detach().double().norm()), float(db.norm())
        rows.append({"name": name.removesuffix(".weight") + ".bias", "layer": layer, "module": module,
                     "ref_fro": ref_fro, "delta_fro": delta_fro, "rel_fro": rel_fro(delta_fro, ref_fro)})
    return rows


def _lora_terms(path: str, mod, full) -> list[_Term]:
    """The active adapters' (s, B, A) of a LoRA layer, whole (full() gathers a sharded factor), B A in the
    stored weight's orientation."""
    transposed = bool(getattr(mod, "fan_in_fan_out", False))
    terms = []
    for adapter in mod.active_adapters:
        if adapter in mod.lora_A:
            A, B = mod.lora_A[adapter].weight, mod.lora_B[adapter].weight
            t = transposed
        elif adapter in getattr(mod, "lora_embedding_A", {}):
            A, B, t = mod.lora_embedding_A[adapter], mod.lora_embedding_B[adapter], True
        else:
            continue
        A, B = full(A), full(B)
        if A.dim() != 2 or B.dim() != 2 or not A.numel():  # a shard: a figure from it would be a silent 0
            raise RuntimeError(f"{path}: LoRA factors are sharded (shape {tuple(A.shape)}); record under "
                               "mechdiag.distributed.Engine, which gathers them")
        B, A = (A.T, B.T) if t else (B, A)
        terms.append(_Term(float(mod.scaling[adapter]), B, A))
    return terms


def _lora_row(name, layer, module, base_w, terms, geometry, ref_sq: float, get=None) -> dict:
    """One row of lora_rows: the weight base_w (||W||^2 = ref_sq), or the slice get() returns (a part, an expert),
    its update from the (restricted) terms."""
    B, A = lowrank_factors(terms)
    delta_sq = lowrank_sumsq(B, A)
    ref_fro, delta_fro = math.sqrt(ref_sq), math.sqrt(max(delta_sq, 0.0))
    row = {"name": name, "layer": layer, "module": module, "ref_fro": ref_fro, "delta_fro": delta_fro,
           "rel_fro": rel_fro(delta_fro, ref_fro)}
    if geometry:
        nonfinite = not (math.isfinite(ref_sq) and math.isfinite(delta_sq))
        w = base_w if get is None else get()
        row.update(geometry_pass(lambda start, stop, w=w: w[start:stop].to("cpu"), None, tuple(w.shape),
                             None, (B.cpu(), A.cpu()), max(delta_sq, 0.0), nonfinite, None))
    return row


def _expert_rows(path: str, mod, config: dict, geometry: bool) -> list[dict]:
    """Rows of a LoRA on a parameter (peft's ParamWrapper, target_parameters): one per expert of a 3-D expert
    stack [E, ., .], named as transformers saves the experts (mlp.experts.5.gate_up_proj.weight), with the fused
    parts of each. peft's layout: lora_A (E*r, in) -> A_e (r, in); lora_B (out, r*E) -> B_e = B[:, :, e] after
    (out, r, E); each expert's update is B_e A_e out x in: a stack stored [E, in, out] (is_transposed, peft did not
    swap it: GPT-OSS) is read per expert as its transpose, out x in as displacement reads the files."""
    param = mod.get_param()
    swapped = bool(getattr(mod, "_did_swap_in_out_features", False)) or param.ndim == 2
    stack = param[None] if param.ndim == 2 else param if swapped else param.transpose(1, 2)
    E = stack.shape[0]
    per_expert: list[list[_Term]] = [[] for _ in range(E)]
    for name in mod.active_adapters:
        if name not in mod.lora_A:
            continue
        A, B = mod.lora_A[name].weight, mod.lora_B[name].weight
        A3 = A.reshape(E, -1, A.shape[-1])  # (E, r, in)
        B3 = B.reshape(B.shape[0], -1, E).permute(2, 0, 1)  # (E, out, r)
        for e in range(E):
            per_expert[e].append(_Term(float(mod.scaling[name]), B3[e], A3[e]))
    prefix = path.removeprefix("base_model.model.").replace(".base_layer", "")  # peft nests one wrapper per parameter
    rows = []
    for e, terms in enumerate(per_expert):
        if not terms:
            continue
        name = f"{prefix}.{e}.{mod.parameter_name}.weight" if param.ndim == 3 else f"{prefix}.{mod.parameter_name}"
        layer, module = tensor_site(name)
        expert = e if param.ndim == 3 else None
        get = lambda e=e: stack[e]  # noqa: E731 - one expert's slice, for its norm and geometry
        row = _lora_row(name, layer, module, param, terms, geometry, _base_sumsq(param, f"expert{e}", get), get)
        rows.append({**row, "expert": expert})
        for part, idx in output_parts(module.rsplit(".", 1)[-1], stack.shape[1], config):
            idx = idx.to(param.device)
            get = lambda e=e, i=idx: stack[e].index_select(0, i)  # noqa: E731 - the part of one expert
            sub = _lora_row(f"{name}[{part}]", layer, f"{module}.{part}", param, restrict(terms, idx, 0), geometry,
                            _base_sumsq(param, f"expert{e}.{part}", get), get)
            rows.append({**sub, "part_of": module, "expert": expert})
    return rows


def _row_name(path: str) -> str:
    return path.removeprefix("base_model.model.") + ".weight"


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
