"""The outer loop's mechanics with a simulated trainer whose records react to the config (tests/synth.py)."""

import json

import pytest

from mechdiag import atomic
from mechdiag import config as configlib
from mechdiag.errors import UserError
from mechdiag.tune import load_train_fn, tune
from tests.helpers import assert_bad_input
from tests.synth import sim_train

POOR = ["temperature=0.4", "beta=0"]  # LoRA already on every layer and module by default


def test_tune_refines_until_no_rule_fires(tmp_path):
    calls = []

    def train(cfg, out_dir):
        calls.append(cfg)
        return sim_train(cfg, out_dir)

    records = tune(configlib.load(overrides=POOR), rounds=6, out_dir=tmp_path, train_fn=train)
    assert [r["round"] for r in records] == [0, 1]  # stopped early, not after 6: every fix in one round
    assert records[-1]["stop"] == "no rule changes the config" and records[-1]["next_changes"] == []
    assert len(calls) == 2
    # round 1 trained with round 0's recommendation, applied
    r1 = {c["key"]: c["new"] for c in records[1]["changes"]}
    # temperature 0.4 is far under the working range: to its floor (0.7) in one round, not by 0.2 steps
    assert r1["temperature"] == 0.7 and r1["beta"] == 0.005 and r1["lora.layers"] == "first2+last2"
    assert calls[1].temperature == 0.7 and calls[1].beta == 0.005 and calls[1].lora.layers == "first2+last2"
    assert records[0]["changes"] == [] and "kl_drift" in records[0]["rules"]
    assert {c["rule"] for c in records[1]["changes"]} >= {"low_diversity", "kl_drift", "reduced_layers"}
    # every round keeps its run dir, whose config is the one it trained with
    for k, cfg in enumerate(calls):
        assert configlib.load(tmp_path / f"round-{k}" / "config.yaml") == cfg
    # rounds.jsonl is the returned records, with held-out metrics that the fixes improved
    on_disk = atomic.read_jsonl(tmp_path / "rounds.jsonl")
    assert on_disk == json.loads(atomic.dumps(records))
    acc = [r["eval.accuracy"] for r in records]
    assert acc[0] < acc[1]
    assert configlib.load(tmp_path / "best.yaml") == calls[1]
    assert configlib.load(tmp_path / "final.yaml") == calls[1]
    assert "temperature: 0.4 -> 0.7" in (tmp_path / "round-1.yaml").read_text()


def test_tune_stops_at_round_budget(tmp_path):
    records = tune(configlib.load(overrides=POOR), rounds=1, out_dir=tmp_path, train_fn=sim_train)
    assert len(records) == 1 and records[-1]["stop"] == "rounds done"
    assert records[-1]["next_changes"]  # more was left to fix
    assert not (tmp_path / "round-1").exists()
    final = configlib.load(tmp_path / "final.yaml")
    assert final.temperature == 0.7  # the recommendation after the last round is still saved


def test_healthy_config_trains_once(tmp_path):
    records = tune(configlib.load(overrides=["temperature=1.0", "lora.layers=first2+last2", "beta=0.005"]), rounds=3,
                   out_dir=tmp_path, train_fn=sim_train)
    assert len(records) == 1 and records[0]["rules"] == [] and records[0]["stop"] == "no rule changes the config"


def test_tune_refuses_reuse_and_bad_rounds(tmp_path):
    tune(configlib.load(), rounds=1, out_dir=tmp_path, train_fn=sim_train)
    with pytest.raises(UserError, match="already holds a tune"):
        tune(configlib.load(), rounds=1, out_dir=tmp_path, train_fn=sim_train)
    with pytest.raises(UserError, match="at least 1"):
        tune(configlib.load(), rounds=0, out_dir=tmp_path / "x", train_fn=sim_train)
    with pytest.raises(UserError, match="cannot import trainer"):
        load_train_fn("mechdiag.nothing_here:train")


def test_tune_cli(tmp_path, cli):
    cfg = tmp_path / "poor.yaml"
    configlib.save(configlib.load(overrides=POOR), cfg)
    out = tmp_path / "tune"
    proc = cli("tune", str(cfg), "--rounds", "4", "--out", str(out), "--trainer", "tests.synth:sim_train",
               "--seed", "3407", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    recs = json.loads(proc.stdout)
    assert [r["round"] for r in recs] == [0, 1]
    assert "temperature: 0.4 -> 0.7" in recs[1]["changes"]
    assert all(not isinstance(v, (list, dict)) for v in recs[1].values())
    assert configlib.load(out / "round-0" / "config.yaml").seed == 3407
    assert "round 1: training" in proc.stderr
    assert_bad_input(cli("tune", str(cfg), "--out", str(out), "--trainer", "tests.synth:sim_train"))
    assert_bad_input(cli("tune", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "t2")))


def test_a_failing_round_keeps_the_finished_ones(tmp_path):
    def train(cfg, out_dir):
        if cfg.temperature > 0.5:
            raise UserError("out of memory in round 1")
        return sim_train(cfg, out_dir).path  # a trainer may return the path instead of a RunDir

    with pytest.raises(UserError, match="round 1"):
        tune(configlib.load(overrides=POOR), rounds=3, out_dir=tmp_path, train_fn=train)
    recs = atomic.read_jsonl(tmp_path / "rounds.jsonl")
    assert [r["round"] for r in recs] == [0] and recs[0]["next_changes"]
    assert configlib.load(tmp_path / "round-1.yaml").temperature == 0.7
