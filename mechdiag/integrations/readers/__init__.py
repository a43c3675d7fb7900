"""Readers of other trainers' runs, one module per source, behind one entry (read_any_run; locate says which
reader takes a path):

    trl_dir.py     a TRL / Unsloth output_dir (trainer_state.json, completions parquet, checkpoint adapters)
    verl_log.py    verl's file-logger JSONL or console log, and its rollout dump
    table_log.py   W&B CSV exports, TensorBoard events, JSON-lines metrics of TRL, verl, OpenRLHF or custom loops
    common.py      what they share: group reward statistics, the inferred config, writing the run directory

Each converts a run into the run-directory shape once, here at the edge; recommend, report and watch read only
that shape (mechdiag.run.Run).
"""


import tempfile
from pathlib import Path

from mechdiag.errors import UserError
from mechdiag.integrations import logs
from mechdiag.integrations.readers.table_log import read_table_run
from mechdiag.integrations.readers.trl_dir import STATE_FILES, is_trl_dir, read_trl_run
from mechdiag.integrations.readers.verl_log import is_verl_file, read_verl_run
from mechdiag.run import Run, RunDir, callback_run, is_run_dir, load_run

# ---- any foreign run ----------------------------------------------------------------------------------------
SEARCH_DEPTH = 3  # a folder the user names may hold the run this many levels down (repo/outputs/checkpoint-N)


def _own_kind(path: Path) -> str | None:
    if path.is_file():
        if path.name in STATE_FILES:
            return "trl"
        if logs.is_tensorboard(path):
            return "table"
        if is_verl_file(path) or logs.is_console_log(path):
            return "verl"
        return "table" if logs.is_table_log(path) else None
    if is_trl_dir(path):
        return "trl"
    if (path / "metrics.jsonl").is_file() and not (path / "config.yaml").exists() and \
            logs.is_table_log(path / "metrics.jsonl"):  # metrics.jsonl without config.yaml: another loop's log
        return "table"
    if path.is_dir() and logs.is_tensorboard(path) and not (path / "config.yaml").exists():
        return "table"  # a SummaryWriter log_dir
    return None


def _target(kind: str, path: Path) -> Path:
    if kind == "trl" and path.is_file():
        return path.parent
    return path / "metrics.jsonl" if kind == "table" and path.is_dir() and not logs.is_tensorboard(path) else path


def locate(path) -> tuple[str, Path] | None:
    """(kind, the file or folder to read) for a foreign run at `path` or in one folder a few levels under it; None
    for a mechdiag run directory (or nothing recognised). Several runs under one folder: a UserError naming them."""
    path = Path(path)
    kind = _own_kind(path)
    if kind is not None:
        return kind, _target(kind, path)
    if not path.is_dir() or is_run_dir(path) or callback_run(path):  # a mechdiag run directory
        return None
    level, found = [path], []
    for _ in range(SEARCH_DEPTH):
        nxt = []
        for folder in level:
            for child in sorted(folder.iterdir()):
                if child.name.startswith(".") or child.name in ("SOURCE.md", "README.md"):
                    continue
                k = _own_kind(child)
                if k is not None and not (k == "trl" and child.name.startswith("checkpoint-")):
                    found.append((k, _target(k, child)))
                elif child.is_dir():
                    nxt.append(child)
        if found:
            break
        level = nxt
    found = list(dict.fromkeys(found))
    if len(found) > 1:
        raise UserError(f"{path} holds {len(found)} runs ({', '.join(str(p) for _, p in found[:4])}); name one")
    if not found and any(any(path.glob(f"checkpoint-*/{n}")) for n in STATE_FILES):
        return "trl", path
    return found[0] if found else None


def foreign_kind(path) -> str | None:
    """"trl", "verl" or "table" (OpenRLHF, a custom loop) for a foreign run at or under `path`, else None."""
    got = locate(path)
    return got[0] if got else None


def read_foreign(path, into) -> RunDir:
    got = locate(path)
    if got is None:
        raise UserError(f"{path} is neither a mechdiag run directory, a TRL output_dir, a verl log nor an "
                        "OpenRLHF/custom metrics log")
    kind, where = got
    if kind == "trl":
        return read_trl_run(where, into=into)
    if kind == "verl":
        return read_verl_run(where, into=into)
    return read_table_run(where, into=into)


def read_any_run(path) -> Run:
    """A mechdiag run directory, or another trainer's run converted into that shape once, here at the edge."""
    got = locate(path)
    if got is None:
        if Path(path).is_file():
            raise UserError(f"{path}: not a log mechdiag reads (TRL trainer_state.json, a verl JSONL or console "
                            "log, an OpenRLHF/custom metrics JSONL/CSV)")
        return load_run(path)
    with tempfile.TemporaryDirectory(prefix="mechdiag-foreign-") as tmp:
        rd = read_foreign(path, Path(tmp) / "run")
        run = load_run(rd.path, source=rd.summary().get("source", got[0]))
    run.path = Path(path)
    return run
