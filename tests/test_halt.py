"""Auto-halt (record.halt_on) and the alert hook (record.alert_hook) on a real short run of the bundled base: a
run whose groups all score alike fires zero_std at step 5; halting on it stops the run cleanly there (final eval,
final/, summary), halt.json names the alert and the resume step, best/ keeps the best held-out adapter, and the hook
command got every alert as JSON."""

from __future__ import annotations

import json

import pytest

from mechdiag import config as configlib
from mechdiag.errors import UserError
from mechdiag.models import load_model
from mechdiag.recorder import Alerts, Halt, Recorder
from mechdiag.run import RunDir
from mechdiag.train.trainer import train

# a near-greedy sampler on 2-member groups: nearly every group scores alike, zero_std fires once 5 steps are in
ALIKE = ["max_steps=8", "eval_every=2", "eval_n=8", "prompts_per_step=2", "group_size=2", "temperature=0.05",
         "threads=1", "save_every=0", "max_time_s=null", "record.displacement_every=0", "record.samples_every=0",
         "record.shift_at_eval=false", "record.final_geometry=false", "learning_rate=0.01"]


def test_halt_on_an_alert_stops_cleanly_keeps_the_best_and_calls_the_hook(tmp_path):
    hook_log = tmp_path / "hook.jsonl"
    cfg = configlib.load(None, [*ALIKE, "record.halt_on=[zero_std]",
                                f"record.alert_hook=cat >> {hook_log}; echo \" $MECHDIAG_ALERT\" >> {hook_log}"])
    run = train(cfg, tmp_path / "run")
    halt = json.loads((run.path / "halt.json").read_text())
    summary = run.summary()
    assert halt["alert"] == "zero_std" and halt["halted_at"] == summary["steps"] < summary["planned_steps"]
    assert (run.path / "final").is_dir() and "final_accuracy" in summary  # a clean stop: final eval and model
    evals = [json.loads(x) for x in (run.path / "eval.jsonl").read_text().splitlines()]
    best = max((e for e in evals if e["step"] <= halt["halted_at"]), key=lambda e: (e["accuracy"], -e["step"]))
    assert halt["resume_step"] == best["step"] and halt["best_accuracy"] == best["accuracy"]
    if best["step"]:
        assert json.loads((run.path / "best" / "best.json").read_text())["step"] == best["step"]
        assert (run.path / "best" / "adapter_config.json").exists()
    first = hook_log.read_text().split("\n")[0]  # the JSON on stdin, then the alert's name from the environment
    body, name = first.rsplit(" ", 1)
    assert json.loads(body)["alert"] == "zero_std" and json.loads(body)["step"] == halt["halted_at"]
    assert name == "zero_std"


def test_best_keeps_the_model_of_the_best_held_out_accuracy(tmp_path):
    cfg = configlib.load(None, ["record.halt_on=[critical]"])
    rec = Recorder(RunDir(tmp_path / "run", create=True), [Alerts(cfg), Halt(cfg)])
    model = load_model("bundled")
    for step, acc in ((0, 0.4), (2, 0.6), (4, 0.5)):
        rec.eval(step, model, None, {"accuracy": acc})
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text()) == {"step": 2, "accuracy": 0.6}
    assert (tmp_path / "run" / "best" / "model.safetensors").exists() and rec.stop is None


def test_unknown_halt_alert_is_bad_input():
    cfg = configlib.load(None, ["record.halt_on=[kl_spik]"])
    with pytest.raises(UserError, match="unknown alert 'kl_spik'"):
        Halt(cfg)
    assert Halt(configlib.load(None, ["record.halt_on=[critical]"])).halt_on == {
        "no_update", "update_spike", "kl_spike", "kl_blowup", "entropy_collapse"}
