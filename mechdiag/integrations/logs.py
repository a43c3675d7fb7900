"""Log files as users keep them, parsed into (step, {key: value}) records before any key is mapped.

verl console log: lines `... step:N - key:value - key:value ...` (verl's console logger; Ray prefixes such as
`(TaskRunner pid=1)` and ANSI colours are skipped, numpy reprs `np.float64(0.1)` read as numbers), plain or
gzipped. Tabular logs: JSON lines of flat records, a JSON list of them, or a CSV with a header, each with a step
column (step, _step, global_step, train/global_step, Step): OpenRLHF's train/* keys as a W&B export holds them,
and custom loops' metrics.jsonl.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
from pathlib import Path

from mechdiag.errors import UserError

_CONSOLE_STEP = re.compile(r"(?:^|[\s)\]])step:(\d+) - ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NP = re.compile(r"^np\.\w+\((.*)\)$")
STEP_KEYS = ("step", "_step", "global_step", "train/global_step", "Step", "trainer/global_step")
SNIFF_BYTES = 1 << 16


def read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return raw.decode("utf-8", errors="replace")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def _head(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(SNIFF_BYTES)
        if raw[:2] == b"\x1f\x8b":
            with gzip.open(path, "rb") as f:
                raw = f.read(SNIFF_BYTES * 16)
        return raw.decode("utf-8", errors="replace")
    except (OSError, EOFError, gzip.BadGzipFile):
        return ""


def _value(text: str):
    text = text.strip()
    m = _NP.match(text)
    if m:
        text = m.group(1)
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def console_record(line: str) -> tuple[int, dict] | None:
    """One verl console line -> (step, {key: number}); None for any other line."""
    line = _ANSI.sub("", line)
    m = _CONSOLE_STEP.search(line)
    if not m:
        return None
    data = {}
    for part in line[m.end():].split(" - "):
        key, sep, val = part.rpartition(":")
        v = _value(val) if sep else None
        if key and v is not None:
            data[key.strip()] = v
    return int(m.group(1)), data


def is_console_log(path: Path) -> bool:
    return path.is_file() and any(console_record(line) for line in _head(path).splitlines()[:2000])


def console_records(path: Path) -> list[tuple[int, dict]]:
    out = [r for r in map(console_record, read_text(path).splitlines()) if r is not None]
    if not out:
        raise UserError(f"{path} holds no verl console lines (`step:N - key:value - ...`)")
    return out


def _step_of(rec: dict):
    for k in STEP_KEYS:
        v = rec.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return int(v)
        if isinstance(v, str) and _value(v) is not None:
            return int(_value(v))
    return None


def _flat_numbers(rec: dict) -> dict:
    """Numbers of one record; a W&B CSV export's "RUN - key" columns by their key, its __MIN/__MAX bands left out."""
    out = {}
    for k, v in rec.items():
        if not isinstance(k, str) or k in STEP_KEYS or k.endswith(("__MIN", "__MAX")):
            continue
        k = k.split(" - ", 1)[1] if " - " in k else k
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
        elif isinstance(v, str) and _value(v) is not None:
            out[k] = _value(v)
    return out


def _table_rows(path: Path, text: str) -> list[dict] | None:
    stripped = text.lstrip()
    if path.suffix.lower() == ".csv" or (path.name.endswith(".csv.gz")):
        try:
            return list(csv.DictReader(io.StringIO(text)))
        except csv.Error:
            return None
    if stripped.startswith("["):
        try:
            rows = json.loads(stripped)
        except ValueError:
            return None
        return rows if isinstance(rows, list) else None
    rows = []
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        try:
            rows.append(json.loads(ln))
        except ValueError:
            if i == len(lines) - 1 and rows:
                break  # a torn last line of a running job
            return None
    return rows


def is_table_log(path: Path) -> bool:
    """A tabular log: flat records with a step column and numbers (not verl's {"step", "data"} lines)."""
    if not path.is_file() or path.suffix.lower() not in (".jsonl", ".json", ".csv", ".gz"):
        return False
    head = _head(path)
    rows = _table_rows(path, head if path.suffix.lower() != ".json" else read_text(path))
    if not rows and head:  # a head cut mid-line: judge by its complete lines
        rows = _table_rows(path, "\n".join(head.splitlines()[:-1]))
    rows = [r for r in (rows or [])[:20] if isinstance(r, dict)]
    return bool(rows) and not isinstance(rows[0].get("data"), dict) and \
        any(_step_of(r) is not None and _flat_numbers(r) for r in rows)


def table_records(path: Path) -> list[tuple[int, dict]]:
    rows = _table_rows(path, read_text(path))
    if rows is None:
        raise UserError(f"{path}: not a JSON-lines, JSON or CSV log of records")
    out = []
    for r in rows:
        if isinstance(r, dict) and _step_of(r) is not None:
            nums = _flat_numbers(r)
            if nums:
                out.append((_step_of(r), nums))
    if not out:
        raise UserError(f"{path} holds no records with a step ({', '.join(STEP_KEYS)}) and numbers")
    return out
