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


# ---- shift -------------------------------------------------------------------------------------------------
@main.command("shift")
@click.argument("base")
@click.argument("tuned")
@click.option("--prompts", "prompts_file", help="jsonl with a \"prompt\" field, "
              "or plain text, one prompt per line")
@click.option("--task", help="probe with a registered task's prompts, formatted as in training")
@click.option("--split", default="test", show_default=True, help="task split")
@click.option("--n", "n", type=click.IntRange(min=1), help="use the first N prompts")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-length", type=click.IntRange(min=1), help="truncate prompts to this many tokens "
              "(default: the model's context)")
@click.option("--keep-bos", is_flag=True, help="count position 0 (BOS) in the norms")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, or auto")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv", "parquet"]), default="table",
              show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), help="write the rows here instead of stdout")
@click.option("--html", type=click.Path(dir_okay=False), help="also write an offline HTML figure")
def shift_cmd(base, tuned, prompts_file, task, split, n, batch_size, max_length, keep_bos, device, dtype, fmt, out,
              html):
    """Per-layer activation shift of TUNED against BASE (model folders or PEFT adapter folders)."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    from mechdiag import atomic
    from mechdiag.probes import prompts as probe_prompts
    from mechdiag.probes.shift import note, shift, write_html

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if bool(prompts_file) == bool(task):
        raise UserError("give exactly one of --prompts FILE or --task NAME")
    if fmt == "parquet" and not out:
        raise UserError("--format parquet needs --out PATH")
    if prompts_file:
        prompts = probe_prompts.read_prompts(prompts_file, n)
    else:
        from mechdiag.probes.load import load_tokenizer, resolve

        prompts = probe_prompts.task_prompts(task, load_tokenizer(resolve(base, tuned)[0].model_dir), split, n)
    df = shift(base, tuned, prompts, batch_size=batch_size, keep_bos=keep_bos, max_length=max_length, dtype=dtype,
               device=device)
    if df.attrs.get("truncated"):
        note(f"{df.attrs['truncated']} of {len(prompts)} prompts truncated to {df.attrs['max_length']} tokens")
    if html:
        write_html(df, html, title=f"Activation shift: {tuned} vs {base}")
    if fmt == "parquet":
        with atomic.atomic_path(out) as tmp:
            df.to_parquet(tmp, index=False)
        return
    if fmt == "json":
        text = atomic.dumps(df.to_dict(orient="records")) + "\n"
    elif fmt == "csv":
        text = df.to_csv(index=False)
    else:
        text = _shift_table(df)
    if out:
        atomic.write_text(out, text)
    else:
        click.echo(text, nl=False)


def _shift_table(df) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"activation shift ({int(df['n_prompts'].iloc[0])} prompts, "
                        f"output KL {df['output_kl'].iloc[0]:.4g})")
    cols = ["layer", "shift", "ci_low", "ci_high", "shift_pooled", "cos_dist", "increment", "logit_kl"]
    for c in cols:
        table.add_column(c, justify="right")
    for r in df[cols].itertuples(index=False):
        table.add_row(str(r[0]), *(f"{v:.4g}" for v in r[1:]))
    buf = io.StringIO()
    Console(file=buf, width=120).print(table)
    return buf.getvalue()
