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


# ---- train ---------------------------------------------------------------------------------------------------
@main.command("train")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field (repeatable).")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default runs/<timestamp>).")
@click.option("--resume", type=click.Path(file_okay=False), help="Continue the run in DIR from its last checkpoint.")
@click.option("--seed", type=int, help="Shorthand for --set seed=N.")
@click.option("--max-steps", type=int, help="Shorthand for --set max_steps=N.")
@click.option("--dry-run", is_flag=True, help="Validate, print the resolved config and the modules LoRA will train.")
def train_cmd(config, overrides, out, resume, seed, max_steps, dry_run):
    """GRPO fine-tuning with the recorder on (no arguments: the embedded arith default, about 5 minutes)."""
    from pathlib import Path

    from mechdiag import config as C

    overrides = list(overrides)
    if seed is not None:
        overrides.append(f"seed={seed}")
    if max_steps is not None:
        overrides.append(f"max_steps={max_steps}")
    if resume:
        if config or out:
            raise UserError("--resume DIR takes the config and output directory of that run; drop CONFIG/--out")
        cfg_path = Path(resume) / "config.yaml"
        if not cfg_path.is_file():
            raise UserError(f"--resume {resume}: no config.yaml there (not a mechdiag run directory)")
        cfg = C.load(cfg_path, overrides)
    else:
        cfg = C.load(config, overrides)
    if dry_run:
        from mechdiag.train.lora import lora_modules, trainable_parameters
        from mechdiag.train.trainer import prepare_model

        click.echo(C.to_yaml(cfg), nl=False)
        model, _, _ = prepare_model(cfg)
        if cfg.lora.enabled:
            rows = lora_modules(model)
            click.echo(f"# LoRA trains {len(rows)} modules, {trainable_parameters(model)} parameters:")
            for r in rows:
                click.echo(f"#   {r['name']}  ({r['in']} -> {r['out']}, {r['params']} params)")
        else:
            click.echo(f"# full fine-tuning: {trainable_parameters(model)} parameters")
        return
    import time

    from mechdiag.train.trainer import train

    run_dir = resume or out or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    run = train(cfg, run_dir, resume=bool(resume))
    s = run.summary()
    click.echo(f"base accuracy {s['base_accuracy']:.3f} -> final {s['final_accuracy']:.3f} "
               f"({100 * s['accuracy_gain']:+.1f} points) in {s['wall_time_s']:.0f} s; run: {run.path}")
