"""The training engine a model runs under (single process, DDP, FSDP1, FSDP2, DeepSpeed ZeRO-2/3) and what the
recorders need from it, with collectives every rank joins in the same order.

    Engine.of(model)        the engine of the model a trainer hands its callbacks (FSDP1: the wrapped root)
    engine.sharded          parameters live in shards (FSDP1, FSDP2, ZeRO-3): every rank computes each figure
                            together, the writer rank writes it; replicated engines compute on the writer alone
    engine.lora_modules()   (name, module) of each LoRA layer, the module's parameters whole while it is yielded:
                            FSDP1 one wrapped unit at a time (summon_full_params), ZeRO-3 one module at a time
                            (GatheredParameters), FSDP2 one tensor at a time (DTensor.full_tensor, see `full`)
    engine.forward(model)   the context every rank runs a probe's forward in (FSDP1: the root's own parameters
                            summoned, the wrapped layers unshard themselves, as TRL generates)

The base weights are frozen: their squared norms are computed once (engine.base_sq, by name) from the gathered
weight, with the checkpoint path's arithmetic, so recorded and offline figures agree.
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch

_WRAPPERS = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
SHARDED = ("fsdp1", "fsdp2", "zero3", "dtensor")
_GRAD_FREE = [False]  # inside Engine.forward() of a sharded model: probes run under no_grad, not inference_mode


def inference_mode(fn):
    """torch.inference_mode around fn, or torch.no_grad inside a sharded engine's forward(): FSDP2 and ZeRO-3 keep
    the all-gather buffers a forward makes, and an inference tensor among them fails the next training step."""

    @functools.wraps(fn)
    def inner(*a, **kw):
        with torch.no_grad() if _GRAD_FREE[0] else torch.inference_mode():
            return fn(*a, **kw)

    return inner


def clean_name(path: str) -> str:
    """A module path without the engines' wrapper segments (FSDP1's _fsdp_wrapped_module, checkpoint wrappers)."""
    return _WRAPPERS.sub("", path)


def _is_lora(mod) -> bool:
    return hasattr(mod, "lora_A") and hasattr(mod, "scaling") and hasattr(mod, "get_base_layer")


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _replicated_name(world: int) -> str:
    """ddp, zero0/1/2 or single, from accelerate's state when a trainer set one up."""
    try:
        from accelerate.state import AcceleratorState  # noqa: PLC0415 - accelerate comes with the trl extra

        state = AcceleratorState()
        plugin = getattr(state, "deepspeed_plugin", None) if state.initialized else None
        if plugin is not None:
            return f"zero{plugin.zero_stage}"
    except (ImportError, AttributeError, ValueError):
        pass
    return "ddp" if world > 1 else "single"


class Engine:
    def __init__(self, name: str, root=None):
        self.name, self.root = name, root
        self.rank, self.world_size = _world()
        self.base_sq: dict[str, float] = {}  # frozen base weights: ||W0||^2 by tensor name, computed once
        self.base_shape: dict[str, tuple] = {}  # their shapes (a fused tensor's parts), by name
        self._root_full = False  # inside forward(): FSDP1's root unit is summoned already

    @property
    def sharded(self) -> bool:
        return self.name in SHARDED

    @classmethod
    def of(cls, model) -> Engine:
        _, world = _world()
        if model is None:
            return cls(_replicated_name(world))
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - torch.distributed loads lazily
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415 - as above
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - as above

        for m in model.modules():
            if isinstance(m, FSDP):
                return cls("fsdp1", m)  # modules() starts at the root: the first FSDP is the outermost
            if isinstance(m, FSDPModule):
                return cls("fsdp2", model)
        if any(isinstance(p, DTensor) for p in model.parameters()):  # tensor parallel: DTensors, gathered the same
            return cls("dtensor", model)
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            return cls("zero3", model)
        return cls(_replicated_name(world), model)

    # ---- parameters -----------------------------------------------------------------------------------
    @staticmethod
    def full(t: torch.Tensor) -> torch.Tensor:
        """The whole tensor: an FSDP2 DTensor all-gathered (a collective), anything else as it is."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch.distributed loads lazily

        return t.full_tensor() if isinstance(t, DTensor) else t

    def lora_modules(self, model, need_base=lambda name: True):
        """(clean path, module) of each LoRA layer of `model` (the PEFT model), in the same order on every rank,
        its LoRA factors whole while yielded, its base weight too when need_base(path) (ZeRO-3 gathers only
        what is asked; FSDP1 summons the whole unit)."""
        if self.name == "fsdp1":
            yield from self._fsdp1_modules()
        elif self.name == "zero3":
            import deepspeed  # noqa: PLC0415 - deepspeed is an optional extra, loaded only under ZeRO

            for path, mod in model.named_modules():
                if _is_lora(mod):
                    name = clean_name(path)
                    params = [p for n, p in mod.named_parameters() if "lora_" in n]
                    if need_base(name):
                        params.append(mod.get_base_layer().weight)
                    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                        yield name, mod
        else:
            for path, mod in model.named_modules():
                if _is_lora(mod):
                    yield clean_name(path), mod

    def _fsdp1_modules(self):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415 - as in Engine.of

        names = {id(m): clean_name(p) for p, m in self.root.named_modules()}
        for unit in FSDP.fsdp_modules(self.root):
            own, stack = [], [unit.module]
            while stack:  # the unit's own modules: nested FSDP units hold their own parameters
                m = stack.pop()
                if _is_lora(m):
                    own.append(m)
                stack.extend(c for c in reversed(list(m.children())) if not isinstance(c, FSDP))
            if not own:
                continue
            # recurse: accelerate's policy for PEFT models wraps the trainable lora_A / lora_B in units of their own
            summoned = unit is self.root and self._root_full
            with contextlib.nullcontext() if summoned else \
                    FSDP.summon_full_params(unit, recurse=True, writeback=False):
                for m in sorted(own, key=lambda m: names[id(m)]):
                    yield names[id(m)], m

    # ---- forwards --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self):
        """Every rank runs the probe's forwards inside this, on the same inputs."""
        if not self.sharded:
            yield
            return
        _GRAD_FREE[0] = True
        try:
            if self.name == "fsdp1":
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415 - as in Engine.of

                with FSDP.summon_full_params(self.root, recurse=False, writeback=False):
                    self._root_full = True
                    try:
                        yield
                    finally:
                        self._root_full = False
            else:  # FSDP2 and ZeRO-3 modules gather their own weights in forward (vocab.head_of defers to it)
                yield
        finally:
            _GRAD_FREE[0] = False

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()
