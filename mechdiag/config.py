"""The design lambda of the study (paper-notes §1) as typed, validated data, with YAML in and out.

Defaults are the embedded default run (`mechdiag train` with no arguments); presets math/code/mcq follow the
study's Table 7. Reward weights are the task's own (Table 6 by domain, Task.reward_weights) unless the config
sets rewards.weights; tasks.resolve_rewards fills them in before a run, so the run's config.yaml shows what ran.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mechdiag import atomic
from mechdiag.errors import UserError, first_line

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    name_or_path: str = "bundled"  # "bundled" = the tiny arith Llama shipped in mechdiag/assets
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DataSource(_Strict):
    name: str = "arith"
    path: str | None = None  # local file; None = the task's default (shared data or a dataset name)
    weight: float = Field(1.0, gt=0)
    options: dict[str, Any] = Field(default_factory=dict)  # task-specific knobs, e.g. arith difficulty


class TaskConfig(_Strict):
    name: str = "arith"
    path: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "test"
    n_train: int | None = Field(None, gt=0)
    mixture: list[DataSource] = Field(default_factory=list)  # extra sources mixed into training by weight


class LoraConfig(_Strict):
    enabled: bool = True
    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    use_rslora: bool = False
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_MODULES))
    layers: str | list[int] = "all"  # "all", "0-3,7", "first2+last2", "last3", or a list of indices

    @field_validator("target_modules")
    @classmethod
    def _modules_nonempty(cls, v):
        if not v:
            raise ValueError("must name at least one module")
        return v

    @field_validator("layers")
    @classmethod
    def _layers_parse(cls, v):
        parse_layers(v, n_layers=None)  # syntax check; bounds are checked against the model later
        return v


class RewardConfig(_Strict):
    weights: dict[str, float] | None = None  # None: the task's study weights (tasks.resolve_rewards fills them in)
    # random: the control run a held-out gain is judged beside (Spurious rewards, arXiv 2506.10947): the reward
    # is a fair coin per completion (tasks.rewards.coin), the task's components weigh 0 and are still logged
    control: Literal["none", "random"] = "none"
    reasoning_tag: str = "reasoning"
    answer_tag: str = "answer"


class RecordConfig(_Strict):
    displacement_every: int = Field(10, ge=0)  # steps; 0 = off
    # update geometry at the final step: one float64 pass over each adapted base weight (about 4-5 CPU minutes
    # for every module of a 0.5B model); off keeps the final displacement rows plain
    final_geometry: bool = True
    shift_at_eval: bool = True
    shift_n: int = Field(64, ge=1)
    samples_every: int = Field(10, ge=0)
    forget_prompts: str | None = None  # a prompts file or a task name: forget_kl at each eval (docs/metrics.md)
    forget_n: int = Field(64, ge=1)  # probe prompts kept
    forget_tokens: int = Field(32, ge=1)  # greedy base continuation length
    signals: list[str] = Field(default_factory=list)  # user signals, "package.module:Class" (mechdiag.recorder)
    # auto-halt: alert names (mechdiag.alerts.NAMES, or "critical") that stop the run cleanly; best/ keeps the
    # adapter with the best held-out accuracy, halt.json the alert and the resume step (mechdiag.recorder.Halt)
    halt_on: list[str] = Field(default_factory=list)
    alert_hook: str | None = None  # run on each alert: an http(s):// URL (POSTed JSON) or a shell command (stdin JSON)


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # report_to's names, as TRL spells them

# lr_schedule -> transformers' scheduler name (native trainer's get_scheduler, TRL's lr_scheduler_type); warmup
# is warmup_ratio in every one
LR_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


class Config(_Strict):
    preset: Literal["math", "code", "mcq"] | None = None
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    record: RecordConfig = Field(default_factory=RecordConfig)

    # GRPO (paper-notes §2)
    group_size: int = Field(8, ge=2)
    prompts_per_step: int = Field(32, ge=1)
    grad_accum: int = Field(1, ge=1)
    epsilon: float = Field(0.2, ge=0, le=1)
    epsilon_high: float | None = Field(None, ge=0, le=10)  # None = epsilon (symmetric clip)
    beta: float = Field(0.0, ge=0)
    num_iterations: int = Field(1, ge=1)
    # TRL 1.16 defaults to dapo; grpo is the study's per-sequence mean (docs/training.md, "Defaults")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    # TRL 1.16's GRPO family, named as GRPOConfig names them (docs/training.md: each formula and its paper)
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO
    delta: float | None = Field(None, gt=1)  # INTELLECT-2's upper bound on the unclipped ratio
    mask_truncated_completions: bool = False  # DAPO: completions cut at max_completion_tokens leave the loss
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)  # < 1: the loss on the top-entropy tokens only
    entropy_coef: float = 0.0  # the entropy bonus: loss - coef x mean token entropy
    # Skywork-OR1's adaptive controller: entropy_coef the start, moved by entropy_coef_delta within [min, max] after
    # each update toward entropy_target (nats), applied only while the entropy is at or below the target
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = Field(0.0, ge=0)
    entropy_coef_max: float = Field(1.0, ge=0)
    entropy_coef_delta: float = Field(0.005, ge=0)
    entropy_target: float = Field(0.2, ge=0)
    use_bias_correction_kl: bool = False  # TRL 1.16 defaults to True (rho x k3); the study's KL is plain k3
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    sapo_temperature_pos: float = Field(1.0, gt=0)
    sapo_temperature_neg: float = Field(1.05, gt=0)
    vespo_k_pos: float = Field(2.0, ge=0)
    vespo_lambda_pos: float = Field(3.0, ge=0)
    vespo_k_neg: float = Field(3.0, ge=0)
    vespo_lambda_neg: float = Field(2.0, ge=0)
    # updates per rollout x grad_accum: the rollout holds prompts_per_step x steps_per_generation prompts and makes
    # steps_per_generation / grad_accum updates (PPO-style mini-batches); None = grad_accum (one update)
    steps_per_generation: int | None = Field(None, ge=1)
    off_policy_mask_threshold: float | None = Field(None, ge=0)  # DeepSeek-V3.2's off-policy sequence mask
    # TR-DPO's reference sync: every ref_model_sync_steps updates pi_ref <- alpha pi_theta + (1 - alpha) pi_ref
    # (full fine-tuning with beta > 0, as TRL 1.16)
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = Field(0.6, ge=0, le=1)
    ref_model_sync_steps: int = Field(512, ge=1)

    # optimisation
    learning_rate: float = Field(1e-3, gt=0, le=1)
    lr_schedule: Literal["cosine", "constant", "linear"] = "cosine"  # transformers' name: LR_SCHEDULERS
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.99, ge=0, lt=1)
    weight_decay: float = Field(0.1, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)

    # sampling
    temperature: float = Field(1.0, gt=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    # the training rollouts' other filters, as TRL 1.16's (mechdiag.generate.Filters); evals sample without them
    top_k: int = Field(0, ge=0)  # 0 = off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    max_prompt_tokens: int = Field(96, ge=1)
    max_completion_tokens: int = Field(48, ge=1)

    # model-written code: auto runs it under bubblewrap, else landlock, else refuses; strict: bubblewrap only;
    # landlock: the no-namespace mode; guard-only (named by the user) allows the in-process guard alone; see
    # mechdiag.sandbox
    sandbox: Literal["auto", "strict", "landlock", "guard-only"] = "auto"

    # schedule
    seed: int = 42
    max_steps: int | None = Field(40, ge=1)
    epochs: float | None = Field(None, gt=0)
    max_time_s: float | None = Field(240, gt=0)  # stop training after this many seconds (null = no limit)
    eval_every: int = Field(0, ge=0)  # 0 = only at start and end
    eval_n: int = Field(500, ge=1)
    eval_samples: int = Field(1, ge=1)  # completions per eval problem for pass@k
    pass_k: list[int] = Field(default_factory=lambda: [1])
    save_every: int = Field(20, ge=0)
    max_bad_steps: int = Field(5, ge=1)  # non-finite updates in a row before the run stops
    # LoRA decoding: "merged" = an adapter-free copy with the adapter merged in (faster on small models, one more
    # copy of the weights), "adapter" = the LoRA model itself, "auto" = merged up to SAMPLER_AUTO_MAX_PARAMS
    sampler: Literal["auto", "merged", "adapter"] = "auto"
    # the merged sampler's dtype (LoRA): a lower-precision sampler than the update, as vLLM in bfloat16 beside a
    # float32 trainer; the sampler gap (docs/metrics.md) measures what it costs. None = the model's dtype
    sampler_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # rows per forward/backward of the update (gradients accumulate, the loss is the same); None = as many as
    # keep the saved activations under half the weights' bytes (at least 256 MiB), so small models never split
    update_rows: int | None = Field(None, ge=1)
    gradient_checkpointing: bool = False  # recompute activations in the backward: less memory, ~30% more time
    device: str = "auto"  # auto (the GPU if any), cpu, cuda, cuda:N, mps; checked before the model loads
    threads: int | None = Field(None, ge=1)  # torch threads; None = the cores not already busy (2 when idle)
    hooks: list[str] = Field(default_factory=list)  # "package.module:factory" import paths
    # the user's own trackers (mechdiag.trackers; the trackers extra); the TRL backend passes them to TRL's report_to
    report_to: list[Literal[TRACKERS]] = Field(default_factory=list)

    @property
    def rollout_micro_batches(self) -> int:
        """Micro-batches of prompts_per_step prompts in a step's rollout: steps_per_generation, else grad_accum."""
        return self.steps_per_generation or self.grad_accum

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates a step makes (a TRL step is one): num_iterations passes over the rollout, each of
        rollout_micro_batches / grad_accum updates."""
        return self.num_iterations * (self.rollout_micro_batches // self.grad_accum)

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v):
        if isinstance(v, str):  # report_to: tensorboard, as TRL takes it; "none" = no tracker
            return [] if v == "none" else [v]
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.pass_k and max(self.pass_k) > self.eval_samples and self.eval_samples > 1:
            raise ValueError(f"pass_k {max(self.pass_k)} exceeds eval_samples {self.eval_samples}")
        if any(k < 1 for k in self.pass_k):
            raise ValueError("pass_k values must be >= 1")
        if self.sampler_dtype is not None and (not self.lora.enabled or self.sampler == "adapter"):
            raise ValueError("sampler_dtype needs the merged LoRA sampler (lora.enabled, sampler auto or merged)")
        if self.sync_ref_model and (self.lora.enabled or self.beta == 0):
            raise ValueError("sync_ref_model needs full fine-tuning (lora.enabled false) and beta > 0: under LoRA the "
                             "reference is the base with the adapter off, and with beta 0 it is not in the loss")
        if self.steps_per_generation is not None and self.steps_per_generation % self.grad_accum:
            raise ValueError(f"steps_per_generation {self.steps_per_generation} is not a multiple of grad_accum "
                             f"{self.grad_accum}")
        return self


# ---- presets (Table 7) ------------------------------------------------------------------------------------
_SHARED = {"adam_beta1": 0.9, "adam_beta2": 0.99, "weight_decay": 0.1, "warmup_ratio": 0.1,
           "lr_schedule": "cosine", "max_grad_norm": 0.1, "temperature": 0.8, "epsilon": 0.2,
           "max_prompt_tokens": 256, "max_completion_tokens": 512, "eval_every": 100, "max_steps": None,
           "max_time_s": None}
PRESETS: dict[str, dict[str, Any]] = {
    "math": {**_SHARED, "learning_rate": 1e-5, "epochs": 2, "prompts_per_step": 4, "grad_accum": 4,
             "beta": 0.005, "task": {"name": "gsm8k"},
             "lora": {"r": 16, "alpha": 64, "dropout": 0.05, "target_modules": ALL_MODULES}},
    "code": {**_SHARED, "learning_rate": 5e-6, "epochs": 1, "prompts_per_step": 1, "grad_accum": 64,
             "beta": 0.005, "task": {"name": "mbpp"},
             "lora": {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ATTN_MODULES}},
    "mcq": {**_SHARED, "learning_rate": 1e-5, "epochs": 2, "prompts_per_step": 4, "grad_accum": 4,
            "beta": 0.003, "task": {"name": "arc"},
            "lora": {"r": 16, "alpha": 64, "dropout": 0.05, "target_modules": ALL_MODULES}},
}


# ---- layer selection ---------------------------------------------------------------------------------------
_NAMED = re.compile(r"^(first|last)(\d+)$")


def load_object(spec: str, what: str, kind: str = "Name"):
    """The object a config names by "package.module:Name" (a hook, signal, task or trainer: `what`); one UserError
    line when it cannot be loaded."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UserError(f"{what} {spec!r}: use the form package.module:{kind}")
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except ImportError as e:
        raise UserError(f"cannot import {what} {spec!r}: {first_line(e)}") from None
    except AttributeError:
        raise UserError(f"cannot import {what} {spec!r}: {mod_name} has no attribute {attr}") from None


