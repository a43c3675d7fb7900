"""Sandbox figures: hostile-corpus containment (cases tried / contained / wrong verdicts, worst wall time; each case
driven by its own host process) and the cost per MBPP gold program: bubblewrap + judge (what runs) against the
guard-only fallback and a bare interpreter spawn (the floor), in alternating rounds; run_many 2 workers vs 1.

    MECHDIAG_SHARED=/path/to/shared python bench/sandbox_bench.py [--n 40] [--rounds 3] [--no-corpus]
        [--before CHECKOUT]   # also: this checkout's sandbox vs CHECKOUT's (e.g. a worktree of main), alternating
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag import sandbox  # noqa: E402
from mechdiag.tasks import get_task  # noqa: E402
from tests.test_sandbox import CORPUS, OS_FAMILIES, WALL, corpus_figures  # noqa: E402


def corpus() -> None:
    for label, names, guard in (("bwrap + guard", list(CORPUS), True), ("bwrap alone (guard off)", OS_FAMILIES, False)):
        fig = corpus_figures(Path(tempfile.mkdtemp(prefix="sbx-outside-")), names, guard=guard)
        print(f"{label}: cases tried {fig['tried']}, contained {fig['contained']}, wrong verdicts "
              f"{len(fig['wrong'])}, host killed {len(fig['host_dead'])}, secret leaks {len(fig['leaks'])}, "
              f"outside intact {fig['intact']}, worst wall {fig['worst_wall_s']:.2f} s (wall deadline {WALL} s)")


def _per_run(fn, jobs) -> float:
    t0 = time.monotonic()
    fn(jobs)
    return (time.monotonic() - t0) / len(jobs) * 1e3


def throughput(n: int, rounds: int) -> None:
    exs = get_task("mbpp").examples("test", n)
    jobs = [(e.meta["gold_code"], e.answer, tuple(e.meta["entry_points"])) for e in exs]
    iso = sandbox.isolation()
    args = (5.0, 512, 16, 8, sandbox.MAX_OUTPUT, 20.0)

    def floor(js):
        for _ in js:
            subprocess.run([sandbox._python(), "-I", "-S", "-c", "pass"], check=True)

    def guard(js):
        assert all(sandbox._run(c, t, *args, e, "guard-only").passed for c, t, e in js)

    def bwrap(js):
        assert all(sandbox._run(c, t, *args, e, iso).passed for c, t, e in js)

    def many2(js):
        assert all(r.passed for r in sandbox.run_many(js, workers=2))

    cols = {"floor": floor, "guard": guard, iso: bwrap, "run_many x2": many2}
    got = {k: [] for k in cols}
    for _ in range(rounds):  # alternating rounds: load changes hit every column alike
        for k, fn in cols.items():
            got[k].append(_per_run(fn, jobs))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"MBPP gold x{n}, median of {rounds} alternating rounds (ms per program):")
    print(f"  bare interpreter spawn (floor)  {med['floor']:6.0f}")
    print(f"  guard only (fallback), 1 worker {med['guard']:6.0f}  ({med['guard'] / med['floor']:.2f}x floor)")
    print(f"  {iso} + judge, 1 worker        {med[iso]:6.0f}  ({med[iso] / med['floor']:.2f}x floor, "
          f"{med[iso] / med['guard']:.2f}x guard only)")
    print(f"  {iso} + judge, run_many 2 workers {med['run_many x2']:6.0f}  "
          f"({med[iso] / med['run_many x2']:.2f}x faster than 1 worker)")


PEER = """
import sys, time
from mechdiag.tasks import get_task
from mechdiag.sandbox import run_many
jobs = [(e.meta["gold_code"], e.answer) for e in get_task("mbpp").examples("test", int(sys.argv[1]))]
for workers in (1, 2):
    t0 = time.monotonic()
    assert all(r.passed for r in run_many(jobs, workers=workers))
    print((time.monotonic() - t0) / len(jobs) * 1e3)
"""


def before_after(before: str, n: int, rounds: int) -> None:
    """ms per MBPP gold program: CHECKOUT's sandbox vs this one, each in a fresh process, alternating rounds."""
    sides = {"before": before, "after": str(Path(__file__).resolve().parent.parent)}
    got = {k: [] for k in sides}
    for _ in range(rounds):
        for k, path in sides.items():
            out = subprocess.run([sys.executable, "-c", PEER, str(n)], capture_output=True, text=True, check=True,
                                 env=dict(os.environ, PYTHONPATH=path)).stdout.split()
            got[k].append([float(x) for x in out])
    med = {k: [statistics.median(r[i] for r in v) for i in range(2)] for k, v in got.items()}
    print(f"MBPP gold x{n}, median of {rounds} alternating rounds (ms per program), before = {before}:")
    for w in (0, 1):
        print(f"  {w + 1} worker(s): before {med['before'][w]:6.0f}, after {med['after'][w]:6.0f} "
              f"({med['after'][w] / med['before'][w]:.2f}x)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-corpus", action="store_true")
    ap.add_argument("--before", help="a checkout of the earlier sandbox to compare against")
    a = ap.parse_args()
    if not a.no_corpus:
        corpus()
    throughput(a.n, a.rounds)
    if a.before:
        before_after(a.before, a.n, a.rounds)
