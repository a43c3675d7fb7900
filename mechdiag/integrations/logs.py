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
# a record's step, by the first of these it holds (authors' own loops count updates or iterations)
STEP_KEYS = ("train/global_step", "trainer/global_step", "global_step", "step", "Step", "_step", "global_steps",
             "train_step", "training_step", "update", "iteration", "iter")
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


def _column_key(key: str) -> str:
    """A column title as its log key: a table copied from a notebook's progress table spells TRL's keys with " / "
    (Unsloth: "rewards / correctness_reward_func") and titles the loss "Training Loss"."""
    key = key.replace(" / ", "/")
    return "loss" if key == "Training Loss" else key


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
            nums = {_column_key(k): v for k, v in _flat_numbers(r).items()}
            if nums:
                out.append((_row_step(r), nums))
    if path.suffix.lower() == ".csv":
        out = _drop_torn(text, out)
    if not out:
        raise UserError(f"{path} holds no records with a step ({', '.join(STEP_KEYS)}) and numbers")
    return out


def _run_of(key) -> str | None:
    """The run a W&B chart export's "RUN - key" column belongs to."""
    return key.rsplit(" - ", 1)[0] if isinstance(key, str) and " - " in key else None


def table_launches(path: Path) -> list[dict]:
    """The runs in a tabular log: [{"name", "records", "why"}]. A W&B chart CSV holding several runs' columns
    ("RUN - key") is split by run, each named by its W&B run name; TensorBoard events by launch
    (tensorboard_launches); anything else is one run named by the file."""
    if is_tensorboard(path):
        return tensorboard_launches(path)
    text = read_text(path)
    rows = _table_rows(path, text)
    if rows is None:
        raise UserError(f"{path}: not a JSON-lines, JSON or CSV log of records")
    rows = [r for r in rows if isinstance(r, dict)]
    names = list(dict.fromkeys(n for r in rows[:1] for k in r if (n := _run_of(k)) and
                               not str(k).endswith(("__MIN", "__MAX"))))
    if len(names) <= 1:
        return [{"name": names[0] if names else path.name, "records": table_records(path), "why": ""}]
    out = []
    for name in names:
        recs = []
        for r in rows:
            own = {k: v for k, v in r.items() if not isinstance(k, str) or _run_of(k) in (None, name)}
            step = _row_step(own)
            nums = _flat_numbers(own) if step is not None else {}
            if nums:
                recs.append((step, nums))
        if recs:
            out.append({"name": name, "records": recs, "why": "the columns of one W&B run in a chart export"})
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


