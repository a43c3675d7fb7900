"""A Jupyter / Colab notebook (.ipynb) that ran a GRPO trainer: its saved cell outputs hold the log, as the progress
table HF's NotebookProgressCallback draws (HTML: Step | Training Loss | reward | reward_std | ...), as printed TRL log
dicts in the cell's stream, or as a custom loop's printed step lines. Each table, launch or loop is one run. A
notebook exported as a page (Markdown, HTML) keeps the table: each is one run too."""


import json
from html.parser import HTMLParser
from pathlib import Path

from mechdiag.errors import UserError
from mechdiag.integrations import logs
from mechdiag.metrics import is_number

SUFFIX = ".ipynb"
# the table's column titles -> TRL's log keys (HF titles the loss column; the rest are the logged names, with
# " / " between the parts of a reward function's key in Unsloth's tables)
TITLES = {"step": "step", "training loss": "loss", "validation loss": "eval_loss", "epoch": "epoch"}


class _Tables(HTMLParser):
    """Every <table> of an HTML fragment as rows of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:
                self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def is_notebook(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == SUFFIX


def _cells(path: Path) -> list[dict]:
    try:
        nb = json.loads(logs.read_text(path))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not a readable notebook ({e.msg} at line {e.lineno})") from None
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise UserError(f"{path}: not a notebook (no cells)")
    return [c for c in cells if isinstance(c, dict)]


def _text(x) -> str:
    return "".join(x) if isinstance(x, list) else x if isinstance(x, str) else ""


def _key(title: str) -> str:
    t = " ".join(title.split())
    return TITLES.get(t.lower(), t.replace(" / ", "/"))


def _table_records(rows: list[list[str]]) -> list[tuple[int, dict]]:
    """A progress table's rows -> [(step, {TRL key: number})]; cells HF leaves as "No log" are absent. With
    evaluation on, HF's table is the eval table: Validation Loss, then each eval metric titled ("Accuracy",
    "Reward Std"), read back as eval_<metric>."""
    head = [_key(c) for c in rows[0]]
    if "eval_loss" in head:
        head = ["eval_" + "_".join(k.lower().split()) if k[:1].isupper() else k for k in head]  # titled: eval's
    if "step" not in head:
        return []
    out = []
    for row in rows[1:]:
        cells = dict(zip(head, row, strict=False))
        try:
            step = int(float(cells.get("step", "")))
        except ValueError:
            continue
        data = {}
        for k, v in cells.items():
            if k == "step":
                continue
            try:
                x = float(v)
            except ValueError:
                continue
            if is_number(x) or x != x:  # NaN kept: a NaN loss is a finding
                data[k] = x
        if data:
            out.append((step, data))
    return out


def _html_runs(html: str, name: str, where: str) -> list[dict]:
    parser = _Tables()
    parser.feed(html)
    out = []
    for rows in parser.tables:
        recs = _table_records(rows) if rows else []
        if recs:
            out.append({"name": name, "records": recs, "why": f"the training table {where} ({len(recs)} rows, step "
                                                                "column)"})
    return out


PAGE_SUFFIXES = (".md", ".html", ".htm", ".txt", ".log", ".out")


def _tab_tables(text: str) -> list[list[list[str]]]:
    """HF's progress table as a notebook's table copies into text: a tab-separated "Step<TAB>Training Loss..."
    header and the rows under it with as many cells."""
    tables, cur = [], None
    for line in text.replace("\r", "\n").split("\n"):
        cells = [c.strip() for c in line.split("\t")]
        if len(cells) >= 2 and cells[0].lower() == "step":
            cur = [cells]
            tables.append(cur)
        elif cur is not None and len(cells) == len(cur[0]) and cells[0].isdigit():
            cur.append(cells)
        else:
            cur = None
    return [t for t in tables if len(t) > 1]


def _page_runs(text: str, name: str) -> list[dict]:
    runs = _html_runs(text, name, "of the page") if "<table" in text else []
    for rows in _tab_tables(text) if "\t" in text else []:
        recs = _table_records(rows)
        if recs:
            runs.append({"name": name, "records": recs, "why": f"the training table of the page, tab-separated "
                                                                f"({len(recs)} rows, step column)"})
    return runs


def is_page_log(path: Path) -> bool:
    """A notebook exported or copied as a page (Markdown, HTML, text) that kept HF's progress table: a <table> with
    a Step column, or the same table tab-separated."""
    if not path.is_file() or path.suffix.lower() not in PAGE_SUFFIXES:
        return False
    return bool(_page_runs(logs.read_text(path), path.name))


def page_launches(path: Path) -> list[dict]:
    """The training tables of a page (is_page_log), in order: [{"name", "records", "why"}]."""
    runs = _page_runs(logs.read_text(path), path.name)
    for i, e in enumerate(runs, start=1):
        e["name"] += f":table{i}" if len(runs) > 1 else ""
    return runs


def notebook_launches(path: Path) -> list[dict]:
    """The runs a notebook's outputs hold, in cell order: [{"name", "records", "why"}]; each training table (a
    cell's HTML output with a Step column) and each launch of printed log dicts in a cell's stream is one."""
    out = []
    cells = _cells(path)
    source = "\n".join(_text(c.get("source")) for c in cells if c.get("cell_type") == "code")
    for i, cell in enumerate(cells, start=1):
        if cell.get("cell_type") != "code":
            continue
        stream, first = [], len(out)
        error = None  # the cell raised: its runs ended in that error
        for o in cell.get("outputs") or []:
            if not isinstance(o, dict):
                continue
            if o.get("output_type") == "error":
                error = f"{o.get('ename', 'Error')}: {o.get('evalue', '')}".strip()[:300]
            if o.get("output_type") == "stream":
                stream.append(_text(o.get("text")))
            html = _text((o.get("data") or {}).get("text/html"))
            if "<table" in html:
                out += _html_runs(html, f"{path.name}:cell{i}", f"of cell {i}")
        got = logs.printed_launches_in("".join(stream), source) if stream else []
        for j, la in enumerate(got, start=1):
            name = f"{path.name}:cell{i}" + (f":launch{j}" if len(got) > 1 else "")
            out.append({"name": name, "records": la["records"], "why": f"printed log dicts of cell {i}: {la['why']}"})
        stepped = logs.step_line_records("".join(stream)) if stream and not got else []
        if stepped:  # a custom loop's own prints: its names, not TRL's
            out.append({"name": f"{path.name}:cell{i}", "records": stepped, "trainer": None,
                        "why": f"printed step lines of cell {i} (step = the step each line names)"})
        if error and len(out) > first:  # the cell's last run is the one the error stopped
            out[-1]["ended"] = {"error": error}
    names = [e["name"] for e in out]
    for e in out:  # a cell with both a table and printed dicts: tell them apart
        if names.count(e["name"]) > 1:
            e["name"] += ":table" if e["why"].startswith("the training table") else ":printed"
    return out
