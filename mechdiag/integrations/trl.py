"""mechdiag inside TRL's GRPOTrainer (trl >= 1.0; checked against 1.16).

    MechdiagCallback     a transformers TrainerCallback: TRL's events as the recorder's step records and events
    GroupCV              wraps reward functions: the generation batch as a step record's rollout, and the
                         study's within-group reward CV in TRL's own log
    task_reward_funcs    a mechdiag task's reward components as TRL reward functions (one per component)
    grpo_args / peft_lora_config / config_from_grpo   our design lambda <-> GRPOConfig and peft's LoraConfig
    train_trl            `mechdiag train --backend trl`: the same config run through GRPOTrainer
    save_adapter         trainer.save_model, with the adapter whole under FSDP1 (peft writes it empty there)
    read_trl_run         re-exported from mechdiag.integrations.readers.trl_dir
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import os
import time
import warnings
from pathlib import Path

from mechdiag import config as C
from mechdiag import recorder as R
from mechdiag import trackers as T
from mechdiag.console import Progress
from mechdiag.distributed import Engine, clean_name
from mechdiag.errors import UserError, first_line
from mechdiag.integrations.readers.trl_dir import (
    _contiguous_keys,
    completion_files,
    completions_rows,
    is_eval_log,
    is_train_log,
    map_trl_log,
    read_trl_run,
)
from mechdiag.integrations.readers.verl_log import read_verl_run
from mechdiag.integrations.trl_args import SAME_FIELDS, config_from_grpo
from mechdiag.models import context_of, device, eos_ids, load_model_and_tokenizer, load_tokenizer
from mechdiag.outcomes import CORRECTNESS, group_stats
from mechdiag.probes.forget import ForgetProbe, forget_prompts
from mechdiag.run import CALLBACK_DIR, RunDir, held
from mechdiag.tasks import get_task
from mechdiag.tasks.rewards import RANDOM, coin, weighted_total
from mechdiag.train.lora import peft_config, peft_refusals
from mechdiag.train.trainer import StepChange, run_config

try:  # the callback must be a real TrainerCallback for Trainer; reading runs needs no transformers
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is a dependency
    TrainerCallback = object

__all__ = ["MechdiagCallback", "GroupCV", "task_reward_funcs", "grpo_args", "peft_lora_config", "config_from_grpo",
           "train_trl", "save_adapter", "read_trl_run", "read_verl_run"]


# ---- a step's rollout through a reward-function wrapper --------------------------------------------------------
class GroupCV:
    """Wrap TRL reward functions so that, once all of them have scored a generation batch, the batch becomes the
    rollout of mechdiag's step record (recorder.StepRecord: groups, each function's values, the weighted total,
    lengths and truncation from completion_ids, texts), which MechdiagCallback(rollouts=cv) records; and the
    study's group statistics (outcomes.group_stats: reward_cv, group_frac_zero_std, the group outcomes when one
    function gives correctness, `correctness`: its name or index, default the function named "correctness") go to
    TRL's own log through log_metric. Weights are GRPOConfig.reward_weights (default 1 each); groups are contiguous
    blocks of group_size (TRL's layout of a generation batch), else equal prompts. Under several processes the
    batch is gathered first, so a group split across processes is still one group.

        cv = GroupCV([f1, f2], weights=[1.0, 0.5], group_size=8)
        GRPOTrainer(..., reward_funcs=cv.funcs, args=GRPOConfig(reward_weights=[1.0, 0.5], ...),
                    callbacks=[MechdiagCallback(rollouts=cv)])
    """

    def __init__(self, reward_funcs, weights=None, group_size: int | None = None, correctness=None):
        import torch  # noqa: PLC0415 - the TRL callback imports without torch until a run starts

        self.raw = list(reward_funcs)
        for f in self.raw:
            if isinstance(f, torch.nn.Module) or not callable(f):
                raise UserError("GroupCV wraps reward functions (callables); pass reward models to TRL unwrapped")
        self.weights = [1.0] * len(self.raw) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.raw):
            raise UserError(f"GroupCV: {len(self.weights)} weights for {len(self.raw)} reward functions")
        names = [getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(self.raw)]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]  # unique keys
        self.group_size = group_size
        self.correct_idx = correctness_index(self.raw, correctness)
        self.eos: set[int] | None = None  # the callback sets the model's EOS ids: truncation is then known
        self.rollout: dict | None = None  # the last batch's columns, until the callback takes them
        self._batch, self._outs = None, {}
        self.funcs = [self._wrap(i, f) for i, f in enumerate(self.raw)]

    def _wrap(self, i: int, f):
        @functools.wraps(f)
        def scored(prompts=None, completions=None, **kwargs):
            out = f(prompts=prompts, completions=completions, **kwargs)
            if id(completions) != self._batch:  # TRL calls every function on the same list objects in turn
                self._batch, self._outs = id(completions), {}
            self._outs[i] = list(out)
            if len(self._outs) == len(self.raw):
                self._finish(list(prompts), list(completions), kwargs)
            return out

        return scored

    def _finish(self, prompts: list, completions: list, kwargs: dict) -> None:
        nan = lambda v: math.nan if v is None else float(v)  # noqa: E731 - TRL's None: unscorable
        ids = kwargs.get("completion_ids")
        cols = {"prompts": [p if isinstance(p, str) else repr(p) for p in prompts],
                "texts": [c if isinstance(c, str) else c[-1]["content"] for c in completions],
                "example_ids": kwargs.get("example_id"), "lengths": None if ids is None else [len(x) for x in ids],
                "truncated": None if ids is None or self.eos is None else [not x or x[-1] not in self.eos
                                                                            for x in ids],
                **{f"reward/{n}": [nan(v) for v in self._outs[i]] for i, n in enumerate(self.names)}}
        self._outs = {}
        try:
            from accelerate import PartialState  # noqa: PLC0415 - accelerate is part of the optional trl extra

            if PartialState().num_processes > 1:
                from accelerate.utils import gather_object  # noqa: PLC0415 - accelerate is part of the optional trl extra

                cols = {k: v if v is None else gather_object(v) for k, v in cols.items()}
        except ImportError:  # pragma: no cover - accelerate comes with trl
            pass
        comps = {n: cols.pop(f"reward/{n}") for n in self.names}
        cols["components"] = comps
        keys = _contiguous_keys(len(cols["prompts"]), self.group_size, cols["prompts"])
        weights = dict(zip(self.names, self.weights, strict=True))
        scored = [{n: comps[n][j] for n in self.names if math.isfinite(comps[n][j])} for j in range(len(keys))]
        cols["rewards"] = [weighted_total(s, weights) if s else math.nan for s in scored]  # none scored: NaN
        first: dict = {}
        cols["group_ids"] = [first.setdefault(k, len(first)) for k in keys]
        self.rollout = cols
        stats = group_stats(cols["rewards"], keys, None if self.correct_idx is None else
                            comps[self.names[self.correct_idx]])
        for key, v in stats.items() if kwargs.get("log_metric") else ():  # into TRL's own log
            if math.isfinite(v):
                kwargs["log_metric"]("group_frac_zero_std" if key == "frac_zero_std" else key, v)

    def take(self) -> dict | None:
        """The last batch's columns (once: a later TRL step of the same generation batch has none)."""
        out, self.rollout = self.rollout, None
        return out


def correctness_index(funcs, correctness) -> int | None:
    """Which reward function gives correctness: an index, a function name, or by default the one named
    "correctness" (None when there is none)."""
    names = [getattr(f, "__name__", "") for f in funcs]
    if correctness is None:
        return names.index(CORRECTNESS) if CORRECTNESS in names else None
    if isinstance(correctness, int) and 0 <= correctness < len(funcs):
        return correctness
    if correctness in names:
        return names.index(correctness)
    raise UserError(f"GroupCV: correctness {correctness!r} names none of the reward functions {names}")


# ---- a mechdiag task as TRL reward functions ----------------------------------------------------------------
def task_reward_funcs(task, examples, weights: dict[str, float], control_seed: int | None = None
                      ) -> tuple[list, list[float]]:
    """(reward functions, weights): one TRL reward function per reward component of `task`, named after it (so
    TRL logs rewards/<component>/mean), scoring `completions` against the example named by the dataset column
    example_id. The components of one completion are computed once and shared by the functions. control_seed:
    a random-reward control run's seed (rewards.control: random): the coin is one more function."""
    by_id = {ex.id: ex for ex in examples}
    names = list(task.components("", examples[0])) + ([RANDOM] if control_seed is not None else [])
    cache: dict = {"batch": None, "rows": {}}

    def components(completions, example_id) -> list[dict]:
        if cache["batch"] is not completions:
            cache["batch"], cache["rows"] = completions, {}
        rows = cache["rows"]
        out = []
        for j, (c, eid) in enumerate(zip(completions, example_id, strict=True)):
            if j not in rows:
                if eid not in by_id:
                    raise UserError(f"reward: unknown example_id {eid!r} (the dataset must come from the task)")
                text = c if isinstance(c, str) else c[-1]["content"]  # conversational: the last message
                rows[j] = task.components(text, by_id[eid])
                if control_seed is not None:
                    rows[j][RANDOM] = coin(control_seed, eid, text)
            out.append(rows[j])
        return out

    def make(name):
        def reward(prompts=None, completions=None, example_id=None, **_):
            return [float(c.get(name, 0.0)) for c in components(completions, example_id)]

        reward.__name__ = reward.__qualname__ = name
        return reward

    return [make(n) for n in names], [float(weights.get(n, 0.0)) for n in names]


# ---- design lambda <-> GRPOConfig / LoraConfig --------------------------------------------------------------


def grpo_args(cfg, output_dir, n_processes: int | None = None, **overrides):
    """GRPOConfig for our Config: one of our steps (prompts_per_step x grad_accum prompts, G completions each,
    num_iterations updates) is num_iterations TRL steps over one generation batch of the same size. Under
    `accelerate launch` with N processes the per-device batch is prompts_per_step x G / N (it must divide)."""
    from trl import GRPOConfig  # noqa: PLC0415 - trl is an optional extra

    n = n_processes or int(os.environ.get("WORLD_SIZE", "1"))
    micro = cfg.prompts_per_step * cfg.group_size
    if micro % n:
        raise UserError(f"prompts_per_step x group_size = {micro} completions per micro-batch does not split over "
                        f"{n} processes; pick sizes it divides")
    cuda = device(cfg.device).startswith("cuda")  # accelerate places the processes; cpu forces use_cpu
    # ... except under DeepSpeed, which accelerate skips when use_cpu is set (its CPU accelerator runs it there)
    ds = bool(overrides.get("deepspeed")) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    updates = (cfg.max_steps or 0) * cfg.updates_per_step
    kw = dict(
        output_dir=str(output_dir), num_generations=cfg.group_size, per_device_train_batch_size=micro // n,
        gradient_accumulation_steps=cfg.grad_accum, steps_per_generation=cfg.rollout_micro_batches,
        num_iterations=cfg.num_iterations, beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        loss_type=cfg.loss_type, scale_rewards=cfg.scale_rewards, learning_rate=cfg.learning_rate,
        lr_scheduler_type=C.LR_SCHEDULERS[cfg.lr_schedule],
        warmup_steps=math.ceil(cfg.warmup_ratio * updates) if updates else cfg.warmup_ratio,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, temperature=cfg.temperature, top_p=cfg.top_p,
        max_completion_length=cfg.max_completion_tokens, seed=cfg.seed, data_seed=cfg.seed,
        logging_steps=1, save_strategy="steps" if cfg.save_every else "no", save_steps=cfg.save_every or 500,
        eval_strategy="no", report_to=list(cfg.report_to), project=os.environ.get("TRACKIO_PROJECT", T.PREFIX),
        bf16=cuda and cfg.model.dtype == "bfloat16",
        fp16=cuda and cfg.model.dtype == "float16", gradient_checkpointing=cfg.gradient_checkpointing,
        use_cpu=not cuda and not ds,
        # forced, each for a reason in docs/trl.md: dropout as lora.dropout says, the reward columns kept, the
        # callback logs the samples, data loaded in the training process
        log_completions=False, disable_dropout=False, remove_unused_columns=False, dataloader_num_workers=0,
        **{f: getattr(cfg, f) for f in SAME_FIELDS},  # the objective and sampling as config.yaml records them
    )
    if cfg.max_steps:
        kw["max_steps"] = updates
    else:
        kw["num_train_epochs"] = cfg.epochs or 1.0
    kw.update(overrides)
    with warnings.catch_warnings():  # transformers 5 renames gradient_checkpointing; we set it False anyway
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return GRPOConfig(**kw)
        except (ValueError, TypeError, ImportError) as e:
            raise UserError(f"GRPOConfig: {first_line(e)}") from None


def parse_trl_args(items) -> dict:
    """`--trl key=value` strings -> GRPOConfig overrides (values parsed as YAML); unknown fields are refused."""

    import yaml  # noqa: PLC0415 - only when writing the GRPOConfig
    from trl import GRPOConfig  # noqa: PLC0415 - trl is an optional extra

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--trl expects KEY=VALUE, got {item!r}")
        if key not in fields:

            near = difflib.get_close_matches(key, sorted(fields), n=1)
            raise UserError(f"--trl {key}: GRPOConfig has no such field" + (f" (did you mean {near[0]}?)"
                                                                           if near else ""))
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key] = value
    return out


