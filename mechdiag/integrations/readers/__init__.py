"""Readers of other trainers' runs, one module per source, behind one entry (read_any_run; locate says which
reader takes a path):

    trl_dir.py     a TRL / Unsloth output_dir (trainer_state.json, completions parquet, checkpoint adapters)
    verl_log.py    verl's file-logger JSONL or console log, and its rollout dump
    table_log.py   W&B CSV exports, TensorBoard events, JSON-lines metrics of TRL, verl, OpenRLHF or custom loops
    notebook.py    a Jupyter / Colab notebook's saved outputs: HF's progress table, or printed TRL log dicts
    common.py      what they share: group reward statistics, the inferred config, writing the run directory

Each converts a run into the run-directory shape once, here at the edge; recommend, report and watch read only
that shape (mechdiag.run.Run).
"""


import tempfile
from pathlib import Path

from mechdiag import console
from mechdiag.errors import UserError
from mechdiag.integrations import logs
from mechdiag.integrations.readers.notebook import is_notebook, is_page_log, notebook_launches, page_launches
from mechdiag.integrations.readers.table_log import read_table_run
from mechdiag.integrations.readers.trl_dir import STATE_FILES, is_trl_dir, read_trl_run
from mechdiag.integrations.readers.verl_log import is_verl_file, read_verl_run
from mechdiag.run import NOT_A_LOG, Run, RunDir, callback_run, is_run_dir, load_run

# ---- any foreign run ----------------------------------------------------------------------------------------
SEARCH_DEPTH = 3  # a folder the user names may hold the run this many levels down (repo/outputs/checkpoint-N)


SEP = "#"  # PATH#NAME: one named run or launch of a file or folder that holds several
TEXT_KINDS = ("printed", "steps", "verl")  # logs a trainer printed: a traceback after the last record is a crash


def _own_kind(path: Path) -> str | None:
    if path.is_file():
        if path.name in STATE_FILES:
            return "trl"
        if is_notebook(path):
            return "notebook"
        if logs.is_tensorboard(path):
            return "table"
        if is_verl_file(path) or logs.is_console_log(path):
            return "verl"
        if logs.is_table_log(path):
            return "table"
        if logs.is_printed_log(path):
            return "printed"
        if is_page_log(path):
            return "page"
        return "steps" if logs.is_step_line_log(path) else None
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


def split_name(path) -> tuple[Path, str | None]:
    """PATH#NAME -> (PATH, NAME); a path that exists as written is never split."""
    text = str(path)
    if SEP in text and not Path(text).exists():
        head, _, name = text.rpartition(SEP)
        return Path(head), name
    return Path(text), None


def sources(path) -> list[tuple[str, Path]]:
    """(kind, the file or folder to read) of every foreign run at `path` or in the first folder level (at most
    SEARCH_DEPTH down) that holds any; [] for a mechdiag run directory or nothing recognised."""
    path = split_name(path)[0]
    kind = _own_kind(path)
    if kind is not None:
        return [(kind, _target(kind, path))]
    if logs.is_stopped_log(path):  # named itself (never found in a folder): a log that died, or kept only its bar
        return [("stopped", path)]
    if not path.is_dir() or is_run_dir(path) or callback_run(path):  # a mechdiag run directory
        return []
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
    if not found and any(any(path.glob(f"checkpoint-*/{n}")) for n in STATE_FILES):
        return [("trl", path)]
    return found


def locate(path) -> tuple[str, Path] | None:
    """(kind, the file or folder to read) of the foreign run at or under `path` (the first of several: runs_in
    tells them apart); None for a mechdiag run directory (or nothing recognised)."""
    found = sources(path)
    return found[0] if found else None


