"""Reading benchmark records: local JSONL / JSON / .gz files, or `hf:NAME[:CONFIG]` through the `datasets` library.

A FileTask knows its default file per split (under the shared data folder), the schemas it accepts, and how one
record becomes an Example. `--path` overrides the default: a file (used for whichever split is asked), a folder
(holding the default file names), or `hf:NAME[:CONFIG]` (or a bare `owner/name` that is not a local path) for
users online.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path
from typing import Any

from mechdiag.errors import UserError, first_line
from mechdiag.paths import shared_path
from mechdiag.tasks.base import Example, Task

HUB_NAME = re.compile(r"[\w.-]+/[\w-]+(?::[\w.-]+)?")  # owner/name[:config], no file extension


def read_records(path: str | Path) -> list[dict]:
    """Records of a .jsonl / .jsonl.gz / .json file (a JSON array, or an object holding one)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"data file not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {p}: {e}") from None
    stem = p.name[:-3] if p.suffix == ".gz" else p.name
    if stem.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise UserError(f"{p}: expected a JSON array of records (or an object holding exactly one)")
            data = lists[0]
        if not isinstance(data, list):
            raise UserError(f"{p}: expected a JSON array of records")
        records = data
    else:
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{p}:{i}: not valid JSON (expected one JSON object per line)") from None
    if not records:
        raise UserError(f"{p}: no records")
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise UserError(f"{p}: record {bad + 1} is not a JSON object")
    return records


def load_hub(spec: str, split: str) -> list[dict]:
    """`hf:NAME[:CONFIG]` -> the split's records via `datasets` (for users online; never used by the tests)."""
    name, _, config = spec[3:].partition(":")
    try:
        import datasets  # noqa: PLC0415 - datasets is loaded only for hf: task paths
    except ImportError:
        raise UserError(f"--path {spec} needs the `datasets` package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # network, unknown name or split: one line for the user
        raise UserError(f"cannot load {spec} split {split!r}: {type(e).__name__}: {first_line(e)}") from None
    return [dict(r) for r in ds]


def check_schema(records: list[dict], schemas: list[tuple[str, ...]], source: str, task: str) -> tuple[str, ...]:
    """The first of `schemas` whose fields the first record has; a one-line UserError otherwise."""
    keys = set(records[0])
    for schema in schemas:
        if set(schema) <= keys:
            return schema
    want = " or ".join("{" + ", ".join(s) + "}" for s in schemas)
    raise UserError(f"{source}: not the {task} schema: expected fields {want}, found {{{', '.join(sorted(keys))}}}")


def take(examples: list[Example], n: int | None, seed: int) -> list[Example]:
    """The first n (seed 0: file order, reproducible evals) or a seeded random n (seed != 0: training draws)."""
    if seed:
        examples = list(examples)
        random.Random(seed).shuffle(examples)
    return examples if n is None else examples[:n]


class FileTask(Task):
    """A task read from files. Subclasses set `files`, `schemas`, `hub` and write `make_example`."""

    files: dict[str, tuple[str, ...]] = {}  # split -> path parts under shared/data
    schemas: list[tuple[str, ...]] = []
    hub: str = ""  # the dataset name users online can pass as --path hf:NAME
    hub_splits: dict[str, str] = {}  # our split -> the hub's split name, where they differ

    def __init__(self, path: str | None = None, **options: Any):
        self.path = path
        self.options = options
        self._cache: dict[str, list[Example]] = {}
        unknown = set(options) - set(self.option_names())
        if unknown:
            raise UserError(f"task {self.name} has no option(s) {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(self.option_names()) or 'none'}")

    def option_names(self) -> tuple[str, ...]:
        return ()

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.files)

    def source(self, split: str) -> str:
        """Where the split is read from (a file path or hf:NAME)."""
        if split not in self.splits:
            raise UserError(f"task {self.name} has splits {', '.join(self.splits)}; got {split!r}")
        if self.path is None:
            p = shared_path("data", *self.files[split])
            if not p.exists():
                hint = f" or --path hf:{self.hub}" if self.hub else ""
                raise UserError(f"task {self.name}: no data file at {p}; pass --path FILE (a local copy){hint}")
            return str(p)
        if self.path.startswith("hf:"):
            return self.path
        p = Path(self.path).expanduser()
        if not p.exists() and HUB_NAME.fullmatch(self.path):
            return "hf:" + self.path  # "owner/name[:config]" that is not a local path: a dataset name
        if p.is_dir():
            p = p / self.files[split][-1]
        if not p.is_file():
            raise UserError(f"task {self.name}: data file not found: {p}")
        return str(p)

    def records(self, split: str) -> list[dict]:
        src = self.source(split)
        if src.startswith("hf:"):
            recs = load_hub(src, self.hub_splits.get(split, split))
            if not recs:
                raise UserError(f"{src}: split {split!r} is empty")
        else:
            recs = read_records(src)
        self.schema = check_schema(recs, self.schemas, src, self.name)
        return recs

    def make_example(self, rec: dict, index: int, split: str) -> Example | None:
        raise NotImplementedError

    def all_examples(self, split: str) -> list[Example]:
        if split not in self._cache:
            src = self.source(split)
            out = []
            for i, rec in enumerate(self.records(split)):
                try:
                    ex = self.make_example(rec, i, split)
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                    raise UserError(f"{src}: record {i + 1} does not fit the {self.name} schema "
                                    f"({type(e).__name__}: {e})") from None
                if ex is not None:
                    out.append(ex)
            if not out:
                raise UserError(f"{src}: no {self.name} examples in split {split!r}")
            self._cache[split] = out
        return self._cache[split]

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        return take(self.all_examples(split), n, seed)
