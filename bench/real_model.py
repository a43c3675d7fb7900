"""GRPO on a real pretrained model on CPU: does held-out accuracy rise, on every seed, within the time a seed has?

Trains a named real model's recipe (mechdiag.demo.MODEL_RECIPES, what `mechdiag demo --model NAME` runs) on each
seed with the native trainer, and reports per seed the held-out accuracy before and after, its curve at every
eval, steps done and wall time; the claim holds when every seed starts inside --start-band and gains at least
--min-gain points. Run it under `nice -n 10` on a shared machine.

    python bench/real_model.py --out bench/_work/real                      # smollm2-135m-instruct, seeds 42 3407
    python bench/real_model.py --out bench/_work/real --control            # and each beside a random reward
    python bench/real_model.py --probe 40 --set task.options='{difficulty: 1}'   # the base's held-out accuracy only
    python bench/real_model.py --steps 2 --seeds 42 --set eval_n=8 --out bench/_work/real-tiny   # the plumbing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag import atomic  # noqa: E402
from mechdiag import config as configlib  # noqa: E402
from mechdiag.demo import MODEL_RECIPES, MODEL_STEPS  # noqa: E402


def make_cfg(args, seed: int, control: bool = False) -> configlib.Config:
    steps = args.steps or MODEL_STEPS[args.model]
    return configlib.load(None, [*MODEL_RECIPES[args.model], f"max_steps={steps}", f"seed={seed}",
                                 f"eval_every={max(1, steps // args.evals)}", f"eval_n={args.eval_n}",
                                 "save_every=0", f"max_time_s={args.minutes * 60}", "record.final_geometry=false",
                                 *args.set, *(["rewards.control=random"] if control else [])])


def probe(args) -> dict:
    """The base's greedy held-out accuracy under the recipe's prompt and budgets (the trainer's own eval pass)."""
    import torch

    from mechdiag import models, tasks
    from mechdiag.recorder import heldout_eval

    cfg = make_cfg(args, 0)
    torch.set_num_threads(cfg.threads or 2)
    model, tok = models.load_model_and_tokenizer(cfg.model.name_or_path, cfg.model.dtype)
    task = tasks.get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
    examples = task.examples(cfg.task.eval_split, n=args.probe, seed=0)
    t = time.perf_counter()
    metrics, scored = heldout_eval(model, tok, task, examples, [task.prompt(e, tok) for e in examples], cfg)
    out = {"n": len(examples), "seconds": round(time.perf_counter() - t, 1),
           **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
           "samples": [smp.text[:200] for smp, _, _ in scored[:3]]}
    print(json.dumps(out, indent=1))
    return out


def run_seed(args, seed: int, control: bool = False) -> dict:
    """One seed's run (control: the same with a random reward, rewards.control=random), trained unless done."""
    from mechdiag.run import RunDir
    from mechdiag.train.trainer import train

    out = Path(args.out) / f"{'control-' if control else ''}seed{seed}"
    if not (out / "summary.json").exists():  # resumable: a finished seed is kept
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        train(make_cfg(args, seed, control), out)
    rd = RunDir(out)
    s = rd.summary()
    curve = [(r["step"], r["accuracy"]) for r in rd.read("eval") if "accuracy" in r]
    return {"seed": seed, "steps": s["steps"], "wall_s": round(s["wall_time_s"]), "base": s["base_accuracy"],
            "final": s["final_accuracy"], "gain_points": round(100 * (s["final_accuracy"] - s["base_accuracy"]), 1),
            "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(MODEL_RECIPES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 3407])
    ap.add_argument("--steps", type=int, help="steps a seed (default: the recipe's)")
    ap.add_argument("--minutes", type=float, default=30, help="wall-time budget a seed (max_time_s)")
    ap.add_argument("--eval-n", type=int, default=100, help="held-out problems at each eval")
    ap.add_argument("--evals", type=int, default=5, help="evals along a run (the curve's points)")
    ap.add_argument("--set", action="append", default=[], help="config override over the recipe (repeatable)")
    ap.add_argument("--probe", type=int, help="only the base's held-out accuracy on this many problems")
    ap.add_argument("--start-band", type=float, nargs=2, default=[0.10, 0.60])
    ap.add_argument("--min-gain", type=float, default=10.0, help="points every seed must gain")
    ap.add_argument("--control", action="store_true",
                    help="also train each seed with a random reward (the Spurious-rewards control)")
    ap.add_argument("--out", default="bench/_work/real")
    args = ap.parse_args()
    if args.probe:
        probe(args)
        return
    rows = [run_seed(args, seed) for seed in args.seeds]
    lo, hi = args.start_band
    holds = all(lo <= r["base"] <= hi and r["gain_points"] >= args.min_gain for r in rows)
    print("| seed | steps | wall (s) | held-out before | after | gain (points) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['steps']} | {r['wall_s']} | {r['base']:.3f} | {r['final']:.3f} | "
              f"{r['gain_points']:+.1f} |")
    for r in rows:
        print(f"seed {r['seed']} curve: " + "  ".join(f"{s}:{a:.3f}" for s, a in r["curve"]))
    controls = [run_seed(args, seed, control=True) for seed in args.seeds] if args.control else []
    for r, c in zip(rows, controls, strict=False):
        r["control"] = c
        print(f"seed {r['seed']} random-reward control: {c['base']:.3f} -> {c['final']:.3f} "
              f"({c['gain_points']:+.1f} points; the reward's own gain {r['gain_points'] - c['gain_points']:+.1f}); "
              "curve " + "  ".join(f"{s}:{a:.3f}" for s, a in c["curve"]))
    print(f"claim (start in [{lo}, {hi}], gain >= {args.min_gain} points on every seed): "
          f"{'holds' if holds else 'does not hold'}")
    atomic.write_json(Path(args.out) / "real_model.json", {"model": args.model, "rows": rows, "holds": holds})


if __name__ == "__main__":
    main()
