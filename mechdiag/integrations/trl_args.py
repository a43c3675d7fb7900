"""The GRPOConfig a TRL run really used, read from its training_args.bin without running an arbitrary pickle.

transformers saves TrainingArguments with torch.save (a zip holding one pickle). We unpickle data.pkl with an
Unpickler that admits only the classes such a file holds - TrainingArguments/GRPOConfig and the config objects
and enums inside it - each rebuilt as an inert record (a dict of fields, enums as their values), plus plain
Python types. Unsloth pickles its own subclasses (module UnslothGRPOTrainer or unsloth_compiled_cache.*, class
Unsloth<Name>Config): admitted the same way, as inert records, by name. Anything else (a function, an os call, an
unknown class) stops the read with a UserError, so a hostile file cannot run code here.
"""

from __future__ import annotations

import io
import pickle
import re
import types
import zipfile
from pathlib import Path

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.weights import tensor_site

TRAINING_ARGS = "training_args.bin"

# (module prefix, class name): inert records of their fields
RECORDS = {("trl.", "GRPOConfig"), ("transformers.", "TrainingArguments"), ("transformers.", "AcceleratorConfig"),
           ("accelerate.", "PartialState"), ("accelerate.", "ParallelismConfig")}
# enums (and torch.device): rebuilt as the value they were pickled with
VALUES = {("transformers.", n) for n in ("IntervalStrategy", "SaveStrategy", "HubStrategy", "SchedulerType",
                                         "OptimizerNames", "FSDPOption", "DebugOption")} | \
    {("accelerate.", "DistributedType"), ("torch", "device")}
PLAIN = {("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")}
# Unsloth's compiled trainer modules and their config subclasses (UnslothGRPOConfig, UnslothPPOConfig, ...)
UNSLOTH_MODULE = re.compile(r"^(unsloth_compiled_cache\.)?Unsloth\w*Trainer$")
UNSLOTH_CONFIG = re.compile(r"^Unsloth\w*Config$")
ARGS_KINDS = ("GRPOConfig", "TrainingArguments")  # what a training_args.bin must hold (an Unsloth subclass counts)


class Record:
    """An object rebuilt as its fields only: no class code runs (no __init__, no __setstate__ of its own)."""

    kind = "Record"

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.fields = dict(state) if isinstance(state, dict) else {}


