"""The engines the multi-process tests run on CPU (gloo), and the one shim that lets accelerate pick them there.

accelerate selects FSDP only on GPU-like devices (AcceleratorState: MULTI_GPU, MULTI_XPU, ...) and DeepSpeed only
when not on CPU, so on a CPU machine a run asking for either silently becomes plain DDP. `allow_cpu_engine` makes
accelerate take the branch it takes on a GPU machine, with gloo and the CPU device: the wrapping (FSDP1 FlatParams,
FSDP2 DTensors, DeepSpeed's ZeRO engine) and its collectives are then the real libraries' code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENGINES = ("ddp", "fsdp1", "fsdp1_flat", "fsdp2", "zero2", "zero3")  # fsdp1_flat: use_orig_params=False
NAMES = {"fsdp1_flat": "fsdp1"}  # mechdiag.distributed's name of each (the others: the same)
ACCELERATE = {"ddp": ("DistributedType.MULTI_CPU", None, None), "fsdp1": ("DistributedType.FSDP", 1, None),
              "fsdp1_flat": ("DistributedType.FSDP", 1, None), "fsdp2": ("DistributedType.FSDP", 2, None),
              "zero2": ("DistributedType.DEEPSPEED", None, 2), "zero3": ("DistributedType.DEEPSPEED", None, 3)}
LAYER = "LlamaDecoderLayer"  # the bundled base's decoder layer: FSDP's wrapping unit


def fsdp_config(engine: str) -> dict:
    return {"version": 2 if engine == "fsdp2" else 1, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": [LAYER],
            **({"reshard_after_forward": True} if engine == "fsdp2" else
               {"use_orig_params": engine == "fsdp1", "sync_module_states": False})}  # same seed: same weights


def deepspeed_config(engine: str) -> dict:
    return {"zero_optimization": {"stage": 3 if engine == "zero3" else 2}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": False},
            "fp16": {"enabled": False}}


def trl_flags(engine: str) -> list[str]:
    """`mechdiag train --backend trl` flags selecting the engine (GRPOConfig fields as --trl KEY=YAML)."""
    return [x for k, v in trainer_args(engine).items() if k != "use_cpu"
            for x in ("--trl", f"{k}={json.dumps(v)}")]


def trainer_args(engine: str) -> dict:
    """GRPOConfig fields of the engine (TrainingArguments' own fsdp / deepspeed fields)."""
    if engine == "ddp":
        return {"use_cpu": True}
    if engine.startswith("fsdp"):
        return {"use_cpu": True, "fsdp": "full_shard auto_wrap", "fsdp_config": fsdp_config(engine)}
    return {"use_cpu": False, "bf16": False, "deepspeed": deepspeed_config(engine)}


def allow_cpu_engine(engine: str) -> None:
    """Patch accelerate (this process only) so FSDP and DeepSpeed are selected on CPU as they are on a GPU."""
    if engine == "ddp":
        return
    import torch  # noqa: PLC0415 - the shim is applied inside the launched process only
    from accelerate import state as S  # noqa: PLC0415 - as above
    from accelerate.utils import DistributedType  # noqa: PLC0415 - as above

    if engine.startswith("zero"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.ops  # noqa: PLC0415 - as above

        # DeepSpeed's CPU shared-memory all-reduce is a C++ op compiled at first use (minutes on 2 cores); gloo
        # carries the same collectives
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        prepare = S.PartialState._prepare_backend

        def cpu_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            out = prepare(self, cpu, sagemaker_dp, backend)
            if out[1] == DistributedType.NO and int(os.environ.get("LOCAL_RANK", -1)) != -1:
                return "gloo", DistributedType.MULTI_CPU  # what accelerate picks for CPU processes
            return out

        S.PartialState._prepare_backend = cpu_backend
        return
    init = S.AcceleratorState.__init__

    def fsdp_on_cpu(self, *a, fsdp_plugin=None, **kw):
        init(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = S.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # accelerate names the CPU device cpu:0 (as cuda:0); FSDP1 compares it with its compute device, "cpu"
            self.device = S.PartialState._shared_state["device"] = torch.device("cpu")
            torch.distributed.barrier()

    S.AcceleratorState.__init__ = fsdp_on_cpu
    if engine in ("fsdp1", "fsdp1_flat"):
        _host_copy_on_cpu()


def _host_copy_on_cpu() -> None:
    """FSDP1's offload_to_cpu (accelerate's FULL_STATE_DICT: get_state_dict, save_fsdp_model) moves the gathered
    flat parameter to the host, then frees the device copy. On a GPU `.to("cpu")` is a copy; on CPU it is the same
    storage, which FSDP then frees under it (torch 2.13: a segfault cloning the use_orig_params views, a
    "storage of size 0" error for flat parameters). Make the copy a GPU makes, inside that one context."""
    import contextlib  # noqa: PLC0415 - the shim is applied inside the launched process only
    import functools  # noqa: PLC0415 - as above

    from torch.distributed.fsdp._flat_param import FlatParamHandle  # noqa: PLC0415 - as above

    to_cpu = FlatParamHandle.to_cpu

    @contextlib.contextmanager
    def to_cpu_copying(self):
        self.flat_param_to = functools.partial(FlatParamHandle.flat_param_to, self, copy=True)
        try:
            with to_cpu(self):
                del self.flat_param_to
                yield
        finally:
            self.__dict__.pop("flat_param_to", None)

    FlatParamHandle.to_cpu = to_cpu_copying


def record_rank(out: Path, accelerator, **extra) -> None:
    """Each rank's own file: its rank, the world size and the engine its Accelerator ran."""
    import torch  # noqa: PLC0415 - inside the launched process

    d = out / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    info = {"rank": rank, "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized()
            else 1, "distributed_type": str(accelerator.distributed_type),
            "fsdp_version": getattr(accelerator.state.fsdp_plugin, "fsdp_version", None)
            if getattr(accelerator.state, "fsdp_plugin", None) else None,
            "zero_stage": accelerator.state.deepspeed_plugin.zero_stage if accelerator.state.deepspeed_plugin else None,
            **extra}
    (d / f"{rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":  # python -m tests.engines ENGINE ARGS...: `mechdiag ARGS` with the engine allowed on CPU
    import sys

    allow_cpu_engine(sys.argv[1])
    from mechdiag.cli import main

    sys.argv = ["mechdiag", *sys.argv[2:]]
    main()