def foreign_kind(path) -> str | None:
    """"trl", "verl", "table" (OpenRLHF, a custom loop, W&B, TensorBoard), "printed" (a console log of printed
    TRL/Unsloth log dicts), "steps" (a custom loop's printed lines: "[Step 20] Loss = ... - Avg Reward = ...") or
    "notebook" (a notebook's saved outputs), "page" (a notebook exported as Markdown or HTML: its progress table)
    or "stopped" (a log with no record: how it ended) for a foreign run at or under `path`, else None."""
    got = locate(path)
    return got[0] if got else None


def _entries(kind: str, where: Path) -> list[dict]:
    """The runs one source holds: {"name", "kind", "where", "records" (None: the reader reads the source), "why"}."""
    if kind == "table":
        return [{"name": la["name"], "kind": kind, "where": where, "records": la["records"], "why": la["why"]}
                for la in logs.table_launches(where)]
    if kind == "notebook":
        got = notebook_launches(where)
        if not got:
            raise UserError(f"{where}: a notebook whose saved outputs hold no training log (HF's progress table or "
                            "printed log dicts); save it with its outputs, or give the trainer's output_dir")
        return [{**e, "kind": kind, "where": where} for e in got]
    if kind == "steps":
        return [{"name": where.name, "kind": kind, "where": where, "records": logs.step_line_records(
            logs.read_text(where)), "why": "step = the step each printed line names", "trainer": None}]
    if kind == "page":
        return [{**e, "kind": kind, "where": where} for e in page_launches(where)]
    if kind == "stopped":
        return [{"name": where.name, "kind": kind, "where": where, "records": [], "trainer": None,
                 "why": "the log holds no metric record", "ended": logs.stopped_ending(logs.read_text(where))}]
    if kind == "printed":
        got = logs.printed_launches(where)
        return [{"name": f"{where.name}:launch{i + 1}" if len(got) > 1 else where.name, "kind": kind,
                 "where": where, "records": la["records"], "why": la["why"]} for i, la in enumerate(got)]
    return [{"name": where.name if where.name not in ("", ".") else str(where), "kind": kind, "where": where,
             "records": None, "why": ""}]


def runs_in(path) -> list[dict]:
    """Every run a path holds, told apart and named: the launches of one TensorBoard logging_dir or console log, the
    runs of a W&B chart export, the runs of a folder. Entries of the same W&B run in several exports (one chart
    CSV per metric) are one run: their records are joined by step, never pooled as seeds."""
    merged: dict[str, dict] = {}
    for kind, where in sources(path):
        for e in _entries(kind, where):
            same = merged.get(e["name"])
            if same is not None and same["records"] is not None and e["records"] is not None:
                rows = dict(same["records"])
                for step, data in e["records"]:
                    rows[step] = {**rows.get(step, {}), **data}
                same["records"] = sorted(rows.items())
                same["files"].append(where)
                same["why"] = f"one W&B run's columns joined from {len(same['files'])} exports"
            else:
                key = e["name"] if e["name"] not in merged else f"{e['name']} ({where})"
                merged[key] = {**e, "name": key, "files": [where]}
    return list(merged.values())


def _length(entry: dict) -> int:
    if entry["records"] is not None:
        return len({s for s, _ in entry["records"]})
    return -1


def _read_entry(entry: dict, into) -> RunDir:
    kind, where = entry["kind"], entry["where"]
    if kind == "trl":
        return read_trl_run(where, into=into)
    if kind == "verl":
        return read_verl_run(where, into=into)
    trainer = entry.get("trainer", "trl" if kind in ("printed", "notebook", "page") else None)
    return read_table_run(where, into=into, records=entry["records"], trainer=trainer)


def read_foreign(path, into) -> RunDir:
    """The foreign run at `path` (PATH#NAME for one of several) written into the empty run directory `into`."""
    return _read_chosen(path, into)[0]


