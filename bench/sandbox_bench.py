"""Sandbox figures: the hostile corpus per isolation mode through a code task's components_many, as root and as
an unprivileged user (cases, wrong verdicts, hosts harmed, secrets leaked, processes, IPC or folders left, worst
charged wall time; each case driven by its own host process), and the cost per MBPP gold program: each mode +
judge on one worker against a bare interpreter spawn (the floor), and run_many's programs per second at 1, 2 and
all cores against the bare-spawn floor at as many workers, in alternating rounds.

    MECHDIAG_SHARED=/path/to/shared python bench/sandbox_bench.py [--n 40] [--rounds 3] [--no-corpus]
        [--no-throughput] [--new-corpus: issue 40's cases only] [--gold strict|landlock|guard-only]
        [--before CHECKOUT]   # also: this checkout's sandbox vs CHECKOUT's (e.g. a worktree of main), alternating
"""

from __future__ import annotations

import argparse
import json
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
from tests.sandbox_conditions import USER, as_user  # noqa: E402
from tests.test_sandbox import CORPUS, CORPUS_40, GUARD_ONLY_GAPS, OS_FAMILIES, corpus_figures  # noqa: E402

USER_RUN = """
import json, os, sys
from pathlib import Path
from tests.test_sandbox import CORPUS, corpus_figures
names = json.loads(sys.argv[3])
fig = corpus_figures(Path(sys.argv[1]), names, iso=sys.argv[2], via="task")
fig["by"] = {n: {k: v for k, v in r.items() if k != "detail"} for n, r in fig["by"].items()}
print(os.getuid(), json.dumps(fig))
"""


def _row(label: str, fig: dict) -> str:
    harmed = len(fig["host_dead"]) + (0 if fig["intact"] else 1)
    return (f"| {label} | {fig['tried']} | {len(fig['wrong'])} | {harmed} | {len(fig['leaks'])} | "
            f"{len(fig['left_behind'])} | {fig['worst_wall_s']:.2f} s |")


def corpus(only_new: bool = False) -> None:
    """The whole hostile corpus through the trainer's path (a code task's components_many: extract_code, run_many,
    run_tests) in each mode, as root and as an unprivileged user (uid 65534 through setpriv, the system Python);
    then the escape families with the guard off (the OS layer alone), as root."""
    print("| mode, user | cases | wrong verdicts | hosts harmed | secrets leaked | processes, IPC or folders left "
          "| worst charged wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    names = list(CORPUS_40) if only_new else [n for n in CORPUS if n not in GUARD_ONLY_GAPS]
    for iso in ("bwrap", "landlock", "guard-only"):
        if iso != "guard-only" and sandbox._reason(iso) is not None:
            print(f"| {iso} | not available here ({sandbox._reason(iso)}) |")
            continue
        fig = corpus_figures(Path(tempfile.mkdtemp(prefix="sbx-outside-")), names, iso=iso, via="task")
        print(_row(f"{iso}, root" if os.geteuid() == 0 else f"{iso}, uid {os.getuid()}", fig), flush=True)
        cmd = as_user(USER_RUN)
        if cmd is None:
            continue
        outside = Path(tempfile.mkdtemp(prefix="sbx-user-outside-"))
        os.chown(outside, USER, USER)
        p = subprocess.run(cmd + [str(outside), iso, json.dumps(names)], capture_output=True, text=True,
                           timeout=3600, cwd="/tmp")
        if p.returncode != 0:
            print(f"| {iso}, uid {USER} | failed to run: {p.stderr.strip().splitlines()[-1:]} |")
            continue
        uid, text = p.stdout.strip().splitlines()[-1].split(" ", 1)
        print(_row(f"{iso}, uid {uid}", json.loads(text)), flush=True)
    for iso in ("bwrap", "landlock"):
        escapes = [n for n in names if n in OS_FAMILIES]
        fig = corpus_figures(Path(tempfile.mkdtemp(prefix="sbx-outside-")), escapes, guard=False, iso=iso)
        print(_row(f"{iso} alone (guard off), root", fig), flush=True)


def gold(mode: str) -> None:
    """Every gold program (MBPP 974, HumanEval 164) in one mode, 2 workers, the tasks' timeout: passed, blocked.
    guard-only is refused for an interpreter only root may reach: run this bench with a Python every user reads
    (e.g. the system one, with this interpreter's packages on PYTHONPATH)."""
    from tests.test_sandbox import GOLD_TIMEOUT, _gold_jobs  # noqa: PLC0415

    ids, jobs = _gold_jobs(None)
    t0 = time.monotonic()
    if mode == "guard-only":
        with ThreadPoolExecutor(2) as pool:
            res = list(pool.map(lambda j: sandbox._run(j[0], j[1], GOLD_TIMEOUT, 512, 16, 8, sandbox.MAX_OUTPUT,
                                                       4 * GOLD_TIMEOUT, j[2], "guard-only"), jobs))
    else:
        sandbox.use(mode)
        res = sandbox.run_many(jobs, workers=2, timeout_s=GOLD_TIMEOUT)
    passed = {k: sum(1 for i, r in zip(ids, res, strict=True) if r.passed and i.lower().startswith(k))
              for k in ("mbpp", "humaneval")}
    print(f"gold, {mode} ({', '.join(sorted({r.isolation for r in res}))}): MBPP {passed['mbpp']}/974, HumanEval "
          f"{passed['humaneval']}/164, blocked {sum(r.blocked for r in res)}, failed "
          f"{[(i, r.status) for i, r in zip(ids, res, strict=True) if not r.passed]}, "
          f"{time.monotonic() - t0:.0f} s")


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
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--new-corpus", action="store_true", help="the corpus: issue 40's cases only (CORPUS_40)")
    ap.add_argument("--gold", choices=["strict", "landlock", "guard-only"], help="also every gold program in a mode")
    ap.add_argument("--before", help="a checkout of the earlier sandbox to compare against")
    a = ap.parse_args()
    if not a.no_corpus:
        corpus(a.new_corpus)
    if not a.no_throughput:
        throughput(a.n, a.rounds)
    if a.before:
        before_after(a.before, a.n, a.rounds)
    if a.gold:
        gold(a.gold)