peft_lora_config = peft_config  # peft's LoraConfig for our lora section on this model: apply_lora's


# ---- the callback --------------------------------------------------------------------------------------------
def _peft(model):
    """The PEFT model under wrappers (DDP's and FSDP1's .module, torch.compile's _orig_mod)."""
    for _ in range(4):
        if hasattr(model, "peft_config") and not hasattr(model, "_fsdp_wrapped_module"):  # FSDP forwards getattr
            return model
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return None


def _timed(fn):
    """Add the method's wall time to self.recorder_s (the recorder's own cost, reported in summary.json), and to
    self.recorder_once_s where it is a once-per-run cost: the start, the end, and the final step's record (its
    update geometry), so the recurring cost per step can be told apart."""
    once = fn.__name__ in ("on_train_begin", "on_train_end")

    @functools.wraps(fn)
    def inner(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **kw)
        finally:
            dt = time.perf_counter() - t0
            self.recorder_s += dt
            if once or self._final_record:
                self.recorder_once_s += dt
                self._final_record = False

    return inner


class MechdiagCallback(TrainerCallback):
    """Records a TRL GRPOTrainer run into a mechdiag run directory (default: output_dir/mechdiag/): a thin
    translator of TRL's events into the recorder's, with the native trainer's signal set (recorder.signals).

    Each train log becomes a StepRecord: TRL's logged update statistics and the step's rollout, from a GroupCV
    wrapper (`rollouts`), else from the completions parquet (log_completions=True); the recorder computes every
    per-step signal from it. `displacement_every`, `shift_prompts`, `forget_prompts`, `signals`: as the config's
    record section. `evaluate(model, tokenizer, step) -> dict`, or "heldout" (the native trainer's held-out eval
    of `config`'s task, which `mechdiag attribute` reproduces), at TRL's evaluations, every `eval_every` steps, at
    the start and at the end. `config` (our Config) is saved as config.yaml, else one derived from the GRPOConfig
    and the model's LoRA config. `updates_per_step`: TRL steps per step of ours (Config.updates_per_step; the backend),
    for summary.json's step counts; the time spent here is summed there (recorder_s). Only the main process
    writes. With GRPOConfig(report_to=[...]), `attach(trainer)` puts this callback before the report_to callbacks,
    so the signals TRL does not log itself reach each backend at their step (mechdiag.trackers).
    """

    def __init__(self, run_dir=None, displacement_every: int = 10, shift_prompts: list[str] | None = None,
                 shift_n: int = 64, shift_batch_size: int = 16, config=None, evaluate=None, eval_every: int = 0,
                 reward_weights: dict[str, float] | None = None, max_time_s: float | None = None,
                 forget_prompts: list[str] | None = None, forget_tokens: int = 32, signals: list | None = None,
                 rollouts: GroupCV | None = None, updates_per_step: int = 1):
        self.run_dir = run_dir
        self.forget_prompts, self.forget_tokens = list(forget_prompts or []), forget_tokens
        self.max_time_s, self._t0 = max_time_s, time.perf_counter()
        self._created = self._t0
        self.change, self._moved = None, {}  # StepChange once training begins; step -> update_norm
        self.displacement_every = displacement_every
        self.shift_prompts = list(shift_prompts or [])[:shift_n]
        self.shift_batch_size = shift_batch_size
        if evaluate == "heldout" and config is None:
            raise ValueError('MechdiagCallback(evaluate="heldout") needs config=, the mechdiag Config naming the task')
        self.config, self.evaluate, self.eval_every = config, evaluate, eval_every
        self.reward_weights = reward_weights
        self.user_signals = list(signals or [])
        self.rollouts, self.updates_per_step = rollouts, updates_per_step
        self.run: RunDir | None = None
        self.recorder: R.Recorder | None = None
        self.recorder_s = self.recorder_once_s = 0.0
        self._final_record = False
        self._pending: dict | None = None
        self._last_eval_step = -1
        self._derived = False
        self.report = T.ReportTo()
        self.engine: Engine | None = None
        self.writer = True

    def attach(self, trainer):
        """Add this callback to `trainer` if it is not there, before its report_to callbacks: at each event the
        signals reach them before they write, and before TensorBoard's writer closes at the end."""
        self.report.attach(trainer, self)
        return trainer

    # ---- helpers ------------------------------------------------------------------------------------
    @property
    def halt_armed(self) -> bool:
        """record.halt_on is set (the config given to the callback: every rank holds the same)."""
        return self.config is not None and bool(self.config.record.halt_on)

    def _on(self, state) -> bool:
        """This rank computes: the writer always, every rank when the model is sharded (its figures need
        collectives all ranks join)."""
        return self.recorder is not None

    def _signals(self, cfg, tokenizer, args, model) -> list:
        """The native trainer's signal set (recorder.signals), with the callback's own arguments as its options."""
        if self.evaluate == "heldout":
            self.evaluate = R.HeldOut.from_config(cfg, tokenizer)
        evaluate = self.evaluate if isinstance(self.evaluate, R.Signal) or self.evaluate is None else \
            Evaluate(self.evaluate)
        forget = ForgetProbe(self.forget_prompts, tokenizer, max_new_tokens=self.forget_tokens) \
            if self.forget_prompts else None
        out = R.signals(cfg, evaluate, _peft(model) is not None, forget, self.shift_prompts, self.shift_batch_size,
                        self.user_signals, writer=self.writer)
        if self.writer and args.report_to:  # TRL logs its own metrics; the rest goes to its report_to callbacks
            if self.report.handler is None:
                warnings.warn("MechdiagCallback: call callback.attach(trainer) for mechdiag's signals to reach "
                              f"report_to {args.report_to}", stacklevel=3)
            out.append(T.Report(self.report, skip=("metrics",)))
        return out

    def _config(self, args, model):
        """Our Config, given or derived from the GRPOConfig; the callback's own intervals in its record section."""
        cfg = self.config
        self._derived = cfg is None
        if cfg is None:
            cfg = config_from_grpo(args, _peft(model) or model, [k for k in (self.reward_weights or {})] or None)
            cfg.record.samples_every = 1 if args.log_completions else cfg.record.samples_every
        cfg.record.displacement_every = self.displacement_every
        self.config = cfg
        return cfg

    def _flush(self, args) -> None:
        """Record the pending train step: TRL's logged numbers and the step's rollout, the wrapper's, else the
        completions parquet's (TRL writes it after on_log, so it exists by now)."""
        logged, self._pending = self._pending, None
        if logged is None:
            return
        step = logged.pop("step")
        names = [k.split("/", 1)[1] for k in logged if k.startswith("reward/")]  # in reward_funcs order
        if self.reward_weights is None and names:
            w = args.reward_weights or [1.0] * len(names)
            self.reward_weights = dict(zip(names, [float(x) for x in w], strict=False))
            if self._derived:  # now the reward function names are known: config.yaml gets them
                self.config = C.from_dict({**self.config.model_dump(mode="json"),
                                           "rewards": {"weights": self.reward_weights}})
                self.recorder.write_config(self.config, "mechdiag MechdiagCallback inside TRL GRPOTrainer")
        update = R.Update(**{k: logged.pop(k) for k in UPDATE_FIELDS if k in logged})
        record = R.StepRecord(step, weights=dict(self.reward_weights or {}), update=update, extra=logged)
        roll = self.rollouts.take() if self.rollouts is not None else None
        path = completion_files(Path(args.output_dir)).get(step)
        if roll is None and path is not None:
            _, rows = completions_rows(path, names, self.reward_weights, args.num_generations)
            roll = {"group_ids": [r["group"] for r in rows], "prompts": [r["prompt"] for r in rows],
                    "texts": [r["completion"] for r in rows], "rewards": [r["reward"] for r in rows],  # None: NaN
                    "advantages": [r["advantage"] for r in rows] if rows and "advantage" in rows[0] else None,
                    "components": {n: [r.get(f"reward/{n}") for r in rows] for n in names}}
        for k, v in (roll or {}).items():
            setattr(record, k, v)
        self.recorder.train(record)

    def _record_eval(self, step: int, model, tokenizer, metrics: dict | None = None) -> None:
        with self.engine.forward():
            self.recorder.eval(step, _peft(model), tokenizer, map_trl_log(metrics or {}, eval_=True),
                               sampler=_peft(model) or model)
        self._last_eval_step = step

    # ---- events -------------------------------------------------------------------------------------
    @_timed
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
        self._t0 = time.perf_counter()
        self.engine = Engine.of(model)
        self.writer = state.is_world_process_zero
        if self.rollouts is not None and self.rollouts.eos is None and processing_class is not None:
            self.rollouts.eos = set(eos_ids(_peft(model) or model, processing_class))
        if not self.writer and not self.engine.sharded:
            return
        if self.writer:
            self.run = RunDir(self.run_dir or Path(args.output_dir) / CALLBACK_DIR, create=True)
            if state.global_step == 0 and self.run.stream("metrics").exists():  # TRL overwrites its output_dir too
                warnings.warn(f"{self.run.path} held an earlier run; its records are replaced", stacklevel=2)
        cfg = self._config(args, model)
        # under a sharded engine every rank computes (collectives), only the writer writes
        self.recorder = R.Recorder(self.run, self._signals(cfg, processing_class, args, model), writer=self.writer,
                                   engine=self.engine if self.engine.sharded else None)
        if self.writer:
            self.run.drop_after(state.global_step if state.global_step else -1)  # resumed: forget what came after
            self.recorder.write_config(cfg, "mechdiag MechdiagCallback inside TRL GRPOTrainer")
            self.recorder.start()
        if self.evaluate is not None and state.global_step == 0:
            self._record_eval(0, model, processing_class)
        # one process holds every trainable parameter: each step's weight change (StepChange, update_norm)
        self.change = StepChange(model) if self.writer and args.world_size == 1 else None

    @_timed
    def on_step_begin(self, args, state, control, **kw):
        if self._on(state):
            self._flush(args)  # the last step's completions parquet is written by now
            self.report.deliver(args, state, control)
        if self.change is not None:
            self.change.begin()

    @_timed
    def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
        if self.max_time_s is not None:  # config max_time_s; rank 0's clock decides so all ranks stop together
            stop = time.perf_counter() - self._t0 > self.max_time_s
            if args.world_size > 1:
                from accelerate.utils import broadcast_object_list  # noqa: PLC0415 - accelerate is part of the optional trl extra

                stop = broadcast_object_list([stop])[0]
            control.should_training_stop = control.should_training_stop or stop
        if self.halt_armed:  # record.halt_on: the writer's alert stops every rank, cleanly
            halt = self.recorder is not None and self.recorder.stop is not None
            if args.world_size > 1:
                from accelerate.utils import broadcast_object_list  # noqa: PLC0415 - accelerate is part of the optional trl extra

                halt = broadcast_object_list([halt])[0]
            control.should_training_stop = control.should_training_stop or halt
        if self.change is not None:
            self._moved[state.global_step] = self.change.end()
        if not self._on(state):
            return
        step = state.global_step  # DefaultFlowCallback ran first
        self._final_record = step >= state.max_steps or control.should_training_stop
        self.recorder.weights(step, _peft(model), last=self._final_record)
        if self.eval_every and step % self.eval_every == 0 and step < state.max_steps:
            self._record_eval(step, model, processing_class)
        self.report.deliver(args, state, control)

    @_timed
    def on_log(self, args, state, control, logs=None, **kw):
        if not self._on(state) or not self.writer or not logs:
            return
        self._flush(args)  # before an eval log: TRL then writes the eval's completions over this step's file
        if is_train_log(logs) and not is_eval_log(logs):
            moved = self._moved.pop(state.global_step, None)
            self._pending = {"step": state.global_step, **map_trl_log(logs),
                             **({"update_norm": moved} if moved is not None else {})}

    @_timed
    def on_evaluate(self, args, state, control, metrics=None, model=None, processing_class=None, **kw):
        if self._on(state):
            self._flush(args)
            self._record_eval(state.global_step, model, processing_class, metrics)
            self.report.deliver(args, state, control)

    @_timed
    def on_train_end(self, args, state, control, model=None, processing_class=None, **kw):
        if not self._on(state):
            return
        if self.writer:
            self._flush(args)
        step = state.global_step  # final diagnostics: the last step is recorded whatever the intervals
        if self.evaluate is not None and self._last_eval_step != step:
            self._record_eval(step, model, processing_class)
        n = self.updates_per_step
        with self.engine.forward():
            self.recorder.end(step, _peft(model), processing_class, {
                "steps": step // n, "planned_steps": state.max_steps // n, "source": "trl",
                "trl_output_dir": str(args.output_dir), "wall_time_s": time.perf_counter() - self._created,
                "recorder_s": self.recorder_s, "recorder_once_s": self.recorder_once_s,
                "config_derived": self._derived, "engine": self.engine.name, "world_size": self.engine.world_size,
                **({"task": None, "eval_n": None} if self._derived else {})})  # a derived config names no task
        if self.writer:
            self.report.deliver(args, state, control)


