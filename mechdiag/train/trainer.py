"""The GRPO training recipe, read top to bottom in the order it runs: setup (__init__, named steps); fit: evaluate
the base, then per step (train_step) rollout -> its updates (objective.grpo_loss) -> the step's record
(recorder.StepRecord: the recorder computes every signal, then the hooks) -> checkpoint; evaluate; final/.

A step is one rollout of prompts_per_step x steps_per_generation prompts (G completions each; steps_per_generation
defaults to grad_accum), cut into micro-batches of prompts_per_step prompts for the backward passes; every
grad_accum micro-batches make one optimizer update (update_plan), num_iterations times over the rollout. Sampling at
step s is seeded by (seed, s) and the data order by (seed, epoch), so a resumed run replays what an uninterrupted run
would have done.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_model
from transformers import get_scheduler

from mechdiag import atomic, models, sandbox, tasks
from mechdiag import recorder as R
from mechdiag import trackers as T
from mechdiag.config import LR_SCHEDULERS, Config, load_object
from mechdiag.errors import UserError, first_line
from mechdiag.generate import policy_entropy, policy_logprobs_entropy, step_seed
from mechdiag.probes.forget import ForgetProbe
from mechdiag.recorder import StepRecord, Update
from mechdiag.run import RunDir, held
from mechdiag.train import hooks as H
from mechdiag.train import memory
from mechdiag.train import objective as obj
from mechdiag.train.lora import apply_lora, merge_into
from mechdiag.train.rollout import Rollout, collect, policy_logprobs

REFERENCE_WEIGHTS = "reference.safetensors"  # a checkpoint's synced reference (sync_ref_model)


# ---- model ------------------------------------------------------------------------------------------------
def frozen_copy(model):
    out = copy.deepcopy(model).eval()
    for p in out.parameters():
        p.requires_grad_(False)
    return out


# The merged sampler pays where peft's per-module overhead is a large share of a decode step: small models (the
# bundled base: ~30% of decode time). At 0.5B it costs a full copy of the weights for a few percent
# (docs/benchmarks.md, bench/scale.py), so "auto" keeps it up to this many parameters.
SAMPLER_AUTO_MAX_PARAMS = 100_000_000


def sampler_choice(cfg: Config, n_params: int) -> str:
    """"merged" or "adapter" (the model decodes itself): cfg.sampler, with "auto" decided by the model size."""
    if not cfg.lora.enabled:
        return "adapter"
    if cfg.sampler == "auto" and cfg.sampler_dtype is None:
        return "merged" if n_params <= SAMPLER_AUTO_MAX_PARAMS else "adapter"
    return cfg.sampler


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def mix_reference(model, ref_model, alpha: float) -> None:
    """TR-DPO's reference sync: pi_ref <- alpha pi_theta + (1 - alpha) pi_ref, parameter by parameter."""
    for ref, p in zip(ref_model.parameters(), model.parameters(), strict=True):
        ref.mul_(1.0 - alpha).add_(p, alpha=alpha)


def prepare_model(cfg: Config, device: torch.device | str | None = None):
    """(model, tokenizer, ref_model, sampler).

    LoRA wraps the model and the reference is the same model with the adapter disabled; full fine-tuning keeps a
    frozen copy as the reference. `sampler` (LoRA, when sampler_choice says "merged") is an adapter-free copy of
    the base into which the effective weights are written before each rollout and eval, because plain layers
    decode faster; it is None otherwise and the model samples itself.
    """

    model, tok = models.load_model_and_tokenizer(cfg.model.name_or_path, cfg.model.dtype)
    model.to(device or torch.device("cpu"))  # before LoRA: peft puts the factors beside the base weights
    if cfg.gradient_checkpointing:  # only active in train mode: decoding (eval mode) keeps its KV cache
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.enabled:
        n_params = sum(p.numel() for p in model.parameters())
        sampler = frozen_copy(model) if sampler_choice(cfg, n_params) == "merged" else None
        if sampler is not None and cfg.sampler_dtype is not None:
            sampler.to(getattr(torch, cfg.sampler_dtype))
        return apply_lora(model, cfg.lora), tok, None, sampler
    return model, tok, frozen_copy(model), None