def _event_scalars(f: Path, ea, tensor_util) -> dict[int, dict]:
    """Scalars of one event file by step (a gzipped copy is read through a temporary file)."""
    import tempfile  # noqa: PLC0415 - only gzipped event files need it

    by_step: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mechdiag-tb-") as tmp:
        src = f
        if f.suffix == ".gz":
            src = Path(tmp) / f.name.removesuffix(".gz")
            try:
                src.write_bytes(gzip.decompress(f.read_bytes()))
            except (OSError, EOFError, gzip.BadGzipFile) as e:
                raise UserError(f"cannot read TensorBoard events {f}: {e}") from None
        acc = ea.EventAccumulator(str(src), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        try:
            acc.Reload()
        except Exception as e:  # noqa: BLE001 - a damaged event file raises several types
            raise UserError(f"cannot read TensorBoard events {f}: {e}") from None
        tags = acc.Tags()
        for tag in tags.get(ea.SCALARS, []):
            for ev in acc.Scalars(tag):
                by_step.setdefault(int(ev.step), {})[tag] = float(ev.value)
        for tag in tags.get(ea.TENSORS, []):
            for ev in acc.Tensors(tag):
                arr = tensor_util.make_ndarray(ev.tensor_proto)
                if arr.size == 1 and arr.dtype.kind in "fiu":
                    by_step.setdefault(int(ev.step), {})[tag] = float(arr.reshape(-1)[0])
    return by_step


def tensorboard_launches(path: Path) -> list[dict]:
    """The launches in TensorBoard event file(s) at `path`: [{"name", "records", "why"}]. One event file is one
    launch; the files of one folder are one run when their steps follow on (a resumed job), and separate launches
    when a file's steps start again at or below another's (a logging_dir reused by several runs). Non-finite values
    are kept (NaN is a finding); a step logged twice in one file keeps its last value."""
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea  # noqa: PLC0415 - optional
        from tensorboard.util import tensor_util  # noqa: PLC0415 - optional
    except ImportError:
        raise UserError(f"{path}: {TB_EXTRA}") from None
    files = [(f, _event_scalars(f, ea, tensor_util)) for f in _event_files(path)]
    files = [(f, s) for f, s in files if s]
    if not files:
        raise UserError(f"{path}: TensorBoard events with no scalars")
    files.sort(key=lambda fs: min(fs[1]))
    restarts = any(min(b[1]) <= max(a[1]) for a, b in zip(files, files[1:], strict=False))
    if not restarts:
        merged: dict[int, dict] = {}
        for _, s in files:
            for step, d in s.items():
                merged.setdefault(step, {}).update(d)
        return [{"name": path.name, "records": sorted(merged.items()), "why": ""}]
    files.sort(key=lambda fs: fs[0].name)
    return [{"name": f.name.removesuffix(".gz"), "records": sorted(s.items()),
             "why": "one event file of a logging_dir several launches wrote (steps start again)"} for f, s in files]


def tensorboard_records(path: Path) -> list[tuple[int, dict]]:
    """Scalars of the event file(s) at `path` by step, through tensorboard's EventAccumulator (simple values and
    the scalar tensors tf.summary writes), when they hold one run; several launches: a UserError naming them."""
    launches = tensorboard_launches(path)
    if len(launches) > 1:
        raise UserError(f"{path} holds {len(launches)} launches; read them through readers.read_runs")
    return launches[0]["records"]


# ---- printed log dicts (TRL, Unsloth: the trainer's `{'loss': ..., 'reward': ...}` lines on stdout) ----------------
_PRINTED = re.compile(r"\{'[^{}\n]*\}")
_BARE = re.compile(r"(?<=[:\[,(\s])(-?)(nan|inf|infinity)(?=\s*[,}\])])", re.IGNORECASE)
_TQDM = re.compile(r"\|\s*(\d+)/(\d+)\s*\[")
# bars that are not training steps: loading shards, datasets.map, downloads, generation, evaluation, saving
_OTHER_BAR = re.compile(r"load|shard|map\b|filter|download|fetch|tokeni|generat|eval|saving|writing|process|extract|"
                        r"resolv|convert|merg", re.IGNORECASE)


def _training_bar(line: str, m: re.Match) -> bool:
    """Whether the tqdm bar matched in `line` counts training steps: its label (the text before it, from the last
    carriage return) names none of the other work a log draws bars for."""
    label = line[:m.start()].rsplit("\r", 1)[-1].rsplit("|", 1)[0]
    return not _OTHER_BAR.search(label)
# a trainer starting again in the same file: Unsloth's banner, HF's "***** Running training *****"
_BROKEN = re.compile(r"\{'(loss|reward|grad_norm)'")  # the start of a training log dict
_LAUNCH = re.compile(r"\*{5} Running training \*{5}|==\(\(====\)\)==\s+Unsloth - 2x faster|Total steps = \d+")
SUMMARY_KEY = "train_runtime"  # the dict HF prints when train() returns: the end of one launch


def printed_dict(text: str) -> dict | None:
    """One printed log dict -> {key: number}; nan and inf kept as float nan/inf (a NaN grad_norm is a finding)."""
    import ast  # noqa: PLC0415 - only printed dicts need it

    try:  # bare nan / inf become strings literal_eval accepts, read back as floats below
        got = ast.literal_eval(_BARE.sub(lambda m: f"'{m[1]}{m[2]}'", text))
    except (ValueError, SyntaxError):
        return None
    if not isinstance(got, dict) or not got:
        return None
    out = {}
    for k, v in got.items():
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(k, str):
            out[k] = float(v)
    return out or None


WRAP_MAX = 1 << 16  # a printed dict hard-wrapped by a terminal is joined back over at most this many characters


def unwrapped(lines):
    """The lines with each printed dict that a terminal capture (tmux, screen) hard-wrapped at its width joined back
    (without a separator: the wrap cuts inside keys and numbers): a line that opens a dict it does not close takes
    the next lines until the braces balance, or until another dict begins (the open one was cut off)."""
    buf = None
    for line in lines:
        if buf is not None and "{'" in line:  # a new dict begins: the open one was cut off, not wrapped
            yield buf
            buf = None
        if buf is not None:
            buf += line
            if buf.count("{") <= buf.count("}") or len(buf) > WRAP_MAX:
                yield buf
                buf = None
            continue
        at = line.rfind("{'")
        if at >= 0 and line.count("{", at) > line.count("}", at):
            buf = line
        else:
            yield line
    if buf is not None:
        yield buf


def _is_printed_line(line: str) -> bool:
    return "{'" in line and _PRINTED.search(line) is not None


_LOG_DICT_KEYS = ("loss", "reward", "grad_norm", "kl", "learning_rate", "epoch", "reward_std", "completion_length",
                  "entropy", "frac_reward_zero_std")


def _is_log_dict(d: dict) -> bool:
    """A trainer's logged record: two of its keys at least (TRL's always carry loss, grad_norm, learning_rate and
    epoch), a rewards/ or completions/ key, or an eval record; a dict of one completion's rewards printed by a
    reward function ({'format_reward': 1.0, 'answer_reward': 0.0, 'reward': 0.0}) is not."""
    return (sum(k in d for k in _LOG_DICT_KEYS) >= 2 or any(k.startswith(("rewards/", "completions/", "eval_"))
                                                             for k in d))


def is_printed_log(path: Path) -> bool:
    """A text file with a printed TRL/Unsloth log dict (a `{'loss': ...}` or `{'reward': ...}` line)."""
    if not path.is_file() or path.suffix.lower() in (*PICKLE_SUFFIXES, ".safetensors", ".parquet", ".arrow", ".json",
                                                       ".jsonl", ".csv"):
        return False
    head = _head(path)
    if not head or "\x00" in head[:8192]:
        return False
    try:
        for line in unwrapped(_lines(path, CONSOLE_SNIFF)):
            if _is_printed_line(line):
                for m in _PRINTED.finditer(line):
                    d = printed_dict(m.group(0))
                    if d and _is_log_dict(d):
                        return True
    except (OSError, EOFError, gzip.BadGzipFile):
        return False
    return False


def _train_total(bars: list[tuple[int, int, int]]) -> int | None:
    """The training progress bar's total: the one redrawn most often (a dataset map or an eval bar moves less)."""
    updates: dict[int, int] = {}
    for total, _, _ in bars:
        updates[total] = updates.get(total, 0) + 1
    return max(updates, key=lambda t: (updates[t], t)) if updates else None


def _bar_steps(recs: list[dict], bars: list[tuple[int, int, int]]) -> tuple[list[int] | None, str]:
    """Each record's step from the training progress bar (its position when the record was printed), or None where
    a record has no bar before it, or two train records share a position (a bar not redrawn every step)."""
    if not recs or not bars:
        return None, ""
    train = _train_total(bars)
    last, steps, j, prev = None, [], 0, 0
    for i, d in enumerate(recs):  # the bar's last position printed before record i
        while j < len(bars) and bars[j][2] <= i:
            if bars[j][0] == train:
                last = bars[j][1]
            j += 1
        evaluation = any(k.startswith("eval_") for k in d)
        # a bar not redrawn at every step (tqdm off a terminal) repeats: two train records at one position
        if last is None or last < 1 or last < prev or (not evaluation and last == prev):
            return None, ""
        steps.append(last)
        prev = last if not evaluation else prev
    return steps, f"step = the training progress bar's position (of {train}) when each dict was printed"


def printed_launches(path: Path) -> list[dict]:
    """The launches in a console log of printed log dicts: [{"records": [(step, data)], "interval": k, "why": ...}].

    A launch ends at the summary dict HF prints when train() returns (train_runtime), at a trainer's start banner
    after records, or where the epoch goes back. The dicts carry no step. HF prints each just after the training
    progress bar reached its step, so a record's step is that bar's position when it was printed (the training bar:
    the total with the most updates; other bars, datasets.map or evals, move less). Without one for every record,
    the step is the record's index times the logging interval: the bar's total (or the banner's "Total steps") over
    the records printed when that ratio is a whole number (within 2%) and the run reached its end (the summary dict,
    or the bar at its total), else 1 (the step is then the record index, said so)."""
    out = printed_launches_in(read_text(path))
    if not out:
        raise UserError(f"{path} holds no printed log dicts (`{{'loss': ..., 'reward': ...}}`)")
    return out


_LOGGING = re.compile(r"\blogging_steps\s*[=:]\s*(\d+)")  # a config's logging interval (a dump, a notebook's code)


def printed_launches_in(text: str, source: str = "") -> list[dict]:
    """printed_launches of a text (a console log's, or a notebook's cell output): [] when it holds no dict.
    `source`: text that states the run's settings without printing its records (a notebook's code cells)."""
    text = text.replace("\r", "\n")
    intervals = [int(m.group(1)) for m in _LOGGING.finditer(source + "\n" + text)]
    interval = intervals[-1] if intervals and len(set(intervals)) == 1 and intervals[-1] > 0 else None
    launches, cur, bars = [], [], []  # bars: (total, position) in file order, with the record count before each
    declared = []  # a banner's "Total steps = N" (Unsloth), for a log whose progress bars were not kept
    broken = [0]  # printed dicts cut off or unreadable (a log pasted in part): skipped, and said so

    def close(finished: bool = False):
        if cur:
            launches.append({"records": list(cur), "bars": list(bars), "declared": list(declared),
                             "finished": finished, "broken": broken[0]})
            broken[0] = 0
        cur.clear()
        bars.clear()
        declared.clear()

    last_epoch = None
    for line in unwrapped(text.split("\n")):
        line = _ANSI.sub("", line)
        if _LAUNCH.search(line) and cur:
            close()
            last_epoch = None
        declared += _planned(line)
        printed = [(m.start(), m.group(0)) for m in _PRINTED.finditer(line)] if _is_printed_line(line) else []
        if _BROKEN.search(line) and not any(_BROKEN.search(body) for _, body in printed):
            broken[0] += 1  # a training dict opened and never closed
        events = sorted([(m.start(), "bar", m) for m in _TQDM.finditer(line) if _training_bar(line, m)] +
                        [(at, "dict", body) for at, body in printed], key=lambda e: e[0])
        for _, what, item in events:
            if what == "bar":
                bars.append((int(item.group(2)), int(item.group(1)), len(cur)))
                continue
            d = printed_dict(item)
            if not d:
                broken[0] += bool(_BROKEN.search(item))
                continue
            if SUMMARY_KEY in d:
                close(finished=True)
                last_epoch = None
                continue
            if not _is_log_dict(d):
                continue
            ep = d.get("epoch")
            if ep is not None and last_epoch is not None and ep < last_epoch - 1e-9:
                close()
            last_epoch = ep if ep is not None else last_epoch
            cur.append(d)
    close()
    out = []
    for la in launches:
        recs = la["records"]
        steps, why = _bar_steps(recs, la["bars"])
        k = 0
        if steps is None:
            n_train = sum(1 for d in recs if not any(kk.startswith("eval_") for kk in d))
            total = _train_total(la["bars"]) or max(la["declared"], default=0)
            # the records span the whole run only if it ran to its end: the summary dict, or the bar at its total
            ended = la["finished"] or any(t == total and pos == total for t, pos, _ in la["bars"])
            ratio = total / n_train if n_train and ended else 0
            k = round(ratio) if ratio >= 1.5 and abs(ratio - round(ratio)) <= 0.02 * ratio else 1
            why = (f"step = record index x {k} (progress bar total {total} / {n_train} printed records)" if k > 1
                   else "step = record index (the printed dicts carry no step)")
            if k == 1 and interval and interval > 1:  # the config's own interval (one value stated, no bar)
                k, why = interval, f"step = record index x {interval} (logging_steps = {interval} as the run states)"
            steps, i = [], 0
            for d in recs:
                if not any(kk.startswith("eval_") for kk in d):
                    i += 1
                steps.append(max(i, 1) * k)
        if la["broken"]:
            why += f"; {la['broken']} printed dict(s) cut off or unreadable, skipped"
        out.append({"records": list(zip(steps, recs, strict=True)), "interval": k or None, "why": why})
    return out


# ---- stepped lines (a custom loop's print: "[Step 020] Loss = -76.3 - Avg Reward = 0.562", "step 5 | kl: 0.01") --
# a line's step: named (step 5, Step: 5, iteration=5), or a loop's counter "(5/9751)" (minimind's "Epoch:[1/1](5/9751)")
_STEP_LINE = re.compile(r"\b(?:global[_ ]step|step|iteration|iter|update)\b\s*[\[:=#]?\s*(\d+)|\((\d+)/\d+\)",
                        re.IGNORECASE)
# name = number, or a count of a total ("correct=1/2": a share)
_PAIR = re.compile(r"([A-Za-z][\w /.-]{0,40}?)\s*[:=]\s*(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:/\d+)?|nan|inf)"
                   r"(?![\w.])", re.IGNORECASE)
STEP_LINE_KEYS = ("reward", "loss", "kl", "entropy", "accuracy", "score")  # a stepped line names one of these
STEP_LINES_MIN = 3  # ...on at least this many lines with rising steps


def step_line_records(text: str) -> list[tuple[int, dict]]:
    """The records of a custom loop's printed lines: each line with a step and `name = number` (or `name: number`)
    pairs, at least one of them a metric (STEP_LINE_KEYS); names lower-cased, spaces as underscores. [] unless
    STEP_LINES_MIN such lines have rising steps (a README's "Step 1: install" is not a run)."""
    out, unstepped = [], []
    for line in text.replace("\r", "\n").split("\n"):
        m = _STEP_LINE.search(line)
        data = {}
        for name, value in _PAIR.findall(line[m.end():] if m else line):
            key = "_".join(name.rsplit(" - ", 1)[-1].strip(" -|/.").lower().split())  # past a logger's "- INFO -"
            num, _, total = value.partition("/")
            if key and key not in ("step", "epoch_step") and (not total or int(total) > 0):
                data[key] = float(num) / int(total) if total else float(value)
        if not any(w in k for k in data for w in STEP_LINE_KEYS):
            continue
        if m:
            out.append((int(m.group(1) or m.group(2)), data))
        elif len(data) >= 3:  # a loop that logs each step without its number: three or more metrics a line
            unstepped.append(data)
    steps = [st for st, _ in out]
    if len(out) < STEP_LINES_MIN or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        out = []
    if not out and len(unstepped) >= STEP_LINES_MIN and all(d.keys() == unstepped[0].keys() for d in unstepped):
        out = list(enumerate(unstepped, start=1))  # the same metrics on every line: one line a step
    return out


def is_step_line_log(path: Path) -> bool:
    """A text file whose lines print a custom loop's steps (step_line_records)."""
    if not path.is_file() or path.suffix.lower() in (*PICKLE_SUFFIXES, ".safetensors", ".parquet", ".arrow", ".json",
                                                       ".jsonl", ".csv", ".ipynb"):
        return False
    head = _head(path)
    if not head or "\x00" in head[:8192]:
        return False
    try:
        return bool(step_line_records("\n".join(_lines(path, CONSOLE_SNIFF))))
    except (OSError, EOFError, gzip.BadGzipFile):
        return False


# ---- how a text log ends: a traceback after its last record is a run that crashed --------------------------------
_TRACEBACK = "Traceback (most recent call last):"
_PREFIX = re.compile(r"^\(\w+ pid=\d+\)\s*")  # Ray's worker prefix
CRASH_TAIL_LINES = 6  # the exception line this near the end of the log (a hint or two may follow it)
_FRAME = re.compile(r'^File ".*", line \d+, in (\S+)')
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)$")
_PLANNED = re.compile(r"(?:\b(\d[\d,]*) total steps\b|Total steps = (\d[\d,]*)|\bmax_steps\s*[=:]\s*(\d+)"
                      r"|Total training steps: (\d+))")  # the last: verl's trainer