UPDATE_FIELDS = [f.name for f in dataclasses.fields(R.Update)]


class Evaluate(R.Signal):
    """A user's evaluate(model, tokenizer, step) -> dict, merged into the eval record."""

    def __init__(self, fn):
        self.fn = fn

    def on_eval(self, rec, step, record, ctx):
        record.update(self.fn(ctx["sampler"], ctx["tokenizer"], step))


# ---- the backend: our config through GRPOTrainer ------------------------------------------------------------
class ProgressLines(TrainerCallback):
    """TRL's logs as mechdiag's progress lines (rank 0, at most every ~10 s) instead of raw dicts on stdout."""

    KEYS = (("reward", "reward"), ("kl", "kl"), ("loss", "loss"), ("completions/mean_length", "length"))

    def __init__(self, total: int):
        self.lines = Progress("train step", total=total, force=True)

    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs:
            note = "  ".join(f"{name} {logs[k]:.4g}" for k, name in self.KEYS
                             if isinstance(logs.get(k), (int, float)))
            self.lines.update(state.global_step, note, final="train_runtime" in logs)


def build_trainer(cfg, out_dir, callbacks=None, **overrides):
    """(GRPOTrainer, RunDir, tokenizer): our config mapped onto TRL. TRL's files go to out_dir/trl/; the run
    directory is out_dir itself, so `mechdiag recommend/report out_dir` read it like a native run."""
    import torch  # noqa: PLC0415 - the TRL callback imports without torch until a run starts
    from datasets import Dataset  # noqa: PLC0415 - datasets is loaded only for hf: task paths
    from trl import GRPOTrainer  # noqa: PLC0415 - trl is an optional extra

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.task.mixture:
        raise UserError("--backend trl does not mix data sources yet (task.mixture); use the native backend")
    torch.manual_seed(cfg.seed)
    context = context_of(cfg.model.name_or_path)
    tok = load_tokenizer(cfg.model.name_or_path)
    task = get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
    train_ex = task.examples(cfg.task.train_split, n=cfg.task.n_train, seed=cfg.seed)
    if not train_ex:
        raise UserError(f"task {cfg.task.name} has no training examples")
    prompts = [task.prompt(ex, tok) for ex in train_ex]
    if context is not None:  # TRL decodes each prompt whole: past the context a model crashes or extrapolates
        longest = max(len(ids) for ids in tok(prompts)["input_ids"])
        if longest + cfg.max_completion_tokens > context:
            room = (f"lower max_completion_tokens to {context - longest} or less, or " if longest < context else "")
            raise UserError(f"--backend trl: the longest training prompt is {longest} tokens, and with "
                            f"max_completion_tokens={cfg.max_completion_tokens} it passes the model's context of "
                            f"{context} positions (TRL does not cut prompts); {room}train with the native backend, "
                            "which cuts them")
    run_config(cfg)  # weights resolved, prompt budget fitted (our held-out evals cut prompts to what fits)
    heldout = R.HeldOut.from_config(cfg, tok, task)
    eval_prompts = heldout.prompts
    model, tok = load_model_and_tokenizer(cfg.model.name_or_path, cfg.model.dtype, tokenizer=tok)
    peft_cfg = peft_lora_config(model, cfg.lora) if cfg.lora.enabled else None  # bad modules/layers fail here
    data = Dataset.from_list([{"prompt": p, "example_id": ex.id} for p, ex in zip(prompts, train_ex, strict=True)])
    funcs, weights = task_reward_funcs(task, train_ex, cfg.rewards.weights,
                                       cfg.seed if cfg.rewards.control == "random" else None)
    cv = GroupCV(funcs, weights, group_size=cfg.group_size)
    args = grpo_args(cfg, Path(out_dir) / "trl", reward_weights=weights, **overrides)
    run = RunDir(out_dir, create=True)
    rec = cfg.record
    cb = MechdiagCallback(run_dir=run.path, displacement_every=rec.displacement_every,
                          shift_prompts=eval_prompts if rec.shift_at_eval else None, shift_n=rec.shift_n, config=cfg,
                          evaluate=heldout, eval_every=cfg.eval_every * cfg.updates_per_step,
                          reward_weights=dict(zip([f.__name__ for f in funcs], weights, strict=True)),
                          max_time_s=cfg.max_time_s, forget_tokens=rec.forget_tokens,
                          forget_prompts=forget_prompts(rec.forget_prompts, tok, rec.forget_n)
                          if rec.forget_prompts and cfg.lora.enabled else None,
                          rollouts=cv, updates_per_step=cfg.updates_per_step)
    with peft_refusals(peft_cfg) if peft_cfg is not None else contextlib.nullcontext():  # TRL wraps the model
        trainer = GRPOTrainer(model=model, reward_funcs=cv.funcs, args=args, train_dataset=data,
                              processing_class=tok, peft_config=peft_cfg, callbacks=[cb, *(callbacks or [])])
    from transformers.trainer_callback import (  # noqa: PLC0415 - next to the trainer whose callbacks it edits
        PrinterCallback,
        ProgressCallback,
    )

    trainer.remove_callback(PrinterCallback)  # prints each log dict
    trainer.remove_callback(ProgressCallback)  # a tqdm bar that also writes each log dict
    trainer.add_callback(ProgressLines(args.max_steps))
    cb.attach(trainer)
    # checkpoints (Trainer._save_checkpoint) and the final adapter: the adapter written whole under FSDP1 too
    trainer.save_model = lambda output_dir=None, _internal_call=False: save_adapter(
        trainer, output_dir or args.output_dir)
    return trainer, run, cb