def make_scheduler(opt, cfg: Config, total_updates: int):
    return get_scheduler(LR_SCHEDULERS[cfg.lr_schedule], opt,
                         num_warmup_steps=math.ceil(cfg.warmup_ratio * total_updates), num_training_steps=total_updates)


def auto_threads() -> int:
    """All cores, less those other processes keep busy: oversubscribed OpenMP threads spin and run 10x slower."""
    n = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, min(n, n - busy))


def run_config(cfg: Config) -> Config:
    """cfg as it will run, checked before any model loads (both backends, --dry-run): the trackers' libraries
    present, the reward weights filled in and the prompt budget fitted to the model's context, so config.yaml
    shows what ran."""
    T.require(cfg.report_to)
    tasks.resolve_rewards(cfg)
    models.fit_to_context(cfg)
    return cfg


def rollout_record(step: int, roll: Rollout, cfg: Config) -> StepRecord:
    """The rollout part of the native trainer's StepRecord: its completions, one entry each."""
    return StepRecord(step, list(roll.group_ids), {k: v.tolist() for k, v in roll.components.items()},
                      dict(cfg.rewards.weights), roll.rewards.tolist(), roll.completion_mask.sum(-1).tolist(),
                      roll.truncated.tolist(), roll.texts, roll.prompts, roll.example_ids, roll.advantages.tolist())


def step_record(step: int, roll: Rollout, cfg: Config, updates: list[dict], lr: float, rollout_time: float,
                step_time: float, fresh: torch.Tensor | None = None) -> StepRecord:
    """The native trainer's StepRecord: the rollout's completions and the mean of its updates' statistics; the
    KL is the rollout's (k3 of the sampling policy against the reference), whatever beta. `fresh` (B, T): the
    first update's log-probs (NaN where not computed), whose gap to the sampler's goes in `extra`
    (objective.sampler_gap, metrics.SAMPLER_KEYS)."""
    mask = roll.completion_mask
    mean = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0] if k != "skipped"}
    record = rollout_record(step, roll, cfg)
    record.update = Update(**mean, kl=obj.masked_mean(obj.kl_k3(roll.sample_logp, roll.ref_logp), mask).item(),
                           entropy=obj.masked_mean(roll.sample_entropy, mask).item(), lr=lr, step_time=step_time,
                           rollout_time=rollout_time, skipped_updates=sum(u["skipped"] for u in updates))
    if fresh is not None:
        record.extra.update(obj.sampler_gap(fresh, roll.sample_logp, mask))
    return record


def update_plan(n_rows: int, micro: int, accum: int) -> list[list[torch.Tensor]]:
    """A rollout's rows as updates, each of `accum` micro-batches of `micro` consecutive rows (whole groups)."""
    batches = [torch.arange(s, min(s + micro, n_rows)) for s in range(0, n_rows, micro)]
    return [batches[u:u + accum] for u in range(0, len(batches), accum)]


