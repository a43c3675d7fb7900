"""Log files as users keep them, parsed into (step, {key: value}) records before any key is mapped.

verl console log: lines `... step:N - key:value - key:value ...` (verl's console logger; Ray prefixes such as
`(TaskRunner pid=1)`, logging prefixes (`INFO:root:`) and ANSI colours are skipped, numpy reprs `np.float64(0.1)`
read as numbers, nan/inf left out), plain or gzipped, CRLF or LF. Tabular logs: JSON lines of flat records, a JSON
list of them, or a CSV with a header, each with a step column (train/global_step, global_step, step, Step, _step):
a W&B export (API history or chart CSV) of a TRL, verl or OpenRLHF run, and custom loops' metrics.jsonl.
TensorBoard event files (OpenRLHF's use_tensorboard, HF's TensorBoardCallback) are read with tensorboard's own
EventAccumulator (the `trackers` extra). An unterminated last line (a job still writing) is left out when it
holds fewer keys than the record before it.
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
from mechdiag.metrics import is_number
from mechdiag.weights import PICKLE_SUFFIXES

_CONSOLE_STEP = re.compile(r"(?:^|[\s)\]:|])step(?::(\d+)| (\d+):) - ")  # "step:N - ", a fork's "step N: - "
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NP = re.compile(r"^np\.\w+\((.*)\)$")
# the trainer's own step before W&B's row counter (_step) or the chart export's x axis (Step)
STEP_KEYS = ("train/global_step", "trainer/global_step", "global_step", "step", "Step", "_step")
TB_EXTRA = "reading TensorBoard event files needs the tensorboard package: pip install 'mechdiag[trackers]'"
SNIFF_BYTES = 1 << 16
CONSOLE_SNIFF = 64 << 20  # how far into a file the first console line is looked for


def read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return raw.decode("utf-8", errors="replace").removeprefix("\ufeff")  # a spreadsheet's byte-order mark
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def _head(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(SNIFF_BYTES)
        if raw[:2] == b"\x1f\x8b":
            with gzip.open(path, "rb") as f:
                raw = f.read(SNIFF_BYTES * 16)
        return raw.decode("utf-8", errors="replace").removeprefix("\ufeff")
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
    if not data:  # prose that happens to say "step:3 - ", not a metrics line
        return None
    return int(m.group(1) or m.group(2)), data


def _lines(path: Path, limit: int):
    """The text lines of the first `limit` bytes of a file (gunzipped), read a chunk at a time."""
    with path.open("rb") as f:
        opener = gzip.open if f.read(2) == b"\x1f\x8b" else open
    rest = ""
    with opener(path, "rb") as f:
        done = 0
        while done < limit:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            done += len(chunk)
            lines = (rest + chunk.decode("utf-8", errors="replace")).split("\n")
            rest = lines.pop()
            yield from lines
    if rest:
        yield rest


def is_console_log(path: Path) -> bool:
    """A text file with a verl console line in its first CONSOLE_SNIFF bytes (Ray and vLLM start-up, the config
    dump and the first validation's generations can fill hundreds of kB before step 1)."""
    if not path.is_file() or path.suffix.lower() in (*PICKLE_SUFFIXES, ".safetensors", ".parquet", ".arrow"):
        return False
    head = _head(path)
    if not head or "\x00" in head[:8192]:  # binary
        return False
    try:
        return any(console_record(line) for line in _lines(path, CONSOLE_SNIFF))
    except (OSError, EOFError, gzip.BadGzipFile):
        return False


def _drop_torn(text: str, out: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """Without a final newline the last record may be cut mid-line: kept only if it holds every key of the one
    before it."""
    if len(out) > 1 and text and not text.endswith(("\n", "\r")) and not set(out[-2][1]) <= set(out[-1][1]):
        return out[:-1]
    return out


def console_records(path: Path) -> list[tuple[int, dict]]:
    text = read_text(path)
    out = _drop_torn(text, [r for r in map(console_record, text.splitlines()) if r is not None])
    if not out:
        raise UserError(f"{path} holds no verl console lines (`step:N - key:value - ...`)")
    return out


def _step_of(rec: dict):
    for k in STEP_KEYS:
        v = rec.get(k)
        if is_number(v):
            return int(v)
        if isinstance(v, str) and _value(v) is not None:
            return int(_value(v))
    return None


def _flat_numbers(rec: dict) -> dict:
    """Numbers of one record; a W&B CSV export's "RUN - key" columns by their key, its __MIN/__MAX bands left out."""
    out = {}
    for k, v in rec.items():
        if not isinstance(k, str) or k.endswith(("__MIN", "__MAX")):
            continue
        k = k.rsplit(" - ", 1)[1] if " - " in k else k
        if k in STEP_KEYS or k.startswith("_"):  # W&B's _runtime, _timestamp
            continue
        if is_number(v):
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


def _row_step(r: dict):
    """The step of a row; a W&B chart export names its columns "RUN - key"."""
    got = _step_of(r)
    if got is None:
        got = _step_of({k.rsplit(" - ", 1)[1]: v for k, v in r.items() if isinstance(k, str) and " - " in k})
    return got


def table_records(path: Path) -> list[tuple[int, dict]]:
    if is_tensorboard(path):
        return tensorboard_records(path)
    text = read_text(path)
    rows = _table_rows(path, text)
    if rows is None:
        raise UserError(f"{path}: not a JSON-lines, JSON or CSV log of records")
    out = []
    for r in rows:
        if isinstance(r, dict) and _row_step(r) is not None:
            nums = _flat_numbers(r)
            if nums:
                out.append((_row_step(r), nums))
    if path.suffix.lower() == ".csv":
        out = _drop_torn(text, out)
    if not out:
        raise UserError(f"{path} holds no records with a step ({', '.join(STEP_KEYS)}) and numbers")
    return out


# ---- TensorBoard ----------------------------------------------------------------------------------------------
def _event_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if "tfevents" in path.name else []
    return sorted(p for p in path.glob("*tfevents*") if p.is_file()) if path.is_dir() else []


def is_tensorboard(path: Path) -> bool:
    """An event file, or a folder holding event files (one run: SummaryWriter's log_dir)."""
    return bool(_event_files(path))


def tensorboard_records(path: Path) -> list[tuple[int, dict]]:
    """Scalars of the event file(s) at `path` by step, through tensorboard's EventAccumulator (simple values and
    the scalar tensors tf.summary writes); a step logged twice keeps its last value."""
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea  # noqa: PLC0415 - optional
        from tensorboard.util import tensor_util  # noqa: PLC0415 - optional
    except ImportError:
        raise UserError(f"{path}: {TB_EXTRA}") from None
    by_step: dict[int, dict] = {}
    for f in _event_files(path):
        acc = ea.EventAccumulator(str(f), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        try:
            acc.Reload()
        except Exception as e:  # noqa: BLE001 - a damaged event file raises several types
            raise UserError(f"cannot read TensorBoard events {f}: {e}") from None
        tags = acc.Tags()
        for tag in tags.get(ea.SCALARS, []):
            for ev in acc.Scalars(tag):
                if math.isfinite(ev.value):
                    by_step.setdefault(int(ev.step), {})[tag] = float(ev.value)
        for tag in tags.get(ea.TENSORS, []):
            for ev in acc.Tensors(tag):
                arr = tensor_util.make_ndarray(ev.tensor_proto)
                if arr.size == 1 and arr.dtype.kind in "fiu" and math.isfinite(float(arr.reshape(-1)[0])):
                    by_step.setdefault(int(ev.step), {})[tag] = float(arr.reshape(-1)[0])
    out = sorted(by_step.items())
    if not out:
        raise UserError(f"{path}: TensorBoard events with no scalars")
    return out
