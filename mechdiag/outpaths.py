"""Output paths checked before any work: a file where a file can be written, a folder where a folder can be made.

Every command calls check_output on each output it was given, so a wrong path costs one line and exit code 2, not
minutes of computing followed by a traceback, and nothing is created by the check itself."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mechdiag.errors import UserError


def _first_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output(path: str | os.PathLike | None, flag: str, kind: str = "file") -> Path | None:
    """Raise UserError unless `path` can be written as a `kind` ("file" or "dir"); None passes (a default is used).

    A file must not be an existing folder; a folder must not be an existing file; the nearest existing ancestor
    must be a folder we can create entries in (probed with a temporary file, since permission bits say nothing
    for root or on read-only mounts)."""
    if path is None:
        return None
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be file or dir, got {kind!r}")
    p = Path(path)
    if str(path).strip() == "":
        raise UserError(f"{flag}: empty path")
    if kind == "file" and p.is_dir():
        raise UserError(f"{flag} {p}: is a folder; give a file name")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p}: is a file; give a folder")
    anchor = _first_existing(p if kind == "dir" else p.parent)
    if not anchor.is_dir():
        raise UserError(f"{flag} {p}: {anchor} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mechdiag-probe-", dir=anchor)
    except OSError as e:
        raise UserError(f"{flag} {p}: cannot write in {anchor} ({e.strerror or type(e).__name__})") from None
    os.close(fd)
    os.unlink(probe)
    if kind == "file" and p.exists() and not os.access(p, os.W_OK) and os.geteuid() != 0:
        raise UserError(f"{flag} {p}: exists and is not writable")
    return p
