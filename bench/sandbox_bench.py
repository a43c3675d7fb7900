"""Sandbox figures: hostile-corpus containment (cases tried / contained, worst wall time) and throughput of
run_many vs one at a time vs the floor (a bare `python -I -S -c pass` spawn).

    MECHDIAG_SHARED=/path/to/shared python bench/sandbox_bench.py [--n 40]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag.sandbox import network_isolation, run_many  # noqa: E402
from mechdiag.tasks import get_task  # noqa: E402
from tests.test_sandbox import CORPUS, TIMEOUT  # noqa: E402


def corpus() -> None:
    outside = Path(tempfile.mkdtemp(prefix="sbx-outside-"))
    (outside / "keep.txt").write_text("precious")
    names = list(CORPUS)
    jobs = [(c.replace("{outside}", str(outside)), t) for c, t in (CORPUS[n] for n in names)]
    t0 = time.monotonic()
    results = run_many(jobs, workers=2, timeout_s=TIMEOUT, memory_mb=256)
    total = time.monotonic() - t0
    intact = sorted(p.name for p in outside.iterdir()) == ["keep.txt"] and \
        (outside / "keep.txt").read_text() == "precious"
    contained = sum(not r.passed for r in results) if intact else 0
    print(f"network isolation: {network_isolation()}")
    print(f"{'case':28s} {'status':13s} wall_s")
    for n, r in zip(names, results, strict=True):
        print(f"{n:28s} {r.status:13s} {r.duration_s:6.2f}")
    worst = max(results, key=lambda r: r.duration_s)
    print(f"cases tried {len(names)}, contained {contained}, outside folder intact {intact}, "
          f"worst wall {worst.duration_s:.2f} s (timeout {TIMEOUT} s), corpus total {total:.1f} s (2 workers)")


def throughput(n: int) -> None:
    task = get_task("mbpp")
    exs = task.examples("test", n)
    jobs = [(e.meta["gold_code"], e.answer) for e in exs]
    t0 = time.monotonic()
    for _ in range(n):
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
    floor = (time.monotonic() - t0) / n
    t0 = time.monotonic()
    seq = run_many(jobs, workers=1)
    one = (time.monotonic() - t0) / n
    t0 = time.monotonic()
    par = run_many(jobs, workers=2)
    two = (time.monotonic() - t0) / n
    assert all(r.passed for r in seq) == all(r.passed for r in par)
    print(f"MBPP gold x{n}: bare spawn floor {floor * 1e3:.0f} ms/run; sandbox 1 worker {one * 1e3:.0f} ms/run "
          f"({one / floor:.2f}x floor); run_many 2 workers {two * 1e3:.0f} ms/run ({one / two:.2f}x faster than 1)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    args = ap.parse_args()
    corpus()
    throughput(args.n)
