"""bench/clinic.py's machinery on one tiny case of the bundled base: the arms train the configs they claim (the
doctor's refined config, one random knob, TPE's proposal), accuracies and standard errors are read from the runs'
own summaries, and the injected collapse multiplies the learning rate where it says."""

from __future__ import annotations

import json
import math

from bench import clinic as C
from mechdiag import config as configlib

TINY = ["max_steps=8", "prompts_per_step=2", "group_size=2", "eval_n=8", "eval_every=4", "threads=1",
        "save_every=0", "max_time_s=null", "record.shift_at_eval=false", "record.final_geometry=false",
        "record.samples_every=4", "record.displacement_every=0"]


def _summary_acc(d):
    return json.loads((d / "summary.json").read_text())["final_accuracy"]


def test_one_tiny_case_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "BUDGET", TINY)
    case = C.Case("tiny_lr_high", "lr far too high", "base", ["learning_rate=0.05"], {"learning_rate": "down"})
    [row] = C.run_cases([case], tmp_path, 1, lambda m: None, seeds=(42,))
    sick = tmp_path / case.name / "sick-42"
    assert row["sick"]["accuracy"] == round(_summary_acc(sick), 4)
    p = _summary_acc(sick)
    assert row["sick"]["se"] == round(math.sqrt(((8 * p + 1) / 10) * (1 - (8 * p + 1) / 10) / 10), 4)
    cfg0 = configlib.load(sick / "config.yaml")
    knob = C.random_knob(case, C.case_cfg(case, 42))
    rand = configlib.load(tmp_path / case.name / "random-42" / "config.yaml")
    diff = {k for k in ("learning_rate", "beta", "temperature", "max_completion_tokens", "group_size",
                        "prompts_per_step", "epsilon") if getattr(rand, k) != getattr(cfg0, k)}
    diff |= {"lora.r"} if rand.lora.r != cfg0.lora.r else set()
    assert diff == set(knob)  # one knob (group_size moves prompts_per_step with it)
    search = configlib.load(tmp_path / case.name / "search-42" / "config.yaml")
    assert f"learning_rate={search.learning_rate:.3g}" in row["search"]["change"]
    if row["changes"] != "none":
        doctor = configlib.load(tmp_path / case.name / "doctor-42" / "config.yaml")
        assert doctor.learning_rate < cfg0.learning_rate or "learning_rate" not in row["changes"]
        assert row["doctor"]["accuracy"] == round(_summary_acc(tmp_path / case.name / "doctor-42"), 4)
    assert row["doctor"]["cured"] == C.beats(row["doctor"], row["sick"])
    assert C.table({"cases": [row]}).count("\n") >= 3


def test_cure_and_drop_arithmetic():
    sick, cured = {"accuracy": 0.40, "se": 0.02}, {"accuracy": 0.50, "se": 0.02}
    assert C.beats(cured, sick) and not C.beats(sick, cured)  # 0.10 >= 2 x 0.028
    assert not C.beats({"accuracy": 0.45, "se": 0.02}, sick)  # 0.05 < 0.057
    assert C.not_worse({"accuracy": 0.36, "se": 0.02}, sick) and not C.not_worse({"accuracy": 0.3, "se": 0.02}, sick)
    evals = [{"step": 0, "accuracy": 0.4}, {"step": 2, "accuracy": 0.6}, {"step": 4, "accuracy": 0.55},
             {"step": 6, "accuracy": 0.3}]
    assert C.two_se_drop(evals, 100) == 6  # 0.55 is within 2 SE (0.098) of 0.6; 0.3 is not


def test_collapse_multiplies_the_learning_rate_from_its_step(tmp_path):
    cfg = configlib.load(None, [*TINY, "max_steps=4", "lr_schedule=constant", "warmup_ratio=0"])
    C._train((cfg.model_dump(mode="json"), tmp_path / "run", (3, 10.0)))
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[:2] == [cfg.learning_rate] * 2 and lrs[2:] == [cfg.learning_rate * 10] * 2


def test_every_case_set_is_well_formed():
    """Each start loads as a config on its testbed, its class keys are config keys its start is judged by, and it is
    sick against a healthy start of its own set and testbed (a typo here would silently drop a case from the
    sick/named/cured counts)."""
    for cases in (C.CASES, C.HELDOUT_CASES, C.MAGNITUDE_CASES):
        names = [c.name for c in cases]
        assert len(names) == len(set(names))
        healthy = {c.name: c.testbed for c in cases if c.klass == "healthy"}
        for c in cases:
            data = C.case_cfg(c, 42).model_dump(mode="json")
            for key, way in c.keys.items():
                C._get(data, key)  # KeyError on a key the config does not have
                assert way in ("up", "down", "any")
            if c.klass != "healthy":
                assert c.keys, c.name
                ref = c.ref or next(n for n, t in healthy.items() if t == c.testbed)
                assert healthy[ref] == c.testbed, c.name
