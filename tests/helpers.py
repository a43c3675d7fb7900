"""Helpers for tests: run the CLI as a user would, and check the bad-input contract."""

from __future__ import annotations

import os
import subprocess
import sys

from mechdiag.paths import REPO_ROOT


def run_cli(*args: str, cwd: str | os.PathLike | None = None, timeout: float = 600,
            input: str | None = None, columns: int = 160) -> subprocess.CompletedProcess:
    """Run `python -m mechdiag ARGS` as a user would, returning the completed process. Tables fit COLUMNS, so it
    is pinned (not inherited from whoever runs the tests)."""
    env = dict(os.environ)
    env["COLUMNS"] = str(columns)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "mechdiag", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, input=input)


def assert_bad_input(proc: subprocess.CompletedProcess) -> None:
    """Exit code 2, exactly one line on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
