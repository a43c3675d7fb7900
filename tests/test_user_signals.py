"""A user's signal: registered by import path like the built-in ones, written to its own run-directory stream,
read back by load_run; the same class through MechdiagCallback(signals=) on the real TRL path."""

from __future__ import annotations

import pytest

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.recorder import Signal, user_signal
from mechdiag.run import load_run
from mechdiag.train.trainer import train
from tests.test_train import small


class RewardGap(Signal):
    """Per step: the best reward component's mean minus the total reward; per eval: accuracy x 2."""

    name = "reward_gap"

    def on_train(self, rec, step, record):
        metrics = rec.latest["metrics"][0]  # the step's metrics, computed from its record before this signal
        parts = [v for k, v in metrics.items() if k.startswith("reward/")]
        return [{"step": step, "gap": max(parts) - metrics["reward"]}]

    def on_eval(self, rec, step, record, ctx):
        return [{"step": step, "double_accuracy": 2 * record["accuracy"]}] if "accuracy" in record else None


class Nameless(Signal):
    def on_train(self, rec, step, record):
        return [{"step": step}]


def test_user_signal_native(stories260k, tmp_path):
    cfg = C.load(None, small(stories260k, "max_steps=2", "record.signals=[tests.test_user_signals:RewardGap]"))
    run = load_run(train(cfg, tmp_path / "run").path)
    rows = run.read("reward_gap")
    metrics, evals = run.read("metrics"), run.read("eval")
    train_rows = [r for r in rows if "gap" in r]
    assert [r["step"] for r in train_rows] == [m["step"] for m in metrics] == [1, 2]
    for r, m in zip(train_rows, metrics, strict=True):
        assert r["gap"] == max(v for k, v in m.items() if k.startswith("reward/")) - m["reward"]
    assert [r["double_accuracy"] for r in rows if "double_accuracy" in r] == [2 * e["accuracy"] for e in evals]
    assert (tmp_path / "run" / "signals" / "reward_gap.jsonl").exists()


@pytest.mark.parametrize("spec,msg", [("nocolon", "package.module:Class"), ("no_such_mod:X", "cannot import"),
                                      ("tests.test_user_signals:Nope", "no attribute"),
                                      ("tests.test_user_signals:Nameless", "must give")])
def test_bad_user_signal(spec, msg):
    with pytest.raises(UserError, match=msg):
        user_signal(spec)
