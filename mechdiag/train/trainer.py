"""The GRPO training recipe, read top to bottom in the order it runs: setup (__init__); fit: evaluate the base,
then per step (train_step) rollout -> advantages -> num_iterations clipped-surrogate updates -> hooks (metrics,
recorders, checkpoint); evaluate; checkpoints (written through mechdiag.run).

A step is one rollout of prompts_per_step x grad_accum prompts (G completions each) followed by
num_iterations optimizer updates on it; the rollout is split into grad_accum micro-batches of
prompts_per_step prompts for the backward passes. Sampling at step s uses a generator seeded by (seed, s)
and the data order is a function of (seed, epoch), so a resumed run replays exactly what an uninterrupted
run would have done.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
import warnings
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import get_scheduler

from mechdiag import atomic, models, sandbox, tasks
from mechdiag import recorder as R
from mechdiag import trackers as T
from mechdiag.config import LR_SCHEDULERS, Config, save
from mechdiag.errors import UserError, first_line
from mechdiag.generate import step_seed
from mechdiag.outcomes import outcomes_from
from mechdiag.probes.forget import ForgetProbe
from mechdiag.run import RunDir, held
from mechdiag.train import hooks as H
from mechdiag.train import memory
from mechdiag.train import objective as obj
from mechdiag.train.lora import apply_lora, merge_into
from mechdiag.train.rollout import collect, policy_logprobs
from mechdiag.weights import ADAPTER_WEIGHTS


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
    if cfg.sampler == "auto":
        return "merged" if n_params <= SAMPLER_AUTO_MAX_PARAMS else "adapter"
    return cfg.sampler


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


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


def check_data(cfg: Config) -> None:
    """--dry-run's data check: every task (main and mixture) resolves and its training and eval splits have
    examples, so a misspelt name or a missing file fails now rather than after the model is loaded."""
    T.require(cfg.report_to)
    main = tasks.get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
    if not main.examples(cfg.task.train_split, n=1, seed=cfg.seed):
        raise UserError(f"task {cfg.task.name} has no training examples in split {cfg.task.train_split!r}")
    if not main.examples(cfg.task.eval_split, n=1, seed=0):
        raise UserError(f"task {cfg.task.name} has no examples in eval split {cfg.task.eval_split!r}")
    for s in cfg.task.mixture:
        if not tasks.get_task(s.name, s.path, **s.options).examples("train", n=1, seed=cfg.seed):
            raise UserError(f"mixture task {s.name} has no training examples")


# ---- trainer ----------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: Config, out_dir, resume: bool = False, extra_hooks: list | None = None):
        self.cfg = cfg
        T.require(cfg.report_to)  # a tracker's missing library: before the model loads
        tasks.resolve_rewards(cfg)  # before config.yaml is saved: it shows the weights that ran
        # for summary.json; a code task without OS isolation stops here unless the config says sandbox: guard-only
        code = any(tasks.task_class(n).domain == "code" for n in [cfg.task.name, *(s.name for s in cfg.task.mixture)])
        self.isolation = sandbox.use(cfg.sandbox) if code else "none"
        torch.set_num_threads(cfg.threads or auto_threads())
        memory.release_freed_blocks()  # freed activations and caches go back to the OS, not into a kept heap
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device = torch.device(models.device(cfg.device))  # a device that is not here fails before the load
        models.fit_to_context(cfg)  # a completion budget the model's context cannot hold fails before the load too
        self.model, self.tokenizer, self.ref_model, self._sampler = prepare_model(cfg, self.device)
        # what the copies cost: the reference (full fine-tuning) or the merged sampler (LoRA) is one more model
        self.memory = {"weights_bytes": param_bytes(self.model),
                       "sampler": "merged" if self._sampler is not None else "adapter",
                       "sampler_bytes": param_bytes(self._sampler) if self._sampler is not None else 0,
                       "reference_bytes": param_bytes(self.ref_model) if self.ref_model is not None else 0}
        self.task = tasks.get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
        self.sources = [(self.task, 1.0)] + [(tasks.get_task(s.name, s.path, **s.options), s.weight)
                                             for s in cfg.task.mixture]
        self.train_examples = [t.examples(cfg.task.train_split if i == 0 else "train", n=cfg.task.n_train,
                                          seed=cfg.seed)
                               for i, (t, _) in enumerate(self.sources)]
        if not self.train_examples[0]:
            raise UserError(f"task {cfg.task.name} has no training examples")
        self.heldout = R.HeldOut(cfg, self.task, self.task.examples(cfg.task.eval_split, n=cfg.eval_n, seed=0), [])
        self.eval_examples = self.heldout.examples
        self.eval_prompts = self.heldout.prompts = [self.task.prompt(ex, self.tokenizer) for ex in self.eval_examples]
        self.forget = ForgetProbe.from_config(cfg.record, self.tokenizer, cfg.max_prompt_tokens)
        self.prompts_per_update = cfg.prompts_per_step * cfg.grad_accum
        self._perms: dict[int, list[int]] = {}  # epoch -> order of the training examples (batch)
        if cfg.max_steps is not None:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = max(1, math.ceil((cfg.epochs or 1) * len(self.train_examples[0])
                                                / self.prompts_per_update))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                     weight_decay=cfg.weight_decay)
        self.sched = make_scheduler(self.opt, cfg, self.total_steps * cfg.num_iterations)
        self.step, self.bad_steps, self.base_eval = 0, 0, None
        for spec in cfg.hooks:  # a hook that cannot be imported is bad input too: find it before any output
            H.hook_factory(spec)
        signals = R.signals(cfg, self.tokenizer, self.heldout, cfg.lora.enabled, self.forget, self.eval_prompts)
        if cfg.report_to:  # last: it reports what the others recorded
            signals.append(T.Report(T.Trackers(cfg.report_to, out_dir, cfg.model_dump(mode="json"), resume)))
        # created only now, so that bad input found above (model, task, data, hooks) leaves no empty run directory
        self.run = RunDir(out_dir, create=True)
        if resume:
            self._resume()
        elif held(self.run.path):
            raise UserError(f"{self.run.path} already holds a run; use --resume {self.run.path} or another --out")
        save(cfg, self.run.config_path, header="mechdiag train: resolved config")
        self.recorder = R.Recorder(self.run, signals)
        self.hooks = [H.Recording(self.recorder), H.ProgressBar()]
        self.hooks += [H.load_user_hook(s, self) for s in cfg.hooks] + list(extra_hooks or [])
        self.checkpointer = H.Checkpointer(cfg.save_every)

    def sampler(self):
        """The module that decodes: the merged copy brought up to date with the adapter, or the model itself."""
        return merge_into(self.model, self._sampler)

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> RunDir:
        t_start = time.perf_counter()
        cfg = self.cfg
        H.call(self.hooks, "on_train_start", self)
        try:
            if self.base_eval is None:
                self.base_eval = {"step": 0, **self._eval(0)}
            t_train = time.perf_counter()
            for step in range(self.step + 1, self.total_steps + 1):
                metrics, roll = self.train_step(step)
                self.step = step
                H.call(self.hooks, "on_step_end", self, step, metrics, roll)
                if cfg.eval_every and step % cfg.eval_every == 0 and step < self.total_steps:
                    self._eval(step)
                self.checkpointer.on_step_end(self, step, metrics, roll)
                if self.recorder.stop is not None:  # record.halt_on: a critical alert stops the run cleanly
                    break
                if cfg.max_time_s is not None and time.perf_counter() - t_train > cfg.max_time_s \
                        and step < self.total_steps:
                    warnings.warn(f"max_time_s={cfg.max_time_s:g} reached: stopping after step {step} of "
                                  f"{self.total_steps}", stacklevel=2)
                    break
            last_eval = self._eval(self.step)  # the final model, not the best checkpoint
            self._save_final()
            summary = {"steps": self.step, "planned_steps": self.total_steps, "seed": cfg.seed,
                       "model": cfg.model.name_or_path, "task": cfg.task.name, "eval_n": len(self.eval_examples),
                       "base_accuracy": self.base_eval["accuracy"], "final_accuracy": last_eval["accuracy"],
                       "accuracy_gain": last_eval["accuracy"] - self.base_eval["accuracy"],
                       "base_eval_reward": self.base_eval["eval_reward"], "final_eval_reward": last_eval["eval_reward"],
                       "wall_time_s": time.perf_counter() - t_start, "sandbox": self.isolation,
                       "memory": self.memory}
            self.run.write_summary(summary)
            H.call(self.hooks, "on_train_end", self, summary)
        except BaseException:
            for h in self.hooks:
                if isinstance(h, H.ProgressBar) and h.progress is not None:
                    h.progress.close()
            raise
        return self.run

    # ---- one step -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[dict, object]:
        cfg, model = self.cfg, self.model
        t0 = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(step_seed(cfg.seed, step))
        roll = collect(model, self.tokenizer, self.task, self.batch(step), cfg, gen, self.ref_model,
                       sampler=self.sampler())
        t_roll = time.perf_counter() - t0
        model.train()
        micro = cfg.prompts_per_step * cfg.group_size
        stats: dict[str, list[float]] = {}
        lr = self.sched.get_last_lr()[0]
        skipped = 0
        n = len(roll)
        for _ in range(cfg.num_iterations):
            self.opt.zero_grad(set_to_none=True)
            finite = True
            per_pass = self.rows_per_pass(roll)
            self._predict_peak(roll, per_pass)
            for s in range(0, n, micro):
                rows = torch.arange(s, min(s + micro, n))
                summed: dict[str, float] = {}
                for c in range(0, len(rows), per_pass):  # shares of the micro-batch's loss: they sum to it
                    loss, st = self._micro_loss(roll, rows[c:c + per_pass], of=rows)
                    st["loss"] = loss.item()
                    finite = finite and math.isfinite(st["loss"])
                    if finite and loss.requires_grad:
                        (loss / cfg.grad_accum).backward()
                    for k, v in st.items():
                        summed[k] = summed.get(k, 0.0) + v
                for k, v in summed.items():
                    stats.setdefault(k, []).append(v)
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:  # a pass with no signal still steps AdamW (momentum, decay), as it would with zeros
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)) if finite else math.nan
            stats.setdefault("grad_norm", []).append(grad_norm)
            if finite and math.isfinite(grad_norm):
                self.opt.step()
                self.bad_steps = 0
            else:
                skipped += 1
                self.bad_steps += 1
                self.opt.zero_grad(set_to_none=True)
                warnings.warn(f"step {step}: non-finite loss or gradient; update skipped", stacklevel=2)
                if self.bad_steps >= cfg.max_bad_steps:
                    raise UserError(f"{self.bad_steps} non-finite updates in a row (last at step {step}); "
                                    "lower learning_rate or check the rewards")
            self.sched.step()
        dt = time.perf_counter() - t0
        n_tok = int(roll.completion_mask.sum())
        m_all = roll.completion_mask
        stats["entropy"] = [obj.masked_mean(roll.sample_entropy, m_all).item()]
        if "kl" not in stats:  # beta = 0: no penalty computed it; measure it on the rollout
            stats["kl"] = [obj.masked_mean(obj.kl_k3(roll.sample_logp, roll.ref_logp), m_all).item()]
        g = obj.group_stats(roll.rewards, cfg.group_size)
        metrics = {"reward": roll.rewards.mean().item(), **g,
                   **outcomes_from(roll.rewards, roll.components, roll.group_ids),
                   "completion_clipped_ratio": roll.truncated.float().mean().item(),
                   "completion_length": n_tok / len(roll),
                   **{k: float(sum(v) / len(v)) for k, v in stats.items()},
                   **{f"reward/{k}": v.mean().item() for k, v in roll.components.items()},
                   "lr": lr, "step_time": dt, "rollout_time": t_roll, "tokens_per_s": n_tok / dt,
                   "skipped_updates": skipped}
        return metrics, roll

    def rows_per_pass(self, roll) -> int:
        """cfg.update_rows, or the rows whose update pass fits in half the weights' bytes (mechdiag.train.memory:
        saved activations per token, the vocabulary's logits and their gradient counted)."""
        if self.cfg.update_rows:
            return self.cfg.update_rows
        return memory.rows_per_pass(memory.shape_of(self.model, roll), self.memory["weights_bytes"])

    def _predict_peak(self, roll, per_pass: int) -> None:
        """summary.json's memory.predicted_peak_bytes (and its phases): the largest step's, by the memory model."""
        m = self.memory
        elem = next(self.model.parameters()).element_size()
        copies = m["weights_bytes"] + m["sampler_bytes"] + m["reference_bytes"]
        pred = memory.predicted_peak(memory.shape_of(self.model, roll), copies, per_pass, elem)
        if pred["predicted_peak_bytes"] > m.get("predicted_peak_bytes", 0):
            m.update(pred)

    def _micro_loss(self, roll, rows: torch.Tensor, of: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """The loss of rows `rows` as their share of micro-batch `of` (default: rows itself); the objective
        (mechdiag.train.objective.grpo_loss) weighs it by the micro-batch's counts, so the shares sum to its loss.

        With beta = 0 a completion whose advantage is 0 has exactly zero loss and gradient, so it is left out of
        the forward pass (often half the batch: groups with equal rewards); the objective is told the counts.
        """
        cfg = self.cfg
        keep = rows[roll.advantages[rows].cpu() != 0] if cfg.beta == 0 else rows
        of = rows if of is None else of
        n_tokens = int(roll.completion_mask[of].sum())
        if len(keep) == 0:
            return torch.zeros(()), {"clip_fraction_low": 0.0, "clip_fraction_high": 0.0, "policy_clip_fraction": 0.0}
        mb = roll.select(keep)
        # a group's prompt runs once; not under checkpointing (no KV cache in train mode) nor LoRA dropout (each
        # row's prompt would no longer draw its own dropout mask)
        shared = not cfg.gradient_checkpointing and not (cfg.lora.enabled and cfg.lora.dropout > 0)
        logp = policy_logprobs(self.model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
                               cfg.temperature, prompt_of=torch.tensor(mb.group_ids) if shared else None)
        loss, st = obj.grpo_loss(logp, mb.old_logp, mb.ref_logp, mb.advantages, mb.completion_mask,
                                 epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                 loss_type=cfg.loss_type, max_completion_tokens=cfg.max_completion_tokens,
                                 n_rows=len(of), n_tokens=n_tokens)
        if "kl" in st:  # a token mean over these rows: weighted so the passes' values sum to the micro-batch's
            st["kl"] *= int(mb.completion_mask.sum()) / max(n_tokens, 1)
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
        metrics = {k: v for k, v in record.items() if k != "step"}
        H.call(self.hooks, "on_eval", self, step, metrics)
        return metrics

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _save_weights(self, path: Path) -> None:
        self.model.save_pretrained(path)

    def save_checkpoint(self, step: int) -> Path:
        def save(folder: Path) -> None:
            self._save_weights(folder)
            torch.save(self.opt.state_dict(), folder / "optimizer.pt")
            torch.save(self.sched.state_dict(), folder / "scheduler.pt")
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, folder / "rng.pt")
            atomic.write_json(folder / "trainer_state.json", {"step": step, "bad_steps": self.bad_steps})

        final = self.run.write_checkpoint(step, save)
        H.call(getattr(self, "hooks", []), "on_save", self, step, final)
        return final

    def _save_final(self) -> None:
        def save(folder: Path) -> None:
            self._save_weights(folder)
            self.tokenizer.save_pretrained(folder)

        self.run.write_final(save)

    def _load_weights(self, path: Path) -> None:

        if self.cfg.lora.enabled:

            set_peft_model_state_dict(self.model, load_file(path / ADAPTER_WEIGHTS))
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
            rng = torch.load(ck / "rng.pt", weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            state = json.loads((ck / "trainer_state.json").read_text())
        except Exception as e:  # a checkpoint damaged after it was written (COMPLETE is set only when whole)
            raise UserError(f"checkpoint {ck} is damaged ({type(e).__name__}: {first_line(e, 200)}); delete it to "
                            "resume from the one before") from None
        self.step, self.bad_steps = int(state["step"]), int(state["bad_steps"])
        self.run.drop_after(self.step)
        base = [r for r in self.run.read("eval") if r["step"] == 0]
        self.base_eval = base[0] if base else None


def train(cfg: Config, out_dir, resume: bool = False, hooks: list | None = None) -> RunDir:
    """Train with GRPO under `cfg` into the run directory `out_dir` (resume: continue from its last checkpoint)."""
    return Trainer(cfg, out_dir, resume=resume, extra_hooks=hooks).fit()
