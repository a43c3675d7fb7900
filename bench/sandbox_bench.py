"""Sandbox figures: hostile-corpus containment per isolation mode (cases tried / contained / wrong verdicts, worst
charged wall time; each case driven by its own host process) and the cost per MBPP gold program: each mode +
judge on one worker against a bare interpreter spawn (the floor), and run_many's programs per second at 1, 2 and
all cores against the bare-spawn floor at as many workers, in alternating rounds.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag import sandbox  # noqa: E402
from mechdiag.tasks import get_task  # noqa: E402
from tests.test_sandbox import CORPUS, GUARD_ONLY_GAPS, OS_FAMILIES, WALL, corpus_figures  # noqa: E402


def corpus() -> None:
    runs = [(f"{iso} + guard", list(CORPUS), True, iso) for iso in ("bwrap", "landlock")]
    runs += [(f"{iso} alone (guard off)", OS_FAMILIES, False, iso) for iso in ("bwrap", "landlock")]
    runs.append(("guard-only (root)", [n for n in CORPUS if n not in GUARD_ONLY_GAPS], True, "guard-only"))
    for label, names, guard, iso in runs:
        if iso != "guard-only" and sandbox._reason(iso) is not None:
            print(f"{label}: not available here ({sandbox._reason(iso)})")
            continue
        fig = corpus_figures(Path(tempfile.mkdtemp(prefix="sbx-outside-")), names, guard=guard, iso=iso)
        print(f"{label}: cases tried {fig['tried']}, contained {fig['contained']}, wrong verdicts "
              f"{len(fig['wrong'])}, host killed {len(fig['host_dead'])}, secret leaks {len(fig['leaks'])}, "
              f"left behind {len(fig['left_behind'])}, outside intact {fig['intact']}, worst charged wall "
              f"{fig['worst_wall_s']:.2f} s (wall deadline {WALL} s)")


def _per_run(fn, jobs) -> float:
    t0 = time.monotonic()
    fn(jobs)
    return (time.monotonic() - t0) / len(jobs) * 1e3


def _floor(js, workers: int) -> None:
    def spawn(_):
        subprocess.run([sandbox._python(), "-I", "-S", "-c", "pass"], check=True)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(spawn, js))


def throughput(n: int, rounds: int) -> None:
    """ms per MBPP gold program, one worker, per isolation mode against the bare spawn; then programs per second
    of run_many at 1, 2 and all cores against the bare-spawn floor at as many workers."""
    exs = get_task("mbpp").examples("test", n)
    jobs = [(e.meta["gold_code"], e.answer, tuple(e.meta["entry_points"])) for e in exs]
    args = (5.0, 512, 16, 8, sandbox.MAX_OUTPUT, 20.0)
    modes = [m for m in ("bwrap", "landlock") if sandbox._reason(m) is None] + ["guard-only"]
    cores = sandbox.cores()
    widths = sorted({1, min(2, len(cores)), len(cores)})

    def mode(iso):
        def go(js):
            assert all(sandbox._run(c, t, *args, e, iso, cpu=cores[0]).passed for c, t, e in js)
        return go

    def many(w):
        def go(js):
            assert all(r.passed for r in sandbox.run_many(js, workers=w))
        return go

    def floor(w):
        return lambda js: _floor(js, w)

    cols = {"floor": floor(1), **{m: mode(m) for m in modes}}
    cols.update({f"floor x{w}": floor(w) for w in widths})
    cols.update({f"run_many x{w}": many(w) for w in widths})
    got = {k: [] for k in cols}
    for _ in range(rounds):  # alternating rounds: load changes hit every column alike
        for k, fn in cols.items():
            got[k].append(_per_run(fn, jobs))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"MBPP gold x{n}, median of {rounds} alternating rounds, {len(cores)} cores (os.sched_getaffinity):")
    print(f"  bare interpreter spawn (floor), 1 worker  {med['floor']:6.1f} ms per program")
    for m in modes:
        print(f"  {m:10s} + judge, 1 worker            {med[m]:6.1f} ms per program  ({med[m] / med['floor']:.2f}x "
              f"floor)")
    for w in widths:
        fl, rm = 1e3 / med[f"floor x{w}"], 1e3 / med[f"run_many x{w}"]
        print(f"  run_many x{w} ({sandbox.isolation()}): {rm:6.1f} programs/s; bare-spawn floor x{w}: {fl:6.1f}/s "
              f"({rm / fl:.3f} of the floor; {rm / (1e3 / med['run_many x1']):.2f}x one worker)")


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
