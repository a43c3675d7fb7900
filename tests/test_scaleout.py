"""Scale-out: `accelerate launch --cpu --num_processes 2 -m mechdiag train --backend trl`, two real processes on
the bundled model for 2 steps. Only rank 0 writes; reward_cv is computed over both ranks' completions; the final
weights' displacement is recorded; summary.json is whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mechdiag.outcomes import group_stats

G, PROMPTS, STEPS = 4, 2, 2  # 8 completions per step: one group of 4 on each rank


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaleout") / "run"
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "mechdiag", "train", "--backend", "trl",
           "--out", str(out), "--set", f"max_steps={STEPS}", "--set", f"prompts_per_step={PROMPTS}", "--set",
           f"group_size={G}", "--set", "eval_n=4", "--set", "max_completion_tokens=16", "--set", "save_every=0",
           "--set", "threads=1", "--set", "record.shift_n=4", "--set", "temperature=1.5",
           "--set", "record.samples_every=1",
           "--trl", "log_completions=true"]
    proc = subprocess.run(cmd, cwd=tmp_path_factory.mktemp("cwd"), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_processes_ran(launched):
    _, proc = launched
    assert "world_size" not in proc.stderr or "Traceback" not in proc.stderr
    # both ranks generated: TRL's logged completions cover both ranks' halves of every step
    out, _ = launched
    train = [s for s in _rows(out / "samples.jsonl") if s["split"] == "train"]
    for step in range(1, STEPS + 1):
        assert len([s for s in train if s["step"] == step]) == G * PROMPTS


def test_only_rank0_writes_the_run_directory(launched):
    out, _ = launched
    for stream in ("metrics", "eval", "displacement"):
        rows = _rows(out / f"{stream}.jsonl")
        steps = [r["step"] for r in rows if stream == "metrics"] or sorted({r["step"] for r in rows})
        assert len(steps) == len(set(steps)), f"{stream}.jsonl has records written twice: {steps}"
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert len(_rows(out / "eval.jsonl")) == 2  # base and final, once each
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


def test_reward_cv_is_gathered_across_ranks(launched):
    out, _ = launched
    train = [s for s in _rows(out / "samples.jsonl") if s["split"] == "train"]
    for rec in _rows(out / "metrics.jsonl"):
        rows = [s for s in train if s["step"] == rec["step"]]
        groups = sorted({s["group"] for s in rows})
        assert len(groups) == PROMPTS  # both ranks' groups
        stats = group_stats([s["reward"] for s in rows], [s["group"] for s in rows])
        assert rec["frac_zero_std"] == pytest.approx(stats["frac_zero_std"])
        if stats["reward_cv"] == stats["reward_cv"]:  # not NaN
            assert rec["reward_cv"] == pytest.approx(stats["reward_cv"], rel=1e-4, abs=1e-6)


def test_displacement_recorded_at_the_end(launched):
    out, _ = launched
    rows = _rows(out / "displacement.jsonl")
    assert {r["step"] for r in rows} == {STEPS}  # period 10 > 2 steps: only the end point
    assert all(r["rel_fro"] > 0 for r in rows)


def test_summary_is_whole(launched):
    out, _ = launched
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["source"] == "trl"
    for key in ("base_accuracy", "final_accuracy", "accuracy_gain", "wall_time_s", "recorder_s"):
        assert isinstance(summary[key], float), key
    assert (out / "final" / "adapter_model.safetensors").is_file()
