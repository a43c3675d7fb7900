"""Crash safety of `mechdiag train`: one run is kill -9ed at six different points and resumed after each; it must
end with every record of an uninterrupted run of the same seed exactly once, and the same final adapter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from mechdiag import atomic
from mechdiag.paths import REPO_ROOT
from mechdiag.run import STREAMS, RunDir
from tests.conftest import tiny_train_flags
from tests.helpers import run_cli

TIMING = ("step_time", "rollout_time", "tokens_per_s")
HOOK = "hooks=[tests.crash_hooks:kill]"


def _key(rec: dict) -> str:
    """A record without its wall-clock fields, as comparable text."""
    return json.dumps({k: v for k, v in rec.items() if k not in TIMING}, sort_keys=True)


def _train(run: Path, resume: bool, kill: str | None, monkeypatch) -> subprocess.CompletedProcess:
    if kill:
        monkeypatch.setenv("MECHDIAG_TEST_KILL", kill)
    hooks = HOOK if kill else "hooks=[]"
    if resume:
        return run_cli("train", "--resume", str(run), "--set", hooks)
    return run_cli("train", *tiny_train_flags(hooks), "--out", str(run))


def _kill_when(run: Path, step: int) -> int:
    """Resume under an outside kill -9 sent as soon as metrics.jsonl holds `step` (wherever the trainer is)."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "mechdiag", "train", "--resume", str(run), "--set", "hooks=[]"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if any(r["step"] == step for r in atomic.read_jsonl(run / "metrics.jsonl")):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    return proc.wait()


def _steps(run: Path, stream: str) -> list[int]:
    return [r["step"] for r in RunDir(run).read(stream)]


def test_kill9_at_six_points_then_resume_loses_and_repeats_nothing(tiny_run, tmp_path, monkeypatch):
    cut = tmp_path / "cut"
    # 1. during the base-model eval, before any step: nothing durable yet, resume starts over
    assert _train(cut, False, "eval:0", monkeypatch).returncode == -9
    assert _steps(cut, "eval") == [0] and _steps(cut, "metrics") == []
    # 2. inside checkpoint 2, weights written but not the optimizer: checkpoint 2 must not count
    assert _train(cut, True, "weights:2", monkeypatch).returncode == -9
    assert RunDir(cut).checkpoint_steps() == [] and (cut / "checkpoints" / ".step-2.tmp").is_dir()
    # 3. after step 3's records, before its checkpoint (and mid-record for the partial line below)
    assert _train(cut, True, "step:3", monkeypatch).returncode == -9
    assert RunDir(cut).checkpoint_steps() == [2] and _steps(cut, "metrics") == [1, 2, 3]
    for stream in ("metrics", "samples", "displacement"):  # a crash in the middle of a write leaves half a line
        with open(cut / f"{stream}.jsonl", "a") as f:
            f.write('{"step": 3, "reward": 0.')
    assert _steps(cut, "metrics") == [1, 2, 3]  # the partial line is dropped on read
    # 4. right after checkpoint 4 is complete
    assert _train(cut, True, "saved:4", monkeypatch).returncode == -9
    assert RunDir(cut).checkpoint_steps() == [2, 4]
    # 5. from outside, as soon as step 5 is on disk (eval/checkpoint state unknown to the test)
    assert _kill_when(cut, 5) == -9
    # 6. while the final weights are written: no final/ and no summary.json yet
    assert _train(cut, True, "final", monkeypatch).returncode == -9
    assert not (cut / "final").exists() and not (cut / "summary.json").exists()
    # the last resume completes
    done = _train(cut, True, None, monkeypatch)
    assert done.returncode == 0, done.stderr

    lost = dup = 0
    for stream in STREAMS:
        ref = Counter(_key(r) for r in RunDir(tiny_run).read(stream))
        got = Counter(_key(r) for r in RunDir(cut).read(stream))
        lost += sum((ref - got).values())
        dup += sum((got - ref).values())
        assert got == ref, stream
    assert lost == 0 and dup == 0
    assert _steps(cut, "metrics") == [1, 2, 3, 4, 5, 6]
    assert _steps(cut, "eval") == [0, 3, 6]
    assert len(RunDir(tiny_run).read("displacement")) > 0 and len(RunDir(tiny_run).read("shift")) > 0
    a = load_file(tiny_run / "final" / "adapter_model.safetensors")
    b = load_file(cut / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    s_ref, s_cut = RunDir(tiny_run).summary(), RunDir(cut).summary()
    assert s_cut["steps"] == s_ref["steps"] == 6 and s_cut["final_accuracy"] == s_ref["final_accuracy"]


def test_partial_last_line_is_dropped_and_the_next_append_starts_clean(tmp_path):
    path = tmp_path / "m.jsonl"
    atomic.append_jsonl(path, [{"step": 1}, {"step": 2}])
    with open(path, "a") as f:
        f.write('{"step": 3, "x": ')
    assert atomic.read_jsonl(path) == [{"step": 1}, {"step": 2}]
    atomic.append_jsonl(path, [{"step": 3}])
    assert atomic.read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    path.write_text('{"step": 1')  # a file that is only a partial line
    atomic.append_jsonl(path, [{"step": 1}])
    assert path.read_text() == '{"step": 1}\n'
