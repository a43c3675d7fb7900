"""A user hook that kill -9s the trainer at the point named by $MECHDIAG_TEST_KILL (tests/test_crash.py).

    eval:N     right after the eval of step N is recorded
    step:N     right after step N's records are written, before its checkpoint
    weights:N  inside checkpoint N: the weights are written, optimizer/scheduler/RNG state not yet
    saved:N    right after checkpoint N is complete
    final      after the final weights are written, before the tokenizer, final/ and summary.json
"""

from __future__ import annotations

import os
import signal


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


class Kill:
    def __init__(self, trainer, point: str):
        self.event, _, n = point.partition(":")
        self.n = int(n) if n else None
        if self.event in ("weights", "final"):
            save = trainer._save_weights

            def patched(path):
                save(path)
                in_ck = "checkpoints" in str(path)
                if (self.event == "final" and not in_ck) or \
                        (self.event == "weights" and in_ck and f".step-{self.n}." in str(path)):
                    _die()

            trainer._save_weights = patched

    def on_eval(self, rec, step, record, ctx):
        if self.event == "eval" and step == self.n:
            _die()

    def on_weights(self, rec, step, model, last):
        if self.event == "step" and step == self.n:
            _die()

    def on_save(self, rec, step, path):
        if self.event == "saved" and step == self.n:
            _die()


def kill(trainer):
    return Kill(trainer, os.environ["MECHDIAG_TEST_KILL"])