def save_adapter(trainer, folder) -> None:
    """trainer.save_model(folder), except under FSDP1: there peft (0.21) finds no LoRA keys in the full state dict
    (it matches its layers' module paths, which hold FSDP's _fsdp_wrapped_module segments) and writes an empty
    adapter. So every rank gathers the LoRA factors, one wrapped unit at a time (a collective), and rank 0 writes
    them in peft's layout with the adapter config. A collective under FSDP and ZeRO-3: call it on every rank."""
    import torch  # noqa: PLC0415 - the TRL callback imports without torch until a run starts

    engine = Engine.of(trainer.model_wrapped)
    if engine.name != "fsdp1":
        type(trainer).save_model(trainer, str(folder))
        return
    from safetensors.torch import save_file  # noqa: PLC0415 - only when saving under FSDP1

    state = {}
    for name, mod in engine.lora_modules(None):
        for n, p in mod.named_parameters():
            if "lora_" in n:  # whole while yielded; copied to the host before the unit reshards
                state[f"{name}.{clean_name(n)}"] = p.detach().to("cpu", copy=True)
    if not state or any(t.dim() != 2 for t in state.values()):
        raise RuntimeError(f"FSDP1: gathered LoRA factors are not whole matrices ({len(state)} tensors)")
    if trainer.accelerator.is_main_process:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        peft_model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        adapter = peft_model.active_adapter
        peft_model.peft_config[adapter].save_pretrained(str(folder))
        save_file({k.replace(f".{adapter}.", "."): v.contiguous() for k, v in state.items()},
                  str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(folder))
    torch.distributed.barrier()  # the folder is complete before any rank goes on


def train_trl(cfg, out_dir, resume: bool = False, **overrides) -> RunDir | None:
    """`mechdiag train --backend trl`: train `cfg` with TRL's GRPOTrainer into the run directory out_dir
    (TRL's checkpoints in out_dir/trl/checkpoint-N); resume continues from the last of them."""
    run_path = Path(out_dir)
    if not resume and held(run_path):
        raise UserError(f"{run_path} already holds a run; use --resume {run_path} or another --out")
    T.require(cfg.report_to)
    with T.environment(cfg.report_to, run_path):
        trainer, run, cb = build_trainer(cfg, run_path, **overrides)
        ckpts = sorted(run.path.glob("trl/checkpoint-*"), key=lambda p: int(p.name.split("-")[1])) if resume else []
        trainer.train(resume_from_checkpoint=str(ckpts[-1]) if ckpts else None)
        trainer.save_model(str(run.final))  # collective under DeepSpeed; writes on rank 0 only
        main = trainer.is_world_process_zero()  # under accelerate launch only rank 0 writes the run directory
        if main:
            trainer.processing_class.save_pretrained(str(run.final))
        trainer.accelerator.wait_for_everyone()  # all ranks end together, after rank 0's last write
        return run if main else None
