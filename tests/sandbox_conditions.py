"""Hosts the sandbox must hold on, made real for a test: a kernel without landlock (its syscalls fail with
ENOSYS under a seccomp filter, as on a kernel built without it), no bubblewrap on PATH, an unprivileged user."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from mechdiag.tasks.code import MBPP

ROOT = Path(__file__).resolve().parent.parent

# `python NO_LANDLOCK_PY ARGS...` runs `python ARGS...` with the landlock syscalls answering ENOSYS
NO_LANDLOCK = """
import errno, os, sys
import pyseccomp
f = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
for name in ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"):
    f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), name)
f.load()
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def without_landlock(args: list[str], python: str = sys.executable) -> list[str]:
    """A python command line (args after the interpreter) run where the kernel has no landlock."""
    return [python, "-c", NO_LANDLOCK, *args]


def env_without_bwrap(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a host with no bwrap on PATH (an empty folder is the whole PATH)."""
    empty = tmp / "no-bwrap-path"
    empty.mkdir(exist_ok=True)
    return dict(os.environ, PATH=str(empty), PYTHONPATH=str(ROOT), **extra)


USER = 65534
# an interpreter every user can start (the project's may sit in a folder only root enters, /root/.pyenv)
SYSTEM_PYTHON = "/usr/bin/python3"


def as_user(code: str, env: dict[str, str] | None = None) -> list[str] | None:
    """A command that runs the Python program `code` as the unprivileged uid 65534 (no groups, no capabilities),
    with the system interpreter and this checkout and its packages on the path; None where this process cannot
    switch users (not root, no setpriv, no system Python of this version)."""
    import pyseccomp

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None or not os.access(SYSTEM_PYTHON, os.X_OK):
        return None
    packages = os.path.dirname(pyseccomp.__file__)
    return [setpriv, f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "env", "-i", f"PYTHONPATH={ROOT}:{packages}", "PATH=/usr/bin:/bin",
            "MECHDIAG_SHARED=" + os.environ.get("MECHDIAG_SHARED", str(ROOT.parent / "shared")),
            *(f"{k}={v}" for k, v in (env or {}).items()), SYSTEM_PYTHON, "-c", code]


def guard_only_python() -> tuple[str, list[str]]:
    """(interpreter, extra path) to run guard-only under: this one where every user can read it, else the system
    Python with this interpreter's packages on the path (guard-only refuses an interpreter in a folder only root
    may enter, as /root/.pyenv here: the candidate keeps no capability to reach it)."""
    import pyseccomp

    from mechdiag import sandbox

    if sandbox._guard_only_refusal() is None:
        return sys.executable, []
    assert os.access(SYSTEM_PYTHON, os.X_OK)
    return SYSTEM_PYTHON, [os.path.dirname(pyseccomp.__file__)]


class GoldOrHostileMBPP(MBPP):
    """MBPP with real sandbox runs where the tiny model writes no code: the program of completion i is the gold
    code (i even) or one that first tries to kill its parent, the trainer (i odd). Every verdict still comes
    from the sandbox: correctness is 1 exactly for the gold half, and the trainer lives."""

    def programs(self, completions, examples):
        return [e.meta["gold_code"] if i % 2 == 0 else
                "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + e.meta["gold_code"]
                for i, e in enumerate(examples)]
