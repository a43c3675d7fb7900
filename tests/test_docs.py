"""The docs run: every command shown in docs/quickstart.md is run (in order, with small settings) and the files
it says appear do appear; every flag in README.md's command list exists in that command's --help."""

from __future__ import annotations

import re
import shlex

import pytest
from click.testing import CliRunner

from mechdiag.cli import main
from mechdiag.models import bundled_path
from mechdiag.paths import REPO_ROOT

SMALL = ["--set", "max_steps=2", "--set", "eval_n=4", "--set", "threads=1", "--set", "prompts_per_step=2",
         "--set", "group_size=2", "--set", "record.shift_n=2"]


def _shown(path) -> list[tuple[str, str]]:
    """(command, comment) for each `mechdiag ...` line of the indented code blocks."""
    out = []
    for line in (REPO_ROOT / path).read_text().splitlines():
        m = re.match(r"^ {4}(mechdiag [^#]*?)\s*(?:#\s*(.*))?$", line)
        if m:
            out.append((m.group(1), m.group(2) or ""))
    return out


def _small(argv: list[str]) -> list[str]:
    """The same command at test size: few steps, few problems, one tune round, a 4-prompt probe."""
    argv = ["--n" if a == "--n" else a for a in argv]
    if "--n" in argv:
        argv[argv.index("--n") + 1] = "4"
    if "--rounds" in argv:
        argv[argv.index("--rounds") + 1] = "1"
    cmd = argv[0]
    if cmd in ("train", "tune") and "--dry-run" not in argv:
        argv += SMALL
    if cmd == "eval":
        argv += ["--n", "2", "--max-new-tokens", "16", "--device", "cpu"]
    return argv


def _expected(argv: list[str], comment: str) -> list[str]:
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--out", "--html")]
    files += re.findall(r"\b(reports/[\w.-]+\.html|[\w-]+\.yaml)\b", comment)
    if argv[0] == "train" and "--out" in argv:
        files.append(argv[argv.index("--out") + 1] + "/summary.json")
    return files


@pytest.mark.slow
def test_quickstart_commands_run_and_make_their_files(tmp_path, stories260k, monkeypatch):
    monkeypatch.chdir(tmp_path)  # in this process (click's runner): a subprocess per command adds only imports
    subs = {"base_dir": str(bundled_path()), "tuned_dir": "runs/a/final", "adapter_dir": "runs/a/final"}
    shown = _shown("docs/quickstart.md")
    assert len(shown) >= 9, shown
    for command, comment in shown:
        argv = [subs.get(a, a) for a in shlex.split(command)[1:]]
        argv = _small(argv)
        result = CliRunner().invoke(main, argv, catch_exceptions=False)
        assert result.exit_code == 0, (command, result.stderr[-2000:])
        for f in _expected(argv, comment):
            assert (tmp_path / f).exists(), (command, f, sorted(p.name for p in tmp_path.iterdir()))


def test_readme_command_list_matches_the_cli():
    lines = [c for c, _ in _shown("README.md")]
    assert {ln.split()[1] for ln in lines} == set(main.commands), lines
    for line in lines:
        name = line.split()[1]
        help_text = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
        for flag in re.findall(r"--[a-z][a-z-]*", line):
            assert flag in help_text, (name, flag)