def _value(*args):
    return args[0] if args else None


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if any(module.startswith(p) and name == n for p, n in RECORDS):
            return type(name, (Record,), {"kind": name})
        if UNSLOTH_MODULE.match(module) and UNSLOTH_CONFIG.match(name):
            return type(name, (Record,), {"kind": name.removeprefix("Unsloth"), "unsloth": True})
        if any(module.startswith(p) and name == n for p, n in VALUES):
            return _value
        if (module, name) in PLAIN:
            return {"set": set, "frozenset": frozenset, "OrderedDict": dict}[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not a config class")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("tensor storage in training arguments")


def _plain(v):
    if isinstance(v, Record):
        return {k: _plain(x) for k, x in v.fields.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def read_training_args(path: str | Path) -> dict:
    """The fields of the TrainingArguments/GRPOConfig pickled in `path`, as plain Python values."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                raise UserError(f"{path}: no data.pkl inside (not a torch.save file)")
            data = z.read(names[0])
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{path}: not a torch.save zip file ({e})") from None
    try:
        obj = _Restricted(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise UserError(f"{path}: refused to load it ({e})") from None
    if not isinstance(obj, Record) or obj.kind not in ARGS_KINDS:
        raise UserError(f"{path}: holds no GRPOConfig/TrainingArguments")
    out = _plain(obj)
    if getattr(obj, "unsloth", False):
        out["_unsloth"] = True  # the trainer that pickled it (provenance: source "unsloth")
    return out


def find_training_args(output_dir: Path) -> Path | None:
    """output_dir/training_args.bin, else the newest checkpoint-N's."""
    direct = output_dir / TRAINING_ARGS
    if direct.is_file():
        return direct
    ckpts = sorted((p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    for ck in reversed(ckpts):
        if (ck / TRAINING_ARGS).is_file():
            return ck / TRAINING_ARGS
    return None


def config_from_grpo(args, model=None, reward_names: list[str] | None = None):
    """Our Config as far as a GRPOConfig (and the model's peft config) says; keys our Config would reject
    (a value outside its ranges, a loss_type it does not know) stay at mechdiag's defaults."""
    n = max(1, int(getattr(args, "world_size", 1) or 1))
    g = int(args.num_generations or 8)
    sched = {v: k for k, v in C.LR_SCHEDULERS.items()} | {"constant": "constant"}
    # TRL 0.2x (transformers < 5) has warmup_ratio; later ones take a float warmup_steps < 1 as the ratio
    ratio, warm = getattr(args, "warmup_ratio", None), args.warmup_steps
    warm = ratio if isinstance(ratio, float) and ratio > 0 else warm
    # one optimizer step sees per_device x processes x accumulation completions, G per prompt; ours is
    # prompts_per_step x grad_accum prompts
    accum = int(args.gradient_accumulation_steps or 1)
    prompts = max(1, int(args.per_device_train_batch_size or g) * n * accum // g)
    if prompts % accum:
        accum = 1
    data = {
        "group_size": g, "prompts_per_step": max(1, prompts // accum),
        "grad_accum": accum, "epsilon": args.epsilon,
        "epsilon_high": None if args.epsilon_high in (None, args.epsilon) else args.epsilon_high,
        "beta": args.beta, "num_iterations": args.num_iterations, "loss_type": args.loss_type,
        "scale_rewards": {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards),
        "learning_rate": args.learning_rate, "lr_schedule": sched.get(str(getattr(args.lr_scheduler_type, "value",
                                                                                  args.lr_scheduler_type))),
        "warmup_ratio": warm if isinstance(warm, float) and 0 <= warm < 1 else 0.0 if warm == 0 else None,
        "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2, "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm, "temperature": args.temperature, "top_p": args.top_p,
        "max_completion_tokens": args.max_completion_length, "seed": args.seed,
        "max_steps": args.max_steps if args.max_steps and args.max_steps > 0 else None,
        "save_every": args.save_steps if str(getattr(args.save_strategy, "value", args.save_strategy)) == "steps"
        else 0,
        "report_to": [r for r in (args.report_to or []) if r in C.TRACKERS],  # the trackers mechdiag also feeds
        **{f: getattr(args, f, None) for f in SAME_FIELDS},
        # TRL fills steps_per_generation in (= gradient_accumulation_steps); ours is None for one update a rollout
        "steps_per_generation": None if getattr(args, "steps_per_generation", None) in (None, accum)
        else args.steps_per_generation,
    }
    if reward_names:
        w = args.reward_weights or [1.0] * len(reward_names)
        data["rewards"] = {"weights": dict(zip(reward_names, [float(x) for x in w], strict=False))}
    pc = getattr(model, "peft_config", None) or {}
    lc = pc.get("default") if isinstance(pc, dict) else None
    if lc is not None and getattr(lc, "r", None):
        lora = {"r": lc.r, "alpha": lc.lora_alpha, "dropout": lc.lora_dropout, "use_rslora": lc.use_rslora}
        targets = lora_targets(lc.target_modules, getattr(lc, "target_parameters", None))
        if targets:
            lora["target_modules"] = targets
        if lc.layers_to_transform is not None:
            lora["layers"] = [lc.layers_to_transform] if isinstance(lc.layers_to_transform, int) \
                else list(lc.layers_to_transform)
        data["lora"] = lora
    elif model is not None:
        data["lora"] = {"enabled": False}
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if name:
        data["model"] = {"name_or_path": str(name)}
    kept: dict = {}
    for k, v in data.items():  # one key at a time, so one odd value costs only itself
        if v is None:
            continue
        try:
            C.from_dict({**kept, k: v})
        except UserError:
            continue
        kept[k] = v
    return C.from_dict(kept)


def config_and_fields(output_dir: Path, lora: dict | None, model: str | None):
    """(Config, the training_args.bin fields, the mechdiag keys they set) or None without a training_args.bin."""
    path = find_training_args(output_dir)
    if path is None:
        return None
    fields = read_training_args(path)
    # world_size is a property of TrainingArguments, not a field: the pickled PartialState knows the processes
    state = fields.get("distributed_state") if isinstance(fields.get("distributed_state"), dict) else {}
    fields.setdefault("world_size", state.get("num_processes") or 1)
    cfg = config_from_grpo(types.SimpleNamespace(**{k: fields.get(k) for k in GRPO_FIELDS_READ} | fields))
    data = cfg.model_dump(mode="json")
    held = {k for k, f in GRPO_FIELDS.items() if fields.get(f) is not None and k in data}
    if fields.get("per_device_train_batch_size") is not None:
        held |= {"prompts_per_step", "grad_accum"}
    if fields.get("warmup_ratio") is not None:
        held.add("warmup_ratio")
    if lora:
        data["lora"] = {**data["lora"], **lora}
    if model:
        data["model"] = {**data["model"], "name_or_path": model}
    return C.from_dict(data), fields, held


def lora_targets(target_modules, target_parameters) -> list[str]:
    """Our lora.target_modules from peft's two lists: modules as given, each target parameter by the name
    mechdiag gives it (model.layers.0.mlp.experts.gate_up_proj -> experts.gate_up_proj, mlp.gate.weight -> gate)."""
    modules = sorted(target_modules) if isinstance(target_modules, (set, list)) else []
    params = [tensor_site(t)[1] for t in target_parameters or ()]
    return modules + sorted(set(params) - set(modules))


# TRL 1.16's objective and sampling options: Config fields named as GRPOConfig names them, passed both ways
SAME_FIELDS = ("importance_sampling_level", "delta", "mask_truncated_completions", "top_entropy_quantile",
               "entropy_coef", "use_bias_correction_kl", "multi_objective_aggregation", "sapo_temperature_pos",
               "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
               "off_policy_mask_threshold", "top_k", "min_p", "repetition_penalty", "use_adaptive_entropy",
               "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target", "sync_ref_model",
               "ref_model_mixup_alpha", "ref_model_sync_steps")

# mechdiag key -> GRPOConfig field (the inverse of config_from_grpo), and lora.* -> peft LoraConfig field
GRPO_FIELDS = {"group_size": "num_generations", "grad_accum": "gradient_accumulation_steps", "epsilon": "epsilon",
               "epsilon_high": "epsilon_high", "beta": "beta", "num_iterations": "num_iterations",
               "loss_type": "loss_type", "scale_rewards": "scale_rewards", "learning_rate": "learning_rate",
               "lr_schedule": "lr_scheduler_type", "warmup_ratio": "warmup_steps", "adam_beta1": "adam_beta1",
               "adam_beta2": "adam_beta2", "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm",
               "temperature": "temperature", "top_p": "top_p", "max_completion_tokens": "max_completion_length",
               "seed": "seed", "max_steps": "max_steps", "save_every": "save_steps",
               "steps_per_generation": "steps_per_generation", **{f: f for f in SAME_FIELDS}}
GRPO_FIELDS_READ = (*GRPO_FIELDS.values(), "per_device_train_batch_size", "save_strategy", "reward_weights",
                    "warmup_ratio")
LORA_FIELDS = {"lora.r": "r", "lora.alpha": "lora_alpha", "lora.dropout": "lora_dropout",
               "lora.target_modules": "target_modules", "lora.layers": "layers_to_transform",
               "lora.use_rslora": "use_rslora"}


def trl_snippet(changes, cfg) -> str:
    """The refined settings as GRPOConfig / LoraConfig keyword arguments, to paste into a TRL script."""
    grpo, lora, other = {}, {}, []
    for c in changes:
        if c.key in GRPO_FIELDS:
            grpo[GRPO_FIELDS[c.key]] = c.new
        elif c.key in LORA_FIELDS:
            lora[LORA_FIELDS[c.key]] = c.new
        elif c.key == "prompts_per_step":  # TRL counts completions per device: prompts x generations / processes
            grpo["per_device_train_batch_size"] = c.new * cfg.group_size
            other.append("per_device_train_batch_size assumes one process; divide by the number of processes")
        else:
            other.append(f"{c.key}: {c.old!r} -> {c.new!r} has no GRPOConfig/LoraConfig field")
    lines = ["# mechdiag recommend: the refined settings as TRL fields (only what changes)",
             "from peft import LoraConfig", "from trl import GRPOConfig", ""]
    lines.append("grpo_changes = dict(" + ", ".join(f"{k}={v!r}" for k, v in grpo.items()) + ")")
    lines.append("lora_changes = dict(" + ", ".join(f"{k}={v!r}" for k, v in lora.items()) + ")")
    lines += [f"# note: {n}" for n in other]
    lines += ["", "# args = GRPOConfig(..., **grpo_changes)", "# peft_config = LoraConfig(..., **lora_changes)"]
    return "\n".join(lines) + "\n"
