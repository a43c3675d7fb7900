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
        model = prepare_model(cfg)[0]
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


# ---- eval ----------------------------------------------------------------------------------------------------
def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers such as 1,3,5; got {text!r}") from None


@main.command("eval")
@click.argument("model")
@click.option("--adapter", "adapters", multiple=True, metavar="[LABEL=]DIR",
              help="A PEFT adapter folder, a run directory (its final/) or a full fine-tuned model (repeatable). "
                   "Labels NAME@X (e.g. grpo@42, grpo@3407) are grouped into NAME: mean ± std.")
@click.option("--group", metavar="NAME", help="Group every adapter whose label has no '@' under NAME (seeds).")
@click.option("--task", "task_specs", multiple=True, required=True, metavar="NAME[/SPLIT]",
              help="Benchmark(s): repeatable or comma-separated, e.g. gsm8k,arith/ood_steps.")
@click.option("--split", "splits", multiple=True, help="Split(s) for tasks given without /SPLIT (default: test).")
@click.option("--path", help="Data for the (single) task: a file, a folder, or a dataset name (hf:NAME[:CONFIG]).")
@click.option("--option", "task_options", multiple=True, metavar="KEY=VALUE", help="Task option (repeatable).")
@click.option("--n", type=int, help="Problems per benchmark: the first N in file order (default: all).")
@click.option("--k", "ks", default="1,3,5", show_default=True, help="pass@k / maj@k values.")
@click.option("--samples", type=int, help="Sampled completions per problem (default: the largest k).")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="Sampling temperature.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--max-prompt-tokens", type=int, help="Keep the last N prompt tokens (default: what fits the model).")
@click.option("--batch-size", type=int, default=64, show_default=True, help="Sequences per forward pass.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (the same for every model).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--threads", type=int, help="torch threads.")
@click.option("--device", default="auto", show_default=True, help="auto (the GPU if any), cpu, cuda, cuda:N, mps.")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory to write (default runs/eval-<time>).")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
def eval_cmd(model, adapters, group, task_specs, splits, path, task_options, n, ks, samples, temperature, top_p,
             max_new_tokens, max_prompt_tokens, batch_size, seed, dtype, threads, device, out, fmt):
    """Base vs tuned on benchmarks: accuracy, pass@k, maj@k, format, length; the study's comparison table."""
    import time
    from pathlib import Path

    import yaml
    from transformers.utils import logging as hf_logging

    from mechdiag import evaluate as E

    hf_logging.set_verbosity_error()  # "sequence longer than the maximum": prompts are cut to fit before the model
    options = {}
    for item in task_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--option takes KEY=VALUE, got {item!r}")
        options[key] = yaml.safe_load(value)
    settings = E.Settings(ks=_ints(ks, "--k"), samples=samples, temperature=temperature, top_p=top_p,
                          max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
                          seed=seed, n=n).check()
    E.set_threads(threads)
    tuned = E.parse_adapters(adapters, group)
    benches = E.load_benchmarks(E.parse_tasks(task_specs, splits), settings.n, path, options)
    out_dir = out or str(Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S"))
    res = E.run_eval(model, tuned, benches, settings, out_dir, dtype=dtype, device=device,
                     progress=lambda line: click.echo(line, err=True))
    if fmt == "table":
        click.echo(E.render_table(res.rows, color=sys.stdout.isatty()))
    elif fmt == "json":
        from mechdiag.atomic import dumps

        click.echo(dumps(res.rows))
    else:
        import csv
        import io

        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(res.rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in res.rows)
        click.echo(buf.getvalue(), nl=False)
    click.echo(f"run: {res.out_dir} (eval_benchmarks.jsonl, eval_models.jsonl, eval_samples.jsonl)", err=True)