_RECORD_MARK = re.compile(_BROKEN.pattern + r"|\bstep\s*[:=#\[]?\s*\d+", re.IGNORECASE)


def _planned(text: str) -> list[int]:
    """The planned totals a log states ("233 total steps", Unsloth's banner "Total steps = 405", max_steps=N)."""
    return [int(next(g for g in m.groups() if g).replace(",", "")) for m in _PLANNED.finditer(text)]


def _plain_lines(text: str) -> list[str]:
    """The text's non-empty lines without colour codes or Ray's worker prefix."""
    lines = (_PREFIX.sub("", _ANSI.sub("", x)).strip() for x in text.replace("\r", "\n").split("\n"))
    return [ln for ln in lines if ln]


def _crash(text: str, after: int) -> dict:
    """{"error": the exception line of the last traceback after offset `after`, where it is among the text's last
    lines (the process died of it; a worker's traceback logged while the run went on is followed by more of the
    run), "first_error": the first exception logged after `after` where it differs (a worker's import error that
    the driver's last exception only reports as a lost actor)}; {} without one."""
    at = text.rfind(_TRACEBACK)
    if at <= after:
        return {}
    lines = _plain_lines(text[at:])[1:]
    hits = [i for i, ln in enumerate(lines) if _EXCEPTION.match(ln)]
    if not hits or len(lines) - hits[-1] > CRASH_TAIL_LINES:
        return {}
    error = lines[hits[-1]][:300]
    frames = [m.group(1) for ln in lines[:hits[-1]] if (m := _FRAME.match(ln))]
    kind = error.split(":", 1)[0]
    first = next((ln[:300] for ln in _plain_lines(text[text.find(_TRACEBACK, after + 1):at])
                  if _EXCEPTION.match(ln) and kind not in ln), None)
    return {"error": error + (f" (raised in {frames[-1]})" if frames else ""),
            **({"first_error": first} if first else {})}


