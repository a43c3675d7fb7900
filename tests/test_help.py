"""Every command's --help has a full first line and an example a newcomer can paste."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mechdiag.cli import main


def test_group_help_lists_every_command_uncut():
    result = CliRunner().invoke(main, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    listing = result.output.split("Commands:")[1]
    for name, cmd in main.commands.items():
        line = next(ln for ln in listing.splitlines() if ln.strip().startswith(name + " "))
        assert cmd.short_help and line.strip().endswith(cmd.short_help), line
        assert "..." not in line and "…" not in line, line


@pytest.mark.parametrize("name", sorted(main.commands))
def test_command_help_has_an_example(name):
    result = CliRunner().invoke(main, [name, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    example = result.output.split("Example:")[1].strip().splitlines()[0]
    assert example.startswith(f"mechdiag {name} "), example
