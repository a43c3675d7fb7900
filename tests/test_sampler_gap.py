"""The sampler gap on real native runs: a float32 sampler against the float32 update is the floor (rounding),
a bfloat16 sampler (as vLLM beside a float32 trainer) is off-policy; the alert fires on the second run only."""

from __future__ import annotations

import pytest

from mechdiag import alerts
from mechdiag import config as C
from mechdiag.metrics import SAMPLER_GAP_HIGH
from mechdiag.train.trainer import train
from tests.test_train import small


@pytest.fixture(scope="module")
def runs(stories260k, tmp_path_factory):
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = C.load(None, small(stories260k, "max_steps=6", "save_every=0", "eval_n=2", "sampler=merged",
                                 f"sampler_dtype={dtype}", "record.samples_every=0"))
        out[dtype] = train(cfg, tmp_path_factory.mktemp(dtype) / "run").read("metrics")
    return out


def test_float32_sampler_is_the_floor(runs):
    for m in runs["float32"]:
        assert 0 < m["sampler_logp_diff"] < SAMPLER_GAP_HIGH / 100, m  # float32 rounding, not zero
        assert m["sampler_ratio_min"] <= m["sampler_ratio_mean"] <= m["sampler_ratio_max"]
        assert abs(m["sampler_ratio_mean"] - 1) < 1e-5 and abs(m["sampler_kl"]) < 1e-5


def test_alert_fires_on_the_lower_precision_sampler_only(runs):
    assert all(m["sampler_logp_diff"] > SAMPLER_GAP_HIGH for m in runs["bfloat16"])
    quiet = [a.alert for a in alerts.check(runs["float32"])]
    fired = [a for a in alerts.check(runs["bfloat16"]) if a.alert == "sampler_mismatch"]
    assert "sampler_mismatch" not in quiet
    assert len(fired) == 1 and fired[0].step == alerts.WINDOW and "sampler_logp_diff" in fired[0].evidence
