"""Crash-safe file output: whole files are written to a temporary name and renamed; JSON Lines are appended
and flushed record by record, and a partial last line left by a crash is dropped on read."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the final file gets the usual permissions
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def clean_json(value: Any) -> Any:
    """NaN and Inf become null, numpy/torch scalars become Python numbers (the JSON contract)."""
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(record: Any) -> str:
    return json.dumps(clean_json(record), allow_nan=False, ensure_ascii=False)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, dumps(obj) + "\n")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """A whole JSON Lines file, atomically (one record per line)."""
    write_text(path, "".join(dumps(r) + "\n" for r in records))


def append_jsonl(path: str | os.PathLike, records: list[dict], fsync: bool = False) -> None:
    """Append whole lines; a crash can leave at most one partial last line, which read_jsonl drops."""
    if not records:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(dumps(r) + "\n" for r in records)
    drop_partial_tail(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def drop_partial_tail(path: str | os.PathLike) -> None:
    """Cut a partial last line (a crash mid-append) so that the next append starts on a line of its own."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:  # scan back for the last newline, 64 KiB at a time
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                f.truncate(start + i + 1)
                return
            pos = start
        f.truncate(0)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file that exists to disk (checkpoints: records and weights are durable before the marker)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read JSON Lines; a last line without its newline (a crash mid-write) is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # partial last line
    out = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:  # json counts lines within the one line it was given: name the file's line
                raise ValueError(f"line {number} is not valid JSON ({getattr(e, 'msg', e)})") from None
    return out