def parse_layers(spec: str | list[int], n_layers: int | None) -> list[int] | None:
    """Resolve a layer spec to sorted indices ("all" -> None when n_layers is unknown).

    Accepts "all", comma lists of indices and ranges ("0-3,7"), "firstK", "lastK" joined by "+"
    ("first2+last2", the study's reduced layers), or a list of ints. Negative indices count from the end.
    """
    if isinstance(spec, list):
        idx = list(spec)
    else:
        s = spec.strip().lower().replace(" ", "")
        if s == "all":
            return None if n_layers is None else list(range(n_layers))
        idx = []
        for part in s.split("+"):
            m = _NAMED.match(part)
            if m:
                k = int(m.group(2))
                if n_layers is None:
                    continue
                idx += list(range(min(k, n_layers))) if m.group(1) == "first" else \
                    list(range(max(0, n_layers - k), n_layers))
                continue
            for item in part.split(","):
                if re.fullmatch(r"-?\d+", item):
                    idx.append(int(item))
                elif re.fullmatch(r"\d+-\d+", item):
                    a, b = map(int, item.split("-"))
                    if b < a:
                        raise ValueError(f"bad layer range {item!r}")
                    idx += list(range(a, b + 1))
                else:
                    raise ValueError(f"bad layer spec {item!r} (use all, 0-3,7, first2+last2, last3 or a list)")
    if n_layers is None:
        return sorted(set(idx))
    out = set()
    for i in idx:
        j = i + n_layers if i < 0 else i
        if not 0 <= j < n_layers:
            raise UserError(f"lora.layers: layer {i} out of range for a model with {n_layers} layers")
        out.add(j)
    if not out:
        raise UserError("lora.layers selects no layer")
    return sorted(out)


