"""Terminal tables fit 100 columns without cutting a number or reading values as markup; progress lines for logs."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

from click.testing import CliRunner
from rich.console import Console
from rich.text import Text

from mechdiag.cli import main
from mechdiag.console import Progress, number, progress, render_table
from mechdiag.models import bundled_path
from mechdiag.paths import REPO_ROOT
from tests.conftest import tiny_train_flags
from tests.helpers import run_cli

WIDE = ["name", "module", "shape", "ref_fro", "delta_fro", "rel_fro", "sigma_1", "stable_rank", "eff_rank",
        "changed", "sub_ulp", "mass"]


def _rows():
    return [[f"model.layers.{i}.self_attn.q_proj.weight", "q_proj", "[128, 128]", 11.31370849898476 * (i + 1),
             0.000123456789 * (i + 1), 1.0912345678e-05 / (i + 1), 0.0123456789, 3.14159265, 17.2345678, 16384,
             12, 0.3333333333] for i in range(6)]


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_wide_table_fits_100_columns_and_never_cuts_a_number():
    text = render_table("displacement", WIDE, _rows(), width=100)
    assert max(len(ln) for ln in _lines(text)) <= 100, text
    assert "…" not in text and "0.0…" not in text
    shown = [c for c in WIDE if any(c[:4] in ln for ln in _lines(text)[:4])]
    assert "ref_fro" in shown and "more column(s)" in text  # columns are dropped, not squeezed to "0.0…"
    for r in _rows():  # every shown number appears whole, at 2 to 4 significant digits
        assert any(number(r[3], d) in text for d in (4, 3, 2)), r[3]
        assert any(number(r[5], d) in text for d in (4, 3, 2)), r[5]


def test_rich_console_at_100_columns_and_markup_is_text():
    value = "lora.target_modules: [q_proj, v_proj] -> [v_proj]"
    text = render_table("findings", ["rule", "change", "confidence"], [["lora-modules", value, 0.75]], width=100)
    assert value in text  # rich markup would have eaten "[q_proj, v_proj]" and "[v_proj]"
    out = io.StringIO()
    Console(file=out, width=100).print(Text(text))
    assert max(len(ln) for ln in out.getvalue().splitlines()) <= 100
    narrow = render_table("findings", ["rule", "change", "confidence"], [["lora-modules", value, 0.75]], width=40)
    assert max(len(ln) for ln in _lines(narrow)) <= 40 and "more column(s)" in narrow  # dropped, not cut


def test_missing_text_cell_is_a_dash():
    text = render_table(None, ["part", "module"], [["layer 0", None], ["q_proj", "q_proj"]], width=100)
    assert "None" not in text and "│ layer 0 │ -      │" in text


def test_displacement_table_at_100_columns(tiny_run):
    result = CliRunner().invoke(main, ["displacement", str(bundled_path()), str(tiny_run / "final"), "--spectral"],
                                env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    lines = _lines(result.stdout)
    assert len(lines) > 10 and max(len(ln) for ln in lines) <= 100, result.stdout
    assert "…" not in result.stdout and "rel_fro" in result.stdout


def test_progress_prints_at_most_every_interval_when_not_a_terminal():
    log = io.StringIO()
    p = Progress("shift", total=8, stream=log)
    assert p.update(1) and not p.update(2) and not p.update(3)  # the second call comes well within 10 s
    assert p.update(8, "done", final=True)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("shift: 1/8") and lines[1].startswith("shift: 8/8 done")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log():
    log, tty = io.StringIO(), _Tty()
    for stream in (log, tty):
        with progress("attribute", 4, stream=stream) as update:
            for i in range(1, 5):
                update(i, "evaluations")
    assert log.getvalue().splitlines()[0].startswith("attribute: 1/4 evaluations")  # then nothing within 10 s
    assert "attribute: 1/4" not in tty.getvalue() and "4/4" in tty.getvalue()  # rich's bar, drawn to the end


def test_long_commands_print_progress_lines_into_a_log(tiny_run, tmp_path):
    """stderr is a pipe here, as under nohup or in CI: train and shift say where they are."""
    proc = run_cli("train", *tiny_train_flags("max_steps=2"), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert "train step: 1/2" in proc.stderr and "eval step 2" in proc.stderr
    prompts = tmp_path / "p.txt"
    prompts.write_text("1 + 1 =\n2 + 3 =\n")
    proc = run_cli("shift", str(bundled_path()), str(tiny_run / "final"), "--prompts", str(prompts), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "shift prompts: 2/2" in proc.stderr and proc.stdout.startswith("[")
    proc = run_cli("eval", str(bundled_path()), "--task", "arith", "--n", "3", "--k", "1", "--max-new-tokens", "8",
                   "--device", "cpu", "--out", str(tmp_path / "eval"))
    assert proc.returncode == 0, proc.stderr
    assert "eval arith/test base: 3/3 problems" in proc.stderr


def test_train_draws_the_one_meter_on_a_terminal(tmp_path):
    """stderr is a terminal (a pty): train's progress is console.Progress's bar, the live note beside it, and no log
    lines (the same switch as displacement and attribute)."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "140", "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "mechdiag", "train", *tiny_train_flags("max_steps=2"), "--out",
                             str(tmp_path / "run")], stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=600) == 0, out[-2000:]
    text = out.decode(errors="replace")
    assert "train step" in text and "2/2" in text and "reward" in text and "acc" in text, text[-2000:]
    assert "train step: 1/2" not in text and "eval step 2" not in text  # the log lines are for pipes only
