"""Command line: thin click commands that parse, call the library, print, and map bad input to exit code 2."""

from __future__ import annotations

import sys

import click

from mechdiag.errors import UserError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as e:
            click.echo(f"mechdiag: error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("mechdiag: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mechdiag")
def main():
    """mechdiag: record, diagnose and tune GRPO fine-tuning of small language models."""


# Commands are added below, one section per command.


# ---- report ------------------------------------------------------------------------------------------------
@main.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=str))
@click.option("--out", "out", type=click.Path(dir_okay=True, path_type=str), default=None,
              help="HTML file to write (default: reports/NAME.html; a folder puts NAME.html in it).")
def report(runs, out):
    """Write one self-contained HTML report for RUN [RUN ...] (seeds of one config are pooled)."""
    from mechdiag.report import write_report

    click.echo(str(write_report(list(runs), out)))


# ---- demo --------------------------------------------------------------------------------------------------
@main.command()
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=str), default="runs/demo",
              show_default=True,
              help="Folder for the two demo runs demo-seed42/ and demo-seed3407/ (a previous demo is replaced).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="HTML report to write (default: reports/demo.html).")
@click.option("--max-steps", type=click.IntRange(min=1), default=40, show_default=True,
              help="Training steps per seed.")
def demo(out, report_path, max_steps):
    """Train the embedded default (seeds 42, 3407), diagnose, recommend, and write the report; prints its path."""
    from mechdiag.demo import run_demo

    path = run_demo(out, report_path, max_steps=max_steps, echo=lambda m: click.echo(m, err=True))
    click.echo(str(path))