def _read_chosen(path, into) -> tuple[RunDir, str]:
    base, name = split_name(path)
    entries = runs_in(base)
    if not entries:
        raise UserError(f"{base} is neither a mechdiag run directory, a TRL output_dir, a verl log, a console log "
                        "of printed TRL log dicts nor an OpenRLHF/W&B/TensorBoard/custom metrics log")
    names = [e["name"] for e in entries]
    note = ""
    if name is not None:
        chosen = [e for e in entries if e["name"] == name]
        if not chosen:
            raise UserError(f"{base} holds no run named {name!r}; it holds: {', '.join(names[:8])}")
        entry = chosen[0]
    elif len(entries) == 1:
        entry = entries[0]
    else:
        if any(e["records"] is None for e in entries):  # runs whose length only reading tells
            for e in entries:
                if e["records"] is None:
                    with tempfile.TemporaryDirectory(prefix="mechdiag-foreign-") as tmp:
                        e["length"] = len(_read_entry(e, Path(tmp) / "run").read("metrics"))
        entry = max(entries, key=lambda e: e.get("length", _length(e)))
        lengths = ", ".join(f"{e['name']} ({e.get('length', _length(e))} steps)" for e in entries[:6])
        note = (f"{base} holds {len(entries)} runs ({lengths}{', ...' if len(entries) > 6 else ''}): read the "
                f"longest, {entry['name']}; give {base}{SEP}NAME for another, or several to compare them")
    rd = _read_entry(entry, into)
    if "skipped" in entry["why"]:  # records the file holds but mechdiag could not read: never silently
        note = "; ".join(x for x in (note, f"{entry['name']}: {entry['why'].split('; ', 1)[-1]}") if x)
    read = {"run_name": entry["name"], "runs_in_source": names, **({"note": note} if note else {}),
            **({"split": entry["why"]} if entry["why"] else {})}
    same_file = [e for e in entries if e["where"] == entry["where"]]
    if entry["kind"] in TEXT_KINDS and entry["where"].is_file() and entry is same_file[-1]:
        ending = logs.log_ending(logs.read_text(entry["where"]))  # how the file's last launch ended
        if ending:
            read["ended"] = ending
    if entry.get("ended"):  # a notebook cell that raised
        read["ended"] = entry["ended"]
    rd.write_summary({**rd.summary(), "read": read})
    return rd, note


def read_any_run(path) -> Run:
    """A mechdiag run directory, or another trainer's run converted into that shape once, here at the edge. A file or
    folder holding several runs gives the longest (its summary's read.note says so; PATH#NAME picks another)."""
    base, _ = split_name(path)
    if not sources(base):
        if base.is_file():
            raise UserError(f"{path}: {NOT_A_LOG}")
        return load_run(base)
    with tempfile.TemporaryDirectory(prefix="mechdiag-foreign-") as tmp:
        rd, note = _read_chosen(path, Path(tmp) / "run")
        run = load_run(rd.path, source=rd.summary().get("source", "foreign"))
    if note:
        console.note(note)
    run.path = Path(str(path))
    return run


def read_runs(paths) -> list[Run]:
    """read_any_run of each path; several exports of one W&B run given together are read as that one run."""
    if not paths:
        raise UserError("give at least one run directory")
    groups: dict[str, list[str]] = {}
    for p in paths:
        base, name = split_name(p)
        entries = runs_in(base) if name is None and base.is_file() else []
        key = "|".join(sorted(e["name"] for e in entries)) if entries and all(
            e["kind"] == "table" and e["why"].startswith("the columns of one W&B run") for e in entries) else str(p)
        groups.setdefault(key, []).append(str(p))
    out = []
    for members in groups.values():
        if len(members) == 1:
            out.append(read_any_run(members[0]))
            continue
        with tempfile.TemporaryDirectory(prefix="mechdiag-exports-") as tmp:  # the exports side by side, as a folder
            folder = Path(tmp) / Path(members[0]).parent.name
            folder.mkdir()
            for m in members:
                (folder / Path(m).name).symlink_to(Path(m).resolve())
            run = read_any_run(folder)
        run.path = Path(members[0]).parent
        out.append(run)
    return out
