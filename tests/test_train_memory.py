"""mechdiag.train.memory.release_freed_blocks: freed tensor memory goes back to the OS (glibc), where by default
the heap keeps it; each case in a fresh process, its RSS read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import sys, torch
from mechdiag.train import memory
if sys.argv[1] == "release":
    assert memory.release_freed_blocks()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
x = torch.empty(24 * 2**20 // 4)
del x  # a freed 24 MiB mmapped block: glibc's default threshold rises to it, smaller blocks go to the heap
blocks = [torch.ones(2**20 // 4) for _ in range(300)]  # 300 MiB in 1 MiB tensors
before = rss()
blocks = blocks[::10]  # free 9 in 10: holes between kept blocks, which the heap cannot trim
print(before, rss())
"""


def _rss(mode: str) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    before, after = map(int, p.stdout.split())
    return before, after


def test_freed_blocks_leave_the_process_only_with_the_policy():
    kept_before, kept_after = _rss("default")
    rel_before, rel_after = _rss("release")
    assert kept_before - kept_after < 50 * 2**20  # glibc's default: the 270 MiB freed stay resident
    assert rel_before - rel_after > 200 * 2**20  # with it: they are unmapped