def loss_mask(cfg: Config, roll, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens the loss counts: the completion's, less a truncated completion's under
    mask_truncated_completions (DAPO's overlong filtering)."""
    mask = roll.completion_mask if rows is None else roll.completion_mask[rows]
    if not cfg.mask_truncated_completions:
        return mask
    cut = roll.truncated if rows is None else roll.truncated[rows]
    return mask * (~cut).to(mask.device, mask.dtype).unsqueeze(1)


def update_tokens(cfg: Config, roll) -> float:
    """dapo / cispo / vespo's normaliser (objective.Share.update_tokens): the loss tokens of the whole rollout per
    update, as TRL's num_items_in_batch."""
    return float(loss_mask(cfg, roll).sum()) * cfg.grad_accum / cfg.rollout_micro_batches


def check_data(cfg: Config) -> None:
    """--dry-run's data check: every task (main and mixture) resolves and its training and eval splits have
    examples, so a misspelt name or a missing file fails now rather than after the model is loaded."""
    main = tasks.get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
    if not main.examples(cfg.task.train_split, n=1, seed=cfg.seed):
        raise UserError(f"task {cfg.task.name} has no training examples in split {cfg.task.train_split!r}")
    if not main.examples(cfg.task.eval_split, n=1, seed=0):
        raise UserError(f"task {cfg.task.name} has no examples in eval split {cfg.task.eval_split!r}")
    for s in cfg.task.mixture:
        if not tasks.get_task(s.name, s.path, **s.options).examples("train", n=1, seed=cfg.seed):
            raise UserError(f"mixture task {s.name} has no training examples")


class StepChange:
    """How far one step's updates moved the trainable parameters: ||theta_after - theta_before|| (float64 sums), the
    lr, clipping and optimizer state all in it. Measured where the trainable parameters are at most MAX_ELEMENTS
    (a LoRA's factors: a copy costs nothing); None otherwise (a full fine-tune would need a second model)."""

    MAX_ELEMENTS = 1 << 27

    def __init__(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.on = sum(p.numel() for p in self.params) <= self.MAX_ELEMENTS
        self.before = None

    def begin(self) -> None:
        self.before = [p.detach().clone() for p in self.params] if self.on else None

    def end(self) -> float | None:
        if self.before is None:
            return None
        sq = math.fsum(float((p.detach().double() - b.double()).square().sum())
                       for p, b in zip(self.params, self.before, strict=True))
        self.before = None
        return math.sqrt(sq)


# ---- trainer ----------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: Config, out_dir, resume: bool = False, extra_hooks: list | None = None):
        self.cfg = run_config(cfg)
        self._environment()
        self._model()
        self._data()
        self._optimizer()
        factories = [load_object(s, "hook", "factory") for s in cfg.hooks]  # bad hooks: before any output
        # created only now, so that bad input found above (model, task, data, hooks) leaves no empty run directory
        self.run = RunDir(out_dir, create=True)
        if resume:
            self._resume()
        elif held(self.run.path):
            raise UserError(f"{self.run.path} already holds a run; use --resume {self.run.path} or another --out")
        self.hooks = [H.ProgressBar(self), *(f(self) for f in factories), *(extra_hooks or [])]
        self._recorder(out_dir, resume)

    def _environment(self) -> None:
        """Sandbox, threads, allocator, seeds and device: what the run needs before the model loads."""
        cfg = self.cfg
        # for summary.json; a code task without OS isolation stops here unless the config says sandbox: guard-only
        code = any(tasks.task_class(n).domain == "code" for n in [cfg.task.name, *(s.name for s in cfg.task.mixture)])
        self.isolation = sandbox.use(cfg.sandbox) if code else "none"
        torch.set_num_threads(cfg.threads or auto_threads())
        memory.release_freed_blocks()  # freed activations and caches go back to the OS, not into a kept heap
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device = torch.device(models.device(cfg.device))  # a device that is not here fails before the load

    def _model(self) -> None:
        """The policy, tokenizer, reference and sampler, and what each copy of the weights costs."""
        self.model, self.tokenizer, self.ref_model, self._sampler = prepare_model(self.cfg, self.device)
        self.memory = {"weights_bytes": param_bytes(self.model),
                       "sampler": "merged" if self._sampler is not None else "adapter",
                       "sampler_bytes": param_bytes(self._sampler) if self._sampler is not None else 0,
                       "reference_bytes": param_bytes(self.ref_model) if self.ref_model is not None else 0}

    def _data(self) -> None:
        """The training sources (the task and its mixture), the held-out set and forget probe, the steps."""
        cfg = self.cfg
        self.heldout = R.HeldOut.from_config(cfg, self.tokenizer)
        self.task = self.heldout.task
        self.sources = [(self.task, 1.0)] + [(tasks.get_task(s.name, s.path, **s.options), s.weight)
                                             for s in cfg.task.mixture]
        self.train_examples = [t.examples(cfg.task.train_split if i == 0 else "train", n=cfg.task.n_train,
                                          seed=cfg.seed)
                               for i, (t, _) in enumerate(self.sources)]
        if not self.train_examples[0]:
            raise UserError(f"task {cfg.task.name} has no training examples")
        self.eval_examples, self.eval_prompts = self.heldout.examples, self.heldout.prompts
        self.forget = ForgetProbe.from_config(cfg.record, self.tokenizer, cfg.max_prompt_tokens)
        self.prompts_per_update = cfg.prompts_per_step * cfg.rollout_micro_batches  # a rollout's prompts
        self._perms: dict[int, list[int]] = {}  # epoch -> order of the training examples (batch)
        self.total_steps = cfg.max_steps if cfg.max_steps is not None else \
            max(1, math.ceil((cfg.epochs or 1) * len(self.train_examples[0]) / self.prompts_per_update))

    def _optimizer(self) -> None:
        """The objective (its options), the adaptive entropy controller's state, AdamW and the schedule."""
        cfg = self.cfg
        self.objective = obj.Objective.of(cfg)
        # the adaptive entropy controller's state (checkpointed): its coefficient, the last update's entropy
        self.entropy_coef, self.last_entropy = cfg.entropy_coef, math.inf
        self._window = [0.0, 0.0]  # the update's acting tokens: entropy sum, count
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                     weight_decay=cfg.weight_decay)
        self.sched = make_scheduler(self.opt, cfg, self.total_steps * cfg.updates_per_step)
        self.change = StepChange(self.model)
        self.step, self.bad_steps, self.base_eval = 0, 0, None

    def _recorder(self, out_dir, resume: bool) -> None:
        """The recorder: its signals, then the hooks (train.hooks), then the trackers; config.yaml, written once,
        through it."""
        cfg = self.cfg
        shift = self.eval_prompts[:cfg.record.shift_n] if cfg.record.shift_at_eval else None
        signals = R.signals(cfg, self.heldout, cfg.lora.enabled, self.forget, shift) + self.hooks
        if cfg.report_to:  # last: it reports what the others recorded
            signals.append(T.Report(T.Trackers(cfg.report_to, out_dir, cfg.model_dump(mode="json"), resume)))
        self.recorder = R.Recorder(self.run, signals)
        self.recorder.write_config(cfg, "mechdiag train: resolved config")

    def sampler(self):
        """The module that decodes: the merged copy brought up to date with the adapter, or the model itself."""
        return merge_into(self.model, self._sampler)

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> RunDir:
        t_start = time.perf_counter()
        cfg = self.cfg
        self.recorder.start()
        try:
            if self.base_eval is None:
                self.base_eval = {"step": 0, **self._eval(0)}
            t_train = time.perf_counter()
            for step in range(self.step + 1, self.total_steps + 1):
                record, roll = self.train_step(step)
                self.step = step
                self.recorder.train(record)
                self.recorder.weights(step, self._lora_model(), last=step == self.total_steps)
                if cfg.eval_every and step % cfg.eval_every == 0 and step < self.total_steps:
                    self._eval(step)
                if cfg.save_every and step % cfg.save_every == 0 and step < self.total_steps:
                    self.save_checkpoint(step)  # last in a step: a checkpoint at N has every record of steps <= N
                if self.recorder.stop is not None:  # record.halt_on: a critical alert stops the run cleanly
                    break
                if cfg.max_time_s is not None and time.perf_counter() - t_train > cfg.max_time_s \
                        and step < self.total_steps:
                    warnings.warn(f"max_time_s={cfg.max_time_s:g} reached: stopping after step {step} of "
                                  f"{self.total_steps}", stacklevel=2)
                    break
            self._eval(self.step)  # the final model, not the best checkpoint
            self._save_final()
            self.recorder.end(self.step, self._lora_model(), self.tokenizer, {
                "planned_steps": self.total_steps, "wall_time_s": time.perf_counter() - t_start,
                "sandbox": self.isolation, "memory": self.memory})
        except BaseException:
            for h in self.hooks:
                if isinstance(h, H.ProgressBar) and h.progress is not None:
                    h.progress.close()
            raise
        return self.run

    def _lora_model(self):
        return self.model if self.cfg.lora.enabled else None

    # ---- one step -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[StepRecord, Rollout]:
        """One step, its phases top to bottom: the rollout, its updates (update_plan, num_iterations times over the
        rollout: Config.updates_per_step), the step's record (the sampler gap read off the first update)."""
        t0 = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(step_seed(self.cfg.seed, step))
        roll = collect(self.model, self.tokenizer, self.task, self.batch(step), self.cfg, gen, self.ref_model,
                       sampler=self.sampler())
        t_roll = time.perf_counter() - t0
        lr = self.sched.get_last_lr()[0]
        per_pass = self.plan(roll)
        fresh = torch.full_like(roll.sample_logp, math.nan)  # the first update's log-probs, against the sampler's
        plan = update_plan(len(roll), self.cfg.prompts_per_step * self.cfg.group_size, self.cfg.grad_accum)
        self.change.begin()
        updates = [self.update(step, roll, batches, per_pass, fresh if it == 0 and u == 0 else None)
                   for it in range(self.cfg.num_iterations) for u, batches in enumerate(plan)]
        record = step_record(step, roll, self.cfg, updates, lr, t_roll, time.perf_counter() - t0, fresh)
        record.update.update_norm = self.change.end()
        return record, roll

    def plan(self, roll: Rollout) -> int:
        """Rows per update pass, from the memory model, once per rollout (rows_per_pass); summary.json's predicted
        peak (and its phases) keeps the largest step's."""
        m, shape = self.memory, memory.shape_of(self.model, roll)
        per_pass = self.rows_per_pass(roll)
        pred = memory.predicted_peak(shape, m["weights_bytes"] + m["sampler_bytes"] + m["reference_bytes"], per_pass,
                                     next(self.model.parameters()).element_size())
        if pred["predicted_peak_bytes"] > m.get("predicted_peak_bytes", 0):
            m.update(pred)
        return per_pass

    def rows_per_pass(self, roll: Rollout) -> int:
        """cfg.update_rows, or the rows whose update pass fits in half the weights' bytes (mechdiag.train.memory:
        saved activations per token, the vocabulary's logits and their gradient counted). A whole micro-batch when
        the objective reads its entropies (the quantile's threshold and the bonus's mean are the micro-batch's)."""
        if self.objective.entropy_needed:
            return len(roll)
        return self.cfg.update_rows or memory.rows_per_pass(memory.shape_of(self.model, roll),
                                                            self.memory["weights_bytes"])

    def update(self, step: int, roll: Rollout, batches: list[torch.Tensor], per_pass: int,
               record: torch.Tensor | None = None) -> dict:
        """One optimizer update on `batches` (grad_accum micro-batches of the rollout, update_plan): each
        micro-batch's loss in passes of `per_pass` rows (shares that sum to it), backward, clip, step; skipped when
        the loss or gradient is not finite; then the reference sync and the entropy controller. Returns the
        micro-batches' mean loss and clip fractions, the grad norm, the entropy coefficient for the next update
        (adaptive) and whether it was skipped. `record` (B, T) receives the log-probs computed."""
        cfg, model = self.cfg, self.model
        objective = dataclasses.replace(self.objective, entropy_coef=obj.applied_entropy_coef(
            self.entropy_coef, self.last_entropy, cfg.entropy_target, cfg.use_adaptive_entropy))
        tokens = update_tokens(cfg, roll)
        self._window = [0.0, 0.0]
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for rows in batches:
            for c in range(0, len(rows), per_pass):  # shares of the micro-batch's loss: they sum to it
                loss, st = self._micro_loss(roll, rows[c:c + per_pass], of=rows, update_tokens=tokens, record=record,
                                            objective=objective)
                st["loss"] = loss.item() * cfg.grad_accum  # the micro-batch's, as the update's loss averages them
                if math.isfinite(sums.get("loss", 0.0)) and math.isfinite(st["loss"]) and loss.requires_grad:
                    loss.backward()  # the objective divides by the accumulation (objective.Share)
                for k, v in st.items():
                    sums[k] = sums.get(k, 0.0) + v
        stats = {k: v / len(batches) for k, v in sums.items()}
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # a pass with no signal still steps AdamW (momentum, decay), as it would with zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        finite = math.isfinite(stats["loss"])
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)) if finite else math.nan
        stats["skipped"] = not math.isfinite(stats["grad_norm"])
        if stats["skipped"]:
            self.bad_steps += 1
            self.opt.zero_grad(set_to_none=True)
            warnings.warn(f"step {step}: non-finite loss or gradient; update skipped", stacklevel=3)
            if self.bad_steps >= cfg.max_bad_steps:
                raise UserError(f"{self.bad_steps} non-finite updates in a row (last at step {step}); "
                                "lower learning_rate or check the rewards")
        else:
            self.opt.step()
            self.bad_steps = 0
        self.sched.step()
        if cfg.sync_ref_model and self.sched.last_epoch % cfg.ref_model_sync_steps == 0:  # updates so far
            mix_reference(model, self.ref_model, cfg.ref_model_mixup_alpha)
        if cfg.use_adaptive_entropy:  # the coefficient for the next update, from this one's entropy
            self.last_entropy = self._window[0] / max(self._window[1], 1.0)
            self.entropy_coef = obj.adapt_entropy_coef(self.entropy_coef, self.last_entropy, cfg.entropy_target,
                                                       cfg.entropy_coef_delta, cfg.entropy_coef_min,
                                                       cfg.entropy_coef_max)
            stats["entropy_coef"] = self.entropy_coef
        return stats

    def _micro_loss(self, roll, rows: torch.Tensor, of: torch.Tensor | None = None,
                    update_tokens: float | None = None, record: torch.Tensor | None = None,
                    objective: obj.Objective | None = None) -> tuple[torch.Tensor, dict]:
        """The loss of rows `rows` as their share of micro-batch `of` (default: rows itself) in an update of
        grad_accum micro-batches; the objective (mechdiag.train.objective.grpo_loss) weighs it by the counts in
        its Share, so the shares sum to the update's loss.

        When a completion whose advantage is 0 has exactly zero loss and gradient (Objective.
        zero_advantage_rows_vanish: beta = 0, no entropy term) it is left out of the forward pass (often half the
        batch: groups with equal rewards); the objective is told the counts. Under top_entropy_quantile alone
        (zero_advantage_rows_in_quantile_only) such rows run a forward without gradient, for the quantile.
        """
        cfg, o = self.cfg, objective or self.objective
        pool_only = o.zero_advantage_rows_in_quantile_only
        zero = roll.advantages[rows].cpu() == 0
        keep = rows[~zero] if o.zero_advantage_rows_vanish or pool_only else rows
        of = rows if of is None else of
        n_tokens = int(loss_mask(cfg, roll, of).sum())
        if len(keep) == 0:
            return torch.zeros(()), {"clip_fraction_low": 0.0, "clip_fraction_high": 0.0, "policy_clip_fraction": 0.0}
        mb = roll.select(keep)
        mask = loss_mask(cfg, mb)
        # a group's prompt runs once; not under checkpointing (no KV cache in train mode) nor LoRA dropout (each
        # row's prompt would no longer draw its own dropout mask)
        shared = not cfg.gradient_checkpointing and not (cfg.lora.enabled and cfg.lora.dropout > 0)
        prompt_of = torch.tensor(mb.group_ids) if shared else None
        entropy = None
        if o.entropy_needed:  # log-probs and entropy from one chunked pass over the head
            logp, entropy = policy_logprobs_entropy(self.model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                                    mb.completion_mask, cfg.temperature, prompt_of=prompt_of)
            if not (o.entropy_coef != 0.0 or o.use_adaptive_entropy):  # the quantile alone reads it: no gradient
                entropy = entropy.detach()
        else:
            logp = policy_logprobs(self.model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
                                   cfg.temperature, prompt_of=prompt_of)
        if record is not None:
            record[keep.to(record.device), :logp.size(1)] = logp.detach()
        share = obj.Share(rows=len(of), tokens=n_tokens, accum=cfg.grad_accum, update_tokens=update_tokens)
        pool = None  # the quantile's values: every row's tokens, those left out computed without gradient
        if pool_only and bool(zero.any()):
            rest = roll.select(rows[zero])
            ent = policy_entropy(self.model, rest.prompt_ids, rest.prompt_mask, rest.completion_ids,
                                 rest.completion_mask, cfg.temperature,
                                 torch.tensor(rest.group_ids) if shared else None)
            pool = torch.cat([entropy.detach()[mask.bool()], ent[loss_mask(cfg, rest).bool()]])
        loss, st = obj.grpo_loss(logp, mb.old_logp, mb.ref_logp, mb.advantages, mask, o, share, entropy=entropy,
                                 entropy_pool=pool)
        if o.use_adaptive_entropy:  # the controller reads the whole update's acting tokens
            acts = obj.acting_tokens(entropy, mask, o).detach()
            self._window[0] += float((entropy.detach() * acts).sum())
            self._window[1] += float(acts.sum())
        st.pop("kl", None)  # the logged KL is the rollout's (step_record), whatever beta
        return loss, st

    # ---- data -----------------------------------------------------------------------------------------
    def batch(self, step: int) -> list:
        """The prompts of step `step` (1-based): a slice of the epoch's permutation, or a weighted mixture."""
        k = self.prompts_per_update
        main = self.train_examples[0]
        if len(self.sources) == 1:
            start = (step - 1) * k
            out = []
            for j in range(start, start + k):
                epoch, i = divmod(j, len(main))
                out.append(main[self._permutation(epoch)[i]])
            return out
        rng = random.Random(step_seed(self.cfg.seed, step, 2))
        weights = [w for _, w in self.sources]
        picks = rng.choices(range(len(self.sources)), weights=weights, k=k)
        return [rng.choice(self.train_examples[s]) for s in picks]

    def _permutation(self, epoch: int) -> list[int]:
        """The order of the training examples in `epoch`, shuffled once per epoch, not once per prompt."""
        if epoch not in self._perms:
            perm = list(range(len(self.train_examples[0])))
            random.Random(step_seed(self.cfg.seed, epoch, 1)).shuffle(perm)
            self._perms[epoch] = perm
        return self._perms[epoch]

    # ---- evaluation -----------------------------------------------------------------------------------
    def _eval(self, step: int) -> dict:
        """The held-out evaluation and the signals of an eval (forget_kl, shift), recorded; then the eval hooks."""
        record = self.recorder.eval(step, self.model, self.tokenizer, sampler=self.sampler(), ref_model=self.ref_model)
        return {k: v for k, v in record.items() if k != "step"}

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _save_weights(self, path: Path) -> None:
        self.model.save_pretrained(path)

    def save_checkpoint(self, step: int) -> Path:
        def save(folder: Path) -> None:
            self._save_weights(folder)
            torch.save(self.opt.state_dict(), folder / "optimizer.pt")
            torch.save(self.sched.state_dict(), folder / "scheduler.pt")
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, folder / "rng.pt")
            if self.cfg.sync_ref_model:  # the reference moved: it is state
                save_model(self.ref_model, str(folder / REFERENCE_WEIGHTS))
            atomic.write_json(folder / "trainer_state.json", {
                "step": step, "bad_steps": self.bad_steps, "entropy_coef": self.entropy_coef,
                "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy})

        final = self.run.write_checkpoint(step, save)
        self.recorder.save(step, final)
        return final

    def _save_final(self) -> None:
        def save(folder: Path) -> None:
            self._save_weights(folder)
            self.tokenizer.save_pretrained(folder)

        self.run.write_final(save)

    def _load_weights(self, path: Path) -> None:
        if self.cfg.lora.enabled:
            models.load_adapter_weights(self.model, path)
        else:
            files = sorted(path.glob("*.safetensors"))
            state = {}
            for f in files:
                state.update(load_file(f))
            self.model.load_state_dict(state, strict=False)

    def _resume(self) -> None:
        steps = self.run.checkpoint_steps()
        if not steps:  # nothing durable yet: start over in the same directory
            self.run.drop_after(-1)
            return
        last = steps[-1]
        ck = self.run.checkpoint(last)
        try:
            self._load_weights(ck)
            self.opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
            self.sched.load_state_dict(torch.load(ck / "scheduler.pt", weights_only=True))
            if self.cfg.sync_ref_model:
                load_model(self.ref_model, str(ck / REFERENCE_WEIGHTS))
            rng = torch.load(ck / "rng.pt", weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            state = json.loads((ck / "trainer_state.json").read_text())
        except Exception as e:  # a checkpoint damaged after it was written (COMPLETE is set only when whole)
            raise UserError(f"checkpoint {ck} is damaged ({type(e).__name__}: {first_line(e, 200)}); delete it to "
                            "resume from the one before") from None
        self.step, self.bad_steps = int(state["step"]), int(state["bad_steps"])
        self.entropy_coef = float(state.get("entropy_coef", self.cfg.entropy_coef))
        self.last_entropy = math.inf if state.get("last_entropy") is None else float(state["last_entropy"])
        self.run.drop_after(self.step)
        base = [r for r in self.run.read("eval") if r["step"] == 0]
        self.base_eval = base[0] if base else None


def train(cfg: Config, out_dir, resume: bool = False, hooks: list | None = None) -> RunDir:
    """Train with GRPO under `cfg` into the run directory `out_dir` (resume: continue from its last checkpoint)."""
    return Trainer(cfg, out_dir, resume=resume, extra_hooks=hooks).fit()
