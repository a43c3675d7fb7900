"""`mechdiag demo`: the main job on a fresh machine, end to end on the embedded default.

Trains the embedded default (or, with --model, a named real model's recipe: MODEL_RECIPES) twice, into
DIR/demo-seed42 and DIR/demo-seed3407 (the study's seeds), for a short
schedule with weight displacement and activation shift recorded by the trainer, asks the recommender for
findings, evaluates the base and both seeds on the held-out and out-of-distribution arith splits (`mechdiag eval`,
EVAL_N problems each, written into the first seed's run directory so the report's base-vs-tuned table is filled),
and writes one HTML report of both seeds. Budget: at most 8 minutes on a 2-core CPU.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from mechdiag import atomic, config
from mechdiag import evaluate as E
from mechdiag.errors import UserError
from mechdiag.report import advise, write_report
from mechdiag.run import group_runs, is_run_dir, load_run
from mechdiag.train.trainer import train

SEEDS = (42, 3407)
MAX_STEPS = 40
EVAL_N = 50
EVAL_TASKS = ["arith/test", "arith/ood_steps"]


# A named real model's demo: its GRPO recipe on 2 CPU cores (bench/real_model.py measures it; docs/benchmarks.md),
# and the held-out splits evaluated after. The bundled default needs none of it.
MODEL_RECIPES = {
    # SmolLM2-135M ignores the system prompt's format (0 of 40 greedy answers tagged); one worked example and the
    # answer started with <reasoning> make it answer in the format. One operation a problem (arith's steps [1, 1]):
    # it starts at 0.27-0.29 held-out, the right answer is one short line (32 tokens), and groups often hold a
    # right and a wrong one; at 1-2 operations it starts at 0.13 and 20 steps taught it the format, not the sums.
    # Temperature 0.8: samples near the greedy answer the eval reads. update_rows 8: one group per pass, its prompt
    # run once (the memory model's default split it to 1 row a pass, 71 s of update against 41 s). A step takes
    # ~22 s on 2 quiet cores and an eval with its shift ~140 s: 40 steps and 3 evals fit the 30 minutes a seed
    # (20 steps: +21 and +7 points on seeds 42 and 3407, the second still rising)
    "smollm2-135m-instruct": [
        "model.name_or_path=smollm2-135m-instruct",
        "task.options={difficulty: 1, steps: [1, 1], shots: 1, prefill: <reasoning>}",
        "group_size=8", "prompts_per_step=4", "max_completion_tokens=32", "max_prompt_tokens=256",
        "learning_rate=0.0002", "lora.r=16", "lora.alpha=32", "temperature=0.8", "beta=0.0", "update_rows=8",
        "max_time_s=1800"],
}
MODEL_STEPS = {"smollm2-135m-instruct": 40}


def demo_overrides(max_steps: int, eval_n: int = 200) -> list[str]:
    """The embedded default, shortened: evals at start, middle and end, displacement 4 times, small eval sets."""
    every = max(1, max_steps // 4)
    return [f"max_steps={max_steps}", f"eval_every={max(1, max_steps // 2)}", f"eval_n={eval_n}",
            f"record.displacement_every={every}", "record.shift_at_eval=true", "record.shift_n=32",
            f"record.samples_every={every}", f"save_every={max_steps}"]


def _fresh(path: Path) -> Path:
    """The demo owns DIR/demo-seedN: a previous demo run there is replaced, anything else is left alone."""
    if path.exists():
        if not is_run_dir(path):
            raise UserError(f"{path} exists and is not a previous demo run; pass --out to another folder")
        shutil.rmtree(path)
    return path


def evaluate_seeds(cfg, runs, n: int, echo=print) -> None:
    """`mechdiag eval` of the base and every seed (grouped as demo: mean ± std) on EVAL_TASKS, one sample per
    problem at the study's temperature, into the first run's directory."""
    settings = E.Settings(ks=[1], samples=1, n=n, max_new_tokens=cfg.max_completion_tokens, seed=0).check()
    tuned = E.parse_adapters([f"demo@{r.summary().get('seed', i)}={r.path}" for i, r in enumerate(runs)])
    benches = E.load_benchmarks(E.parse_tasks(EVAL_TASKS), settings.n)
    t = time.perf_counter()
    E.run_eval(cfg.model.name_or_path, tuned, benches, settings, runs[0].path, device="cpu",
               progress=lambda line: echo(f"eval {line}"))
    echo(f"evaluated base and {len(runs)} seeds on {', '.join(EVAL_TASKS)} (n={n}) in "
         f"{time.perf_counter() - t:.0f}s")


def run_demo(out_dir: str | Path = "runs/demo", report: str | Path | None = None, max_steps: int | None = None,
             echo=print, eval_n: int = EVAL_N, model: str = "bundled") -> Path:
    """The demo on the bundled default, or on a named real model with its recipe (MODEL_RECIPES)."""

    out_dir = Path(out_dir)
    rp = Path(report) if report is not None else None
    if rp is not None and rp.suffix.lower() not in (".html", ".htm") and rp.suffix and not rp.is_dir():
        raise UserError(f"--report must be an .html file or a folder, got {rp}")  # before minutes of training
    t0 = time.perf_counter()
    runs = []
    recipe = MODEL_RECIPES.get(model, [])
    if model != "bundled" and not recipe:
        raise UserError(f"demo --model: use bundled or {', '.join(MODEL_RECIPES)}")
    max_steps = max_steps or MODEL_STEPS.get(model, MAX_STEPS)
    for seed in SEEDS:
        cfg = config.load(None, [*recipe, *demo_overrides(max_steps, 100 if recipe else 200), f"seed={seed}"])
        run_dir = _fresh(out_dir / f"demo-seed{seed}")
        t = time.perf_counter()
        run = train(cfg, run_dir)
        runs.append(run)
        echo(f"trained seed {seed} ({run.summary().get('steps', max_steps)} of {max_steps} steps) in "
             f"{time.perf_counter() - t:.0f}s -> {run.path}")
    if eval_n:
        evaluate_seeds(cfg, runs, eval_n, echo)
    for run in runs:
        for stream in ("displacement", "shift"):
            if not run.read(stream):
                echo(f"note: {run.path.name} recorded no {stream}; the report says so")
    loaded = [load_run(r.path) for r in runs]
    advice = advise(group_runs(loaded))
    for f in advice.findings[:3]:
        echo(f"recommend: {f.change}  ({f.symptom})")
    if not advice.findings:
        echo(advice.note)
    if advice.refined_yaml:
        atomic.write_text(out_dir / "refined.yaml", advice.refined_yaml)
        echo(f"refined config -> {out_dir / 'refined.yaml'}")
    path = write_report(loaded, report if report is not None else Path("reports") / "demo.html",
                        findings=advice)
    echo(f"demo done in {time.perf_counter() - t0:.0f}s")
    return path