WHOLE_KEYS = ("weights", "options")  # dict-valued settings that are one value each (never merged or flattened)


# ---- loading -----------------------------------------------------------------------------------------------
def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in WHOLE_KEYS:
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _field_names(model: type[BaseModel], path: list[str]) -> list[str]:
    for p in path:
        f = model.model_fields.get(p)
        ann = getattr(f, "annotation", None) if f else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _explain(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = [str(x) for x in e["loc"]]
    where = ".".join(loc) or "config"
    if e["type"] == "extra_forbidden":
        known = _field_names(Config, loc[:-1])
        near = difflib.get_close_matches(loc[-1], known, n=1) or \
            [k for k in known if loc[-1].startswith(k) or k.startswith(loc[-1])][:1]
        hint = f" (did you mean {'.'.join(loc[:-1] + near)}?)" if near else ""
        return f"unknown config key {where}{hint}"
    msg = e["msg"].removeprefix("Value error, ")
    return f"invalid config value for {where}: {msg} (got {e.get('input')!r})"


# Keys of earlier versions, read from old run directories: name -> (today's name, value mapping).
_RENAMED = {"merged_sampler": ("sampler", lambda v: "merged" if v else "adapter")}


def from_dict(data: dict | None) -> Config:
    data = dict(data or {})
    for old, (new, convert) in _RENAMED.items():
        if old in data and new not in data:
            data[new] = convert(data.pop(old))
    preset = data.get("preset")
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            near = difflib.get_close_matches(str(preset), PRESETS, n=1)
            raise UserError(f"unknown preset {preset!r}" + (f" (did you mean {near[0]}?)" if near else ""))
        data = _deep_merge(PRESETS[preset], data)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise UserError(_explain(err)) from None


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `key.sub=value` strings (values parsed as YAML) to a raw config dict."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise UserError(f"--set {item!r}: the key before '=' is empty or has an empty part (use key.sub=value)")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {key}: {p} is not a section")
        node[parts[-1]] = _parse_value(value)
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"invalid YAML in {path}: {first_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config {path} must be a mapping of keys to values")
    return data


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    data = read_yaml(path) if path else {}
    return from_dict(apply_overrides(data, overrides or []))


def to_yaml(cfg: Config, header: str = "") -> str:
    return to_yaml_dict(cfg.model_dump(mode="json"), header)


def to_yaml_dict(data: dict, header: str = "") -> str:
    """YAML of a (partial) config dict under `header` as comment lines."""
    body = yaml.safe_dump(data, sort_keys=False)
    if header:
        body = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body
    return body


def save(cfg: Config, path: str | Path, header: str = "") -> None:

    atomic.write_text(path, to_yaml(cfg, header))
