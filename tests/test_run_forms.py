"""Issue 41, reading: every run form users paste, told apart. Several launches, runs or exports in one folder or file
are split and named, the longest read by default (said so) or one chosen by PATH#NAME; several exports of one run
given together are that one run; printed TRL/Unsloth log dicts are read with nan kept. Real published runs
(../shared/data/reallogs, SOURCE.md) and the trainers' own writers (tensorboard's SummaryWriter)."""

from __future__ import annotations

import math

import pytest

from mechdiag.integrations import logs
from mechdiag.integrations.readers import read_any_run, read_runs, runs_in
from mechdiag.watch import watch


def _steps(run) -> list[int]:
    return [m["step"] for m in run.metrics]


def test_tensorboard_launches_in_one_logging_dir_are_split(data_dir, tmp_path, capsys):
    """22 launches restarting at step 1 in one logging_dir (real) and two launches written by tensorboard's own
    SummaryWriter into one log_dir: one run each, never merged; the longest is read and the choice is said."""
    real = data_dir / "reallogs" / "trl-tb-wordle-4070"
    entries = runs_in(real)
    assert len(entries) == 22 and all(min(s for s, _ in e["records"]) <= 2 for e in entries)
    run = read_any_run(real)
    assert run.summary["read"]["run_name"].startswith("events.out.tfevents.1767724543")
    assert len(run.metrics) == 636 and _steps(run) == sorted(set(_steps(run)))  # one launch, no merged steps
    assert "holds 22 runs" in capsys.readouterr().err

    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - the trainers' writer

    for n, (reward, kl) in enumerate([(0.2, 0.01), (0.6, 0.5)]):
        w = SummaryWriter(log_dir=str(tmp_path / "tb"), filename_suffix=f".launch{n}")
        for step in range(1, 11 + 5 * n):
            w.add_scalar("train/reward", reward, step)
            w.add_scalar("train/kl", kl, step)
            w.add_scalar("train/learning_rate", 1e-6, step)
        w.close()
    entries = runs_in(tmp_path / "tb")
    assert sorted(len(e["records"]) for e in entries) == [10, 15]
    run = read_any_run(tmp_path / "tb")
    assert len(run.metrics) == 15 and all(m["reward"] == pytest.approx(0.6) for m in run.metrics)
    other = next(e["name"] for e in entries if len(e["records"]) == 10)
    assert all(m["kl"] == pytest.approx(0.01) for m in read_any_run(f"{tmp_path / 'tb'}#{other}").metrics)


def test_wandb_chart_csv_runs_split_and_exports_of_one_run_joined(data_dir):
    """A W&B chart CSV with two runs' columns is two runs; three exports (one per chart) of one run given together
    are that run with every chart's keys, not pooled seeds."""
    folder = data_dir / "reallogs" / "wandb-csv-grpo-gsm8k-05b"
    one = runs_in(folder / "test_reward.csv.gz")
    assert len(one) == 2 and {e["name"] for e in one} == {
        "Qwen2.5-0.5B-Instruct-GSM8K-CRPO-sp-p1-b8-gamma2.0-lam1.0-01161659",
        "qwen2.5-0.5b-instruct-gsm8k-crpo-no-branch"}
    joined = runs_in(folder)
    assert len(joined) == 2  # three exports x two runs -> two runs
    grpo = next(e for e in joined if e["name"].endswith("no-branch"))
    keys = {k for _, d in grpo["records"] for k in d}
    assert {"actor/main_chain/entropy", "response_length/main_chain/mean", "val-core/GSM8K/reward/mean@1"} <= keys
    runs = read_runs([str(folder / f) for f in ("entropy.csv.gz", "test_reward.csv.gz")])
    assert len(runs) == 1  # two exports of the same runs: read together, one run chosen, not two seeds
    assert runs[0].summary["read"]["run_name"].endswith("no-branch")
    ev = [e["eval_reward"] for e in runs[0].eval if "eval_reward" in e]
    assert ev[0] == pytest.approx(0.447, abs=0.002) and max(ev) == pytest.approx(0.653, abs=0.002)


def test_printed_log_dicts_read_with_launches_split_and_nan_kept(data_dir):
    """TRL's printed log dicts (tqdm on the same lines) and an Unsloth console log holding two launches."""
    hot = read_any_run(data_dir / "reallogs" / "trl-hotpotqa-kl-v1")
    assert len(hot.metrics) == 93
    last = hot.metrics[-1]  # SOURCE.md: step 1860, reward 0.71851, kl 2.14952 (logging_steps 20)
    assert last["step"] == 1860 and last["reward"] == pytest.approx(0.71851, abs=1e-5)
    assert last["kl"] == pytest.approx(2.14952, abs=1e-5)

    path = data_dir / "reallogs" / "unsloth-qwen3-4b-console" / "train_grpo.log.gz"
    launches = logs.printed_launches(path)
    # launch 2's last dict is wrapped over two lines in the author's file: joined back, it is the 27th record
    assert [len(la["records"]) for la in launches] == [20, 27]
    assert launches[1]["records"][-1][1]["epoch"] == pytest.approx(1.52)
    first = [d for _, d in launches[0]["records"]]
    assert all(math.isnan(d["grad_norm"]) for d in first) and all(d["kl"] == 0.0 for d in first)
    run = read_any_run(f"{path.parent}#{path.name}:launch1")
    assert len(run.metrics) == 20 and all(m.get("grad_norm", 0) is None for m in run.metrics)  # nan, not dropped
    assert run.metrics[-1]["reward"] == pytest.approx(-3.25)


def test_watch_recommend_report_take_every_form(data_dir, cli):
    """watch, recommend and report accept each form any of them accepts (watch on a console log once said "run
    directory not found")."""
    for name in ("unsloth-qwen3-4b-console", "trl-tb-wordle-4070", "trl-hotpotqa-kl-v1"):
        state = watch(data_dir / "reallogs" / name, once=True, fmt="json", echo=lambda _: None)
        assert state.metrics
    proc = cli("recommend", str(data_dir / "reallogs" / "unsloth-qwen3-4b-console" / "train_grpo.log.gz"),
               "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "holds 2 runs" in proc.stderr and "launch2" in proc.stderr
