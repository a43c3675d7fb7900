"""Evidence that the rules help: `mechdiag tune` from a deliberately poor config against random search.

For each seed, start the embedded default from a poor config (low temperature, beta 0, LoRA on every layer and
module, a 16-token completion budget where the task needs ~22) and run the outer loop for --rounds trainings.
The floor: --n-random configs drawn uniformly from the same ranges the rules can reach, each trained once with
the same steps, so the same total training budget (tune may use less when it stops early). Pass = tune's
last round beats its round 0 and the random mean, for every seed. Held-out accuracy = the final eval record
of each run (the task's eval split).

    python bench/tune.py --set save_every=0 --set max_time_s=null   # seeds 42, 3407; 3 rounds; 3 random (~17 min)
    python bench/tune.py --trainer tests.synth:sim_train --out /tmp/bt   # the loop's plumbing, in seconds
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag import atomic  # noqa: E402
from mechdiag import config as configlib  # noqa: E402
from mechdiag.config import ALL_MODULES  # noqa: E402
from mechdiag.run import final_eval, load_run  # noqa: E402
from mechdiag.tasks import reward_weights  # noqa: E402
from mechdiag.tune import DEFAULT_TRAINER, load_train_fn, tune  # noqa: E402

POOR = {"temperature": 0.4, "beta": 0.0, "max_completion_tokens": 16,
        "lora": {"layers": "all", "target_modules": list(ALL_MODULES)}}

# The ranges the rules move through from POOR (recommend.py's steps and caps), sampled uniformly.
SPACE = {
    "temperature": [0.4, 0.6, 0.8, 1.0, 1.2],
    "beta": [0.0, 0.005, 0.015, 0.045],
    "epsilon_high": [None, 0.3],
    "learning_rate": [2e-3, 1e-3],
    "max_completion_tokens": [16, 24, 40],
    "lora.layers": ["all", "first2+last2"],
    "lora.target_modules": [list(ALL_MODULES), ["v_proj", "o_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"],
                            ["gate_proj", "up_proj", "down_proj"]],
    "rewards.correctness": [2.0, 4.0, 8.0],
    "rewards.format_factor": [1.0, 0.5, 0.25],
}


def draw(rng: random.Random, base: dict, seed: int) -> configlib.Config:
    d = configlib.apply_overrides(base, [f"seed={seed}"])
    resolved = configlib.from_dict(d)
    cfg = resolved.model_dump(mode="json")
    cfg["rewards"]["weights"] = reward_weights(resolved)  # the task's weights when the config sets none
    for key, choices in SPACE.items():
        v = rng.choice(choices)
        if key == "rewards.correctness":
            cfg["rewards"]["weights"]["correctness"] = v
        elif key == "rewards.format_factor":
            cfg["rewards"]["weights"] = {k: (w if k == "correctness" else w * v)
                                         for k, w in cfg["rewards"]["weights"].items()}
        elif "." in key:
            section, sub = key.split(".")
            cfg[section][sub] = v
        else:
            cfg[key] = v
    return configlib.from_dict(cfg)


def accuracy(run_dir) -> float:
    return final_eval(load_run(run_dir)).get("accuracy", float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="42,3407")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-random", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=None, help="steps per training (default: the config's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra KEY=VALUE on POOR")
    ap.add_argument("--trainer", default=DEFAULT_TRAINER)
    ap.add_argument("--out", default="runs/bench-tune")
    args = ap.parse_args()

    train = load_train_fn(args.trainer)
    base = configlib.apply_overrides(POOR, args.overrides + ([f"max_steps={args.max_steps}"] if args.max_steps
                                                             else []))
    out = Path(args.out)
    if (out / "results.json").exists():
        print(f"{out} already holds results; choose another --out", file=sys.stderr)
        return 2
    rows, t0 = [], time.perf_counter()
    for seed in [int(s) for s in args.seeds.split(",")]:
        cfg = configlib.from_dict(configlib.apply_overrides(base, [f"seed={seed}"]))
        records = tune(cfg, args.rounds, out / f"seed-{seed}" / "tune", train,
                       log=lambda m: print(m, file=sys.stderr))
        tuned = [r.get("eval.accuracy") for r in records]
        rng = random.Random(seed)
        rand = []
        for i in range(args.n_random):
            rd = out / f"seed-{seed}" / f"random-{i}"
            train(draw(rng, base, seed), rd)
            rand.append(accuracy(rd))
        rows.append({"seed": seed, "round0": tuned[0], "tuned": tuned[-1], "rounds_trained": len(tuned),
                     "per_round": tuned, "random": rand, "random_mean": statistics.fmean(rand),
                     "beats_round0": tuned[-1] > tuned[0], "beats_random": tuned[-1] > statistics.fmean(rand),
                     "stop": records[-1].get("stop")})
    wall = time.perf_counter() - t0
    print(f"{'seed':>6} {'round 0':>8} {'tuned':>8} {'rounds':>6} {'random mean':>12} {'tuned/round0':>12} "
          f"{'tuned/random':>12}")
    for r in rows:
        print(f"{r['seed']:>6} {r['round0']:>8.4f} {r['tuned']:>8.4f} {r['rounds_trained']:>6} "
              f"{r['random_mean']:>12.4f} {r['tuned'] / max(r['round0'], 1e-9):>12.3f} "
              f"{r['tuned'] / max(r['random_mean'], 1e-9):>12.3f}")
    ok = all(r["beats_round0"] and r["beats_random"] for r in rows)
    print(f"PASS: tune beats round 0 and the random mean for every seed ({wall:.0f} s)" if ok else
          f"FAIL: tune does not beat round 0 and the random mean for every seed ({wall:.0f} s)")
    atomic.write_json(out / "results.json", {"rows": rows, "wall_s": wall, "pass": ok, "trainer": args.trainer,
                                             "argv": sys.argv[1:]})
    print(json.dumps({"pass": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
