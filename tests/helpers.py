"""Helpers for tests: run the CLI as a user would, and check the bad-input contract."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import traceback

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


def invoke_cli(*args: str, cwd: str | os.PathLike | None = None, timeout: float = 600,
               input: str | None = None, columns: int = 160) -> subprocess.CompletedProcess:
    """run_cli's result from this process (click's runner), where a subprocess adds only its imports: an uncaught
    exception ends with exit 1 and its traceback on stderr, as `python -m mechdiag` would."""
    from click.testing import CliRunner

    from mechdiag.cli import main

    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        r = CliRunner(env={"COLUMNS": str(columns)}).invoke(main, [str(a) for a in args], input=input,
                                                             prog_name="mechdiag")
    stderr = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(r.exception))
    return subprocess.CompletedProcess(["mechdiag", *args], r.exit_code, r.stdout, stderr)


def assert_bad_input(proc: subprocess.CompletedProcess) -> None:
    """Exit code 2, exactly one line on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
