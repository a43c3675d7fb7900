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

import sys
import time

from mechdiag.config import load_object
from mechdiag.console import Progress


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
    return load_object(spec, "hook", "factory")


# ---- built-in hooks -------------------------------------------------------------------------------------
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
    """Train progress with live reward, accuracy and KL (mechdiag.console.Progress: a bar on a terminal, else a
    progress line at most every ~10 s); without a terminal each eval gets a line of its own."""

    def __init__(self):
        self.progress = None
        self.acc = float("nan")

    def on_train_start(self, trainer):
        self.progress = Progress("train step", trainer.total_steps, bar=True, done=trainer.step, transient=False)

    def on_step_end(self, trainer, step, metrics, rollout):
        self.progress.update(step, f"reward {metrics['reward']:.3f}  acc {self.acc:.3f}  "
                                   f"kl {metrics.get('kl', float('nan')):.4f}")

    def on_eval(self, trainer, step, metrics):
        self.acc = metrics["accuracy"]
        if self.progress is None or not self.progress.bar_drawn:
            print(f"eval step {step}: accuracy {metrics['accuracy']:.3f} eval_reward {metrics['eval_reward']:.3f}"
                  f" ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)

    def on_train_end(self, trainer, summary):
        self.progress.close()