def stopped_ending(text: str) -> dict | None:
    """How a printed training log that holds no metric record ended: {"error": the exception it died of,
    "reached_step": the training progress bar's last position, "planned_steps": its total or the banner's}; None
    for text that shows neither a crash at its end nor a training progress bar (not a training log)."""
    bars = [(int(m.group(2)), int(m.group(1))) for line in text.replace("\r", "\n").split("\n")
            for m in _TQDM.finditer(line) if _training_bar(line, m)]
    total = _train_total([(t, pos, 0) for t, pos in bars])
    out = _crash(text, -1)
    if not out and total is None:
        return None
    if total is not None:
        out["reached_step"] = max(pos for t, pos in bars if t == total)
    planned = total or max(_planned(text), default=0)
    if planned:
        out["planned_steps"] = planned
    return out


def is_stopped_log(path: Path) -> bool:
    """A text file of a training run that logged no metric record: it died of a traceback, or only its progress
    bar was kept (stopped_ending)."""
    if not path.is_file() or path.suffix.lower() not in (".log", ".txt", ".out", ".err", ".md", ".gz", ""):
        return False
    try:
        return stopped_ending(read_text(path)) is not None
    except (OSError, UnicodeDecodeError, UserError):
        return False


def log_ending(text: str) -> dict:
    """{"error": the exception line of a traceback printed after the log's last record, "planned_steps": the run's
    planned total where the log states it}; {} when it ends cleanly and states nothing."""
    out = {}
    planned = _planned(text)
    if planned:
        out["planned_steps"] = planned[-1]
    last = max((m.start() for m in _RECORD_MARK.finditer(text)), default=-1)
    if last >= 0:  # a traceback after the last record
        out.update(_crash(text, last))
    return out
