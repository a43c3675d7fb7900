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


# ---- recommend ---------------------------------------------------------------------------------------------
def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*r)
    Console(width=200).print(table)


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    gain = "" if r["vs_base"] is None else f" ({r['vs_base']:+.3g})"
    return f"{r['mean']:.4g} ± {r['std']:.2g}{gain}"


@main.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out", type=click.Path(), default=None, help="Write the refined config here (YAML).")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def recommend(runs, out, fmt):
    """Diagnose RUN directories and propose a refined config, with the evidence for each change.

    Seeds of one config are pooled. Runs of several configs also get a side-by-side of held-out eval metrics
    (mean ± std over seeds, which treatment helped), and the rules read the best group. Rules and thresholds:
    docs/recommendations.md.
    """
    from mechdiag import atomic
    from mechdiag import config as configlib
    from mechdiag.compare import helped_lines
    from mechdiag.recommend import recommend as run_recommend

    rec = run_recommend(list(runs))
    if out:
        configlib.save(rec.cfg, out, rec.header)
    if fmt == "json":
        click.echo(atomic.dumps([f.record() for f in rec.findings] + rec.comparison))
        return
    if rec.comparison:
        metrics = sorted({r["metric"] for r in rec.comparison})
        groups = list(dict.fromkeys(r["group"] for r in rec.comparison))
        cell = {(r["group"], r["metric"]): r for r in rec.comparison}
        rows = []
        for g in groups:
            n = next(r["runs"] for r in rec.comparison if r["group"] == g)
            rows.append([g, str(n)] + [_cell(cell.get((g, m))) for m in metrics])
        _table("held-out eval, mean ± std over seeds (gain over the untrained model)", ["group", "runs", *metrics],
               rows)
        for line in helped_lines(rec.comparison):
            click.echo(line)
    if not rec.findings:
        click.echo("healthy: no rule fired, no change to the config" + (f" (copied to {out})" if out else ""))
        return
    _table("findings", ["rule", "symptom", "evidence", "change", "confidence"],
           [[f.rule, f.symptom, f.evidence, "; ".join(str(c) for c in f.changes) or f"none: {f.reason}",
             f"{f.confidence:.2f}"] for f in rec.findings])
    if not rec.changes:
        click.echo("no change to the config (advice only)")
    elif out:
        click.echo(f"refined config with {len(rec.changes)} change(s) written to {out}")


# ---- tune --------------------------------------------------------------------------------------------------
@main.command()
@click.argument("config_path", required=False, type=click.Path(), metavar="[CONFIG]")
@click.option("--rounds", type=int, default=3, show_default=True, help="Training rounds in all, round 0 included.")
@click.option("--out", "out", type=click.Path(), default="runs/tune", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--seed", type=int, default=None)
@click.option("--trainer", default="mechdiag.train.trainer:train", show_default=True,
              help="train(cfg, out_dir) -> RunDir to call, as package.module:function.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def tune(config_path, rounds, out, overrides, seed, trainer, fmt):
    """Train, recommend, train again with the refined config, for up to --rounds rounds.

    Stops early when no rule changes the config. OUT keeps each round's run directory, rounds.jsonl (changes and
    held-out metrics per round), best.yaml and final.yaml.
    """
    from mechdiag import atomic
    from mechdiag import config as configlib
    from mechdiag.tune import describe, load_train_fn
    from mechdiag.tune import tune as run_tune

    cfg = configlib.load(config_path, list(overrides) + ([f"seed={seed}"] if seed is not None else []))
    train_fn = load_train_fn(trainer)
    records = run_tune(cfg, rounds, out, train_fn, log=lambda m: click.echo(m, err=True))
    if fmt == "json":
        flat = [{k: (describe(v) if k in ("changes", "next_changes") else ",".join(v) if k == "rules" else v)
                 for k, v in r.items()} for r in records]
        click.echo(atomic.dumps(flat))
        return
    _table(f"tune: {out}", ["round", "changes", "accuracy", "rules fired next"],
           [[str(r["round"]), describe(r["changes"]) or "-",
             "-" if r.get("eval.accuracy") is None else f"{r['eval.accuracy']:.4g}", ", ".join(r["rules"]) or "-"]
            for r in records])
    click.echo(f"stopped: {records[-1].get('stop', '')}; configs in {out}/best.yaml and {out}/final.yaml")
