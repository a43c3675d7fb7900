"""The outer loop of the study's bilevel view: train at a fixed design lambda, diagnose the run, refine lambda,
train again. Each round keeps its run directory; OUT/rounds.jsonl gets one record per round with the config
changes that led to it and its held-out metrics. The loop stops early when no rule changes the config.

    OUT/round-0/  OUT/round-1/ ...   run directories (round-K/config.yaml is the config it trained with)
    OUT/rounds.jsonl                 one record per round
    OUT/best.yaml, OUT/final.yaml    the best round's config (held-out accuracy) and the last refined one
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from mechdiag import atomic
from mechdiag import config as configlib
from mechdiag.config import Config, load_object
from mechdiag.errors import UserError
from mechdiag.recommend import Change, recommend
from mechdiag.run import RunDir, final_eval, load_run

DEFAULT_TRAINER = "mechdiag.train.trainer:train"
TrainFn = Callable[[Config, Path], "RunDir | os.PathLike | str"]


def load_train_fn(target: str = DEFAULT_TRAINER) -> TrainFn:
    """Import "package.module:function"; a trainer is any train(cfg, out_dir) -> RunDir."""
    fn = load_object(target, "trainer", "function")
    if not callable(fn):
        raise UserError(f"trainer {target} is not a function (a {type(fn).__name__})")
    return fn


def describe(changes: list[dict]) -> str:
    """rounds.jsonl change records as one line: "temperature: 0.4 -> 0.6; beta: 0 -> 0.005"."""
    return "; ".join(str(Change(c["key"], c["old"], c["new"])) for c in changes)


def _held_out(run) -> dict:
    return {f"eval.{k}": v for k, v in final_eval(run).items()}


def tune(cfg: Config, rounds: int, out_dir, train_fn: TrainFn | None = None, log=None) -> list[dict]:
    """Train up to `rounds` times in total (round 0 is `cfg` itself), refining the config between rounds.
    Returns the rounds.jsonl records."""
    if rounds < 1:
        raise UserError(f"--rounds must be at least 1, got {rounds}")
    out = Path(out_dir)
    if (out / "rounds.jsonl").exists():
        raise UserError(f"{out} already holds a tune (rounds.jsonl); choose another --out")
    fresh = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _rounds(cfg, rounds, out, train_fn or load_train_fn(), log or (lambda msg: None))
    except UserError:
        if fresh and not any(out.iterdir()):  # bad input found in round 0: leave no empty --out behind
            out.rmdir()
        raise


def _rounds(cfg: Config, rounds: int, out: Path, train_fn: TrainFn, log) -> list[dict]:
    records, changes, best = [], [], None
    for k in range(rounds):
        run_dir = out / f"round-{k}"
        if k:  # round 0 is named in its result line: a bad config then fails with one line on stderr
            log(f"round {k}: training {run_dir}" + (f" with {'; '.join(map(str, changes))}" if changes else ""))
        result = train_fn(cfg, run_dir)
        run_dir = Path(getattr(result, "path", result) or run_dir)
        run = load_run(run_dir)
        rec_next = recommend([run])
        held = _held_out(run)
        record = {"round": k, "step": k, "run_dir": str(run_dir),
                  "changes": [c.record() for c in changes],
                  "rules": [f.rule for f in rec_next.findings],
                  "next_changes": [c.record() for c in rec_next.changes], **held}
        acc = held.get("eval.accuracy")
        if acc is not None and (best is None or acc > best[0]):
            best = (acc, k, cfg)
        stop = not rec_next.changes
        if stop:
            record["stop"] = "no rule changes the config"
        elif k == rounds - 1:
            record["stop"] = "rounds done"
        atomic.append_jsonl(out / "rounds.jsonl", [record], fsync=True)
        records.append(record)
        log(f"round {k}: held-out accuracy {'-' if acc is None else f'{acc:.4g}'}; next: "
            + ("; ".join(str(c) for c in rec_next.changes) or "no change"))
        if k < rounds - 1 and not stop:
            configlib.save(rec_next.cfg, out / f"round-{k + 1}.yaml", rec_next.header)
        configlib.save(rec_next.cfg, out / "final.yaml", rec_next.header)
        if stop:
            break
        cfg, changes = rec_next.cfg, rec_next.changes
    if best is not None:
        configlib.save(best[2], out / "best.yaml", f"mechdiag tune: round {best[1]}, held-out accuracy {best[0]:.4g}")
    return records
