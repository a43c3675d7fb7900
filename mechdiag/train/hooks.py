"""Hooks: a small protocol the trainer calls at fixed points, and the built-in recorders.

    on_train_start(trainer)                       after setup (and after a resume has restored state)
    on_step_end(trainer, step, metrics, rollout)  after each optimizer step, with that step's metrics and rollout
    on_eval(trainer, step, metrics)               after each evaluation (step 0 = the base model)
    on_save(trainer, step, path)                  after a checkpoint is complete
    on_train_end(trainer, summary)                once, with the summary

User hooks are named in the config by import path, "package.module:factory"; the factory is called with the
trainer and returns an object with any subset of these methods.
"""

from __future__ import annotations

import importlib
import sys
import time

from mechdiag.alerts import Watcher
from mechdiag.console import Progress as Lines
from mechdiag.displacement import lora_rows
from mechdiag.errors import UserError
from mechdiag.metrics import max_reward
from mechdiag.probes.shift import shift_inmemory
from mechdiag.tasks import reward_weights


class Hook:
    def on_train_start(self, trainer) -> None: ...
    def on_step_end(self, trainer, step: int, metrics: dict, rollout) -> None: ...
    def on_eval(self, trainer, step: int, metrics: dict) -> None: ...
    def on_save(self, trainer, step: int, path) -> None: ...
    def on_train_end(self, trainer, summary: dict) -> None: ...


def call(hooks: list, event: str, *args) -> None:
    for h in hooks:
        fn = getattr(h, event, None)
        if fn is not None:
            fn(*args)


def load_user_hook(spec: str, trainer):
    return hook_factory(spec)(trainer)


def hook_factory(spec: str):
    """The factory named by "package.module:factory" (a UserError when it cannot be found)."""
    if ":" not in spec:
        raise UserError(f"hook {spec!r}: use the form package.module:factory")
    mod_name, attr = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"hook {spec!r}: cannot import {mod_name} ({e})") from None
    factory = getattr(mod, attr, None)
    if factory is None:
        raise UserError(f"hook {spec!r}: {mod_name} has no attribute {attr}")
    return factory


# ---- built-in hooks -------------------------------------------------------------------------------------
class MetricsWriter(Hook):
    """metrics.jsonl every step, eval.jsonl every eval, samples.jsonl every `samples_every` steps (group ids)."""

    def __init__(self, samples_every: int):
        self.samples_every = samples_every

    def on_step_end(self, trainer, step, metrics, rollout):
        trainer.run.append("metrics", {"step": step, **metrics})
        if self.samples_every and step % self.samples_every == 0:
            trainer.run.append("samples", sample_records(step, rollout))

    def on_eval(self, trainer, step, metrics):
        trainer.run.append("eval", {"step": step, **metrics})


def sample_records(step: int, r) -> list[dict]:
    comps = {k: v.tolist() for k, v in r.components.items()}
    rewards, adv, trunc = r.rewards.tolist(), r.advantages.tolist(), r.truncated.tolist()
    lengths = r.completion_mask.sum(-1).tolist()
    return [{"step": step, "split": "train", "group": r.group_ids[i], "example_id": r.example_ids[i],
             "prompt": r.prompts[i], "completion": r.texts[i], "reward": rewards[i], "advantage": adv[i],
             "truncated": trunc[i], "length": lengths[i], **{f"reward/{k}": v[i] for k, v in comps.items()}}
            for i in range(len(r.texts))]


