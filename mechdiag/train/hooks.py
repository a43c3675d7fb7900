"""Hooks: the native trainer's user objects, on the recorder's one protocol (mechdiag.recorder.Signal: the same
events, the same arguments). A hook is named in the config by import path, `hooks: [package.module:factory]`;
the factory is called with the trainer (a hook may act on it) and returns an object with any subset of

    on_start(rec)                       after setup (and after a resume has restored state)
    on_train(rec, step, record)         a step's StepRecord; rec.latest["metrics"][0]: its computed metrics
    on_weights(rec, step, model, last)  after the step's updates, its records written (before its checkpoint)
    on_eval(rec, step, record, ctx)     after each evaluation (step 0 = the base model); record: the eval record
    on_save(rec, step, path)            after a checkpoint is complete
    on_end(rec, step, ctx)              once; rec.latest["summary"][0]: summary.json

The trainer adds them to its recorder after the built-in signals (a Signal subclass with a `name` may return
records to its own stream).
"""

from __future__ import annotations

import math
import sys
import time

from mechdiag.console import Progress
from mechdiag.recorder import Signal


class ProgressBar(Signal):
    """Train progress with live reward, accuracy and KL (mechdiag.console.Progress: a bar on a terminal, else a
    progress line at most every ~10 s); without a terminal each eval gets a line of its own."""

    def __init__(self, trainer):
        self.trainer, self.progress, self.acc = trainer, None, math.nan

    def on_start(self, rec):
        self.progress = Progress("train step", self.trainer.total_steps, bar=True, done=self.trainer.step,
                                 transient=False)

    def on_train(self, rec, step, record):
        m = rec.latest["metrics"][0]
        self.progress.update(step, f"reward {m['reward']:.3f}  acc {self.acc:.3f}  kl {m.get('kl', math.nan):.4f}")

    def on_eval(self, rec, step, record, ctx):
        self.acc = record["accuracy"]
        if self.progress is None or not self.progress.bar_drawn:
            print(f"eval step {step}: accuracy {record['accuracy']:.3f} eval_reward {record['eval_reward']:.3f}"
                  f" ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)

    def on_end(self, rec, step, ctx):
        self.progress.close()
