"""The hook protocol: call order, user hooks by import path, and graceful absence of optional recorders."""

from __future__ import annotations

import pytest

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.train.trainer import Trainer
from tests.test_train import small

EVENTS = []


class Recorder:
    def __init__(self, trainer):
        self.trainer = trainer

    def on_start(self, rec):
        EVENTS.append(("start", self.trainer.step))

    def on_train(self, rec, step, record):
        EVENTS.append(("step", step, len(record.rewards), round(rec.latest["metrics"][0]["reward"], 6)))

    def on_eval(self, rec, step, record, ctx):
        EVENTS.append(("eval", step))

    def on_save(self, rec, step, path):
        EVENTS.append(("save", step, (path / "COMPLETE").exists()))

    def on_end(self, rec, step, ctx):
        EVENTS.append(("end", rec.latest["summary"][0]["steps"]))


def test_hooks_called_at_fixed_points(stories260k, tmp_path):
    EVENTS.clear()
    cfg = C.load(None, small(stories260k, "max_steps=3", "save_every=2", "hooks=[tests.test_hooks:Recorder]"))
    Trainer(cfg, tmp_path / "run").fit()
    kinds = [e[0] for e in EVENTS]
    assert kinds == ["start", "eval", "step", "step", "save", "step", "eval", "end"]
    assert EVENTS[2][2] == 2 * 4  # the rollout: prompts x group size
    assert EVENTS[4] == ("save", 2, True)


@pytest.mark.parametrize("spec,msg", [("nocolon", "package.module:factory"), ("no_such_mod:f", "cannot import"),
                                      ("tests.test_hooks:Nope", "no attribute")])
def test_bad_user_hook(spec, msg, stories260k, tmp_path):
    cfg = C.load(None, small(stories260k, "max_steps=1", f"hooks=[{spec}]"))
    with pytest.raises(UserError, match=msg):
        Trainer(cfg, tmp_path / "run")