class DisplacementRecorder(Hook):
    """Every `every` steps, rel_fro per layer x module of the effective LoRA weights against the base; the final
    step's rows also carry the update geometry (subspace_overlap, intruders: one pass over each base weight)."""

    def __init__(self, every: int):
        self.every = every

    def _record(self, trainer, step, geometry: bool = False):
        if not trainer.cfg.lora.enabled:
            return
        rows = [{"step": step, **r} for r in lora_rows(trainer.model, geometry=geometry)]
        if step % self.every == 0 and step < trainer.total_steps and geometry:
            trainer.run.replace_step("displacement", step, rows)  # stopped early (max_time_s) at a recorded step
        else:
            trainer.run.append("displacement", rows)

    def on_step_end(self, trainer, step, metrics, rollout):
        if self.every and step % self.every == 0:
            self._record(trainer, step, geometry=step == trainer.total_steps and trainer.cfg.record.final_geometry)

    def on_train_end(self, trainer, summary):
        # The last step too, so every run has final diagnostics (a 6-step run with every=10 would have none).
        if not self.every:
            return
        geometry = trainer.cfg.record.final_geometry
        if trainer.step % self.every:  # not recorded yet
            self._record(trainer, trainer.step, geometry=geometry)
        elif trainer.step < trainer.total_steps and geometry:  # stopped early at a recorded step: add the geometry
            self._record(trainer, trainer.step, geometry=True)


class ShiftRecorder(Hook):
    """At each eval after the base one, the activation shift per layer on held-out prompts (the shift issue)."""

    def __init__(self, n: int):
        self.n = n

    def on_eval(self, trainer, step, metrics):
        if step == 0:
            return
        prompts = trainer.eval_prompts[:self.n]
        rows = shift_inmemory(trainer.model, trainer.tokenizer, prompts, batch_size=min(len(prompts), 64), step=step)
        trainer.run.append("shift", [{**r, "step": step} for r in rows])


class AlertPrinter(Hook):
    """Prints each live alert (mechdiag.alerts) once, when it first fires; after the recorders of the step."""

    def on_train_start(self, trainer):
        self.watcher = Watcher(max_reward(reward_weights(trainer.cfg)))
        run = trainer.run  # a resumed run's records: history for the alerts, already announced
        self.watcher.update(run.read("metrics"), run.read("eval"), run.read("displacement"), announce=False)

    def on_step_end(self, trainer, step, metrics, rollout):
        every = trainer.cfg.record.displacement_every
        disp = [r for r in trainer.run.read("displacement") if r.get("step") == step] \
            if every and step % every == 0 else []
        self.watcher.update(metrics=[{"step": step, **metrics}], displacement=disp)

    def on_eval(self, trainer, step, metrics):
        self.watcher.update(evals=[{"step": step, **metrics}])


class Checkpointer(Hook):
    """checkpoints/step-N/ every `every` steps: adapter (or full model), optimizer, scheduler, RNG states.

    The trainer calls it last in a step, after every other hook and any eval of that step, so that a
    checkpoint at N means every record of steps <= N is on disk."""

    def __init__(self, every: int):
        self.every = every

    def on_step_end(self, trainer, step, metrics, rollout):
        if self.every and step % self.every == 0 and step < trainer.total_steps:
            trainer.save_checkpoint(step)


class ProgressBar(Hook):
    """A rich progress bar with live reward and accuracy; when stderr is not a terminal (nohup, CI logs), a plain
    line per eval and a progress line at most every ~10 s (mechdiag.console.Progress)."""

    def __init__(self):
        self.progress = None
        self.lines = None
        self.acc = float("nan")

    def on_train_start(self, trainer):
        from rich.console import Console  # noqa: PLC0415 - rich progress only when training on a terminal
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: PLC0415 - rich progress only when training on a terminal

        self.console = Console(stderr=True)
        if not self.console.is_terminal:
            self.lines = Lines("train step", total=trainer.total_steps)
            return
        self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"), console=self.console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("train", total=trainer.total_steps, completed=trainer.step,
                                           info="")

    def on_step_end(self, trainer, step, metrics, rollout):
        info = f"reward {metrics['reward']:.3f}  acc {self.acc:.3f}  kl {metrics.get('kl', float('nan')):.4f}"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)
        elif self.lines is not None:
            self.lines.update(step, info)

    def on_eval(self, trainer, step, metrics):
        self.acc = metrics["accuracy"]
        if self.progress is None:
            print(f"eval step {step}: accuracy {metrics['accuracy']:.3f} eval_reward {metrics['eval_reward']:.3f}"
                  f" ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)

    def on_train_end(self, trainer, summary):
        if self.progress is not None:
            self.progress.stop()
