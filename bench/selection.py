"""The study's claim, tested: does LoRA on the layers and modules mechdiag recommends beat uniform LoRA?

On the deep testbed (bundled:deep, 8 layers), each selection trains with the same config and steps on every seed:
  uniform      LoRA on every layer and module (the embedded default)
  recommended  the lora.layers / lora.target_modules that `mechdiag recommend` gives from the first seed's
               uniform run once `mechdiag attribute --save` recorded its causal evidence (only the LoRA keys are
               taken, so the selection is the one thing that differs; uniform again if no LoRA rule fires)
  random-K     layer and module sets drawn at random with the same number of trainable parameters as the
               recommended one (exactly equal when such sets exist, else the nearest)
Each final model is scored greedily on the run's held-out problems (summary.json) and on arith's two
out-of-distribution splits (ood_steps, ood_numbers): accuracy and eval reward, mean ± std over seeds, and the
number of benchmark-metric pairs on which a selection's mean beats uniform's.

    python bench/selection.py --out bench/_work/sel                  # bundled:deep, seeds 42 3407, default steps
    python bench/selection.py --model bundled --steps 2 --n-random 1 --seeds 42 --ood-n 16 \\
        --set eval_n=16 --set prompts_per_step=4 --out bench/_work/sel-tiny   # the plumbing in a few minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag import atomic  # noqa: E402
from mechdiag import config as configlib  # noqa: E402
from mechdiag.config import ALL_MODULES, parse_layers  # noqa: E402

OOD_SPLITS = ("ood_steps", "ood_numbers")
METRICS = ("accuracy", "eval_reward")


def make_cfg(args, seed: int, layers="all", modules=None, r: int | None = None) -> configlib.Config:
    over = [f"model.name_or_path={args.model}", f"seed={seed}", "save_every=0", *args.set]
    if args.steps:
        over.append(f"max_steps={args.steps}")
    cfg = configlib.load(None, over)
    data = cfg.model_dump(mode="json")
    data["lora"]["layers"] = layers
    data["lora"]["target_modules"] = list(modules or ALL_MODULES)
    if r is not None:  # alpha stays: LoRA Without Regret's fixed alpha keeps the best lr about rank-independent
        data["lora"]["r"] = r
    return configlib.from_dict(data)


def equal_params_selections(n_layers: int, per1: dict[str, int], best_layer: int) -> dict:
    """The issue's selections at the trainable parameters of all-linear rank 1 on every layer: each gets the rank
    that matches it (exactly where it divides, else the nearest)."""
    every = list(range(n_layers))
    target = lora_params(every, list(ALL_MODULES), per1)
    k = n_layers // 4 or 1
    mid = (n_layers - 2 * k) // 2
    shapes = {"all-linear r=1": (every, list(ALL_MODULES)),
              f"first{min(2, k)}+last{min(2, k)}": ([*range(min(2, k)), *range(n_layers - min(2, k), n_layers)],
                                                   list(ALL_MODULES)),
              "middle": (list(range(mid, mid + 2 * min(2, k))), list(ALL_MODULES)),
              f"one layer ({best_layer}, attribution)": ([best_layer], list(ALL_MODULES)),
              "v+o": (every, ["v_proj", "o_proj"])}
    return {name: (lay, mods, max(1, round(target / lora_params(lay, mods, per1))))
            for name, (lay, mods) in shapes.items()}


def study(args, out: Path) -> dict:
    """Selections at equal trainable parameters on every seed, beside uniform LoRA (the default rank)."""
    from mechdiag.attribute import STREAM, Attribution
    from mechdiag.metrics import causal_shares
    from mechdiag.run import RunDir

    uniform = [train_once(make_cfg(args, s), out / f"uniform-{s}") for s in args.seeds]
    if not RunDir(uniform[0]).stream(STREAM).exists():
        rows = Attribution(uniform[0]).rows("both")
        atomic.write_text(RunDir(uniform[0]).stream(STREAM), "".join(atomic.dumps(r) + "\n" for r in rows))
    shares = causal_shares([json.loads(x) for x in RunDir(uniform[0]).stream(STREAM).read_text().splitlines()],
                           "layer")
    best_layer = int(max(shares, key=shares.get))
    n_layers, per1 = site_params(args.model, 1)
    r0 = make_cfg(args, args.seeds[0]).lora.r
    sels = {"uniform": (list(range(n_layers)), list(ALL_MODULES), r0), **equal_params_selections(n_layers, per1,
                                                                                                 best_layer)}
    runs = {"uniform": uniform}
    for name, (lay, mods, r) in sels.items():
        if name != "uniform":
            slug = name.split(" ")[0].replace("+", "_").replace("=", "")
            runs[name] = [train_once(make_cfg(args, s, lay, mods, r), out / f"{slug}-{s}") for s in args.seeds]
    scores = {name: [score(r, args.ood_n) for r in rs] for name, rs in runs.items()}
    pairs = [("heldout", m) for m in METRICS] + [(s, m) for s in OOD_SPLITS for m in METRICS]
    table = []
    for name, (lay, mods, r) in sels.items():
        row = {"selection": name, "layers": lay, "modules": mods, "r": r,
               "params": lora_params(lay, mods, per1) * r}
        for b, m in pairs:
            row[f"{b}.{m}"] = mean_std([sc[(b, m)] for sc in scores[name]])
        table.append(row)
    uni = table[0]
    for row in table:
        row["pairs_improved_vs_uniform"] = sum(row[f"{b}.{m}"][0] > uni[f"{b}.{m}"][0] for b, m in pairs)
    result = {"model": args.model, "seeds": args.seeds, "steps": args.steps, "overrides": args.set, "study": True,
              "causal_layer_shares": shares, "pairs": len(pairs), "table": table, "recommend_fired": []}
    atomic.write_json(out / "selection.json", result)
    print(render(result))
    return result


def train_once(cfg, out: Path) -> Path:
    from mechdiag.train.trainer import train

    if (out / "summary.json").exists():  # resumable bench: a finished run is kept
        return out
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    train(cfg, out)
    return out


def site_params(model_name: str, r: int) -> tuple[int, dict[str, int]]:
    """(number of layers, LoRA parameters per layer for each module type) of the base model at rank r."""
    from mechdiag.models import load_model

    model = load_model(model_name)
    n = model.config.num_hidden_layers
    per = {}
    for name, mod in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if ".layers.0." in name + "." and short in ALL_MODULES:
            per[short] = r * (mod.in_features + mod.out_features)
    return n, per


def lora_params(layers: list[int], modules: list[str], per: dict[str, int]) -> int:
    return len(layers) * sum(per[m] for m in modules)


def random_selections(n_layers: int, per: dict[str, int], target: int, exclude: set, k: int, seed: int) -> list:
    """k new (layers, modules) pairs with trainable parameters equal to target (else the nearest), at random."""
    cands = []
    for nl in range(1, n_layers + 1):
        for nm in range(1, len(per) + 1):
            for mods in itertools.combinations(sorted(per), nm):
                p = nl * sum(per[m] for m in mods)
                cands.append((abs(p - target), nl, mods))
    rng = random.Random(seed)
    out = []
    for diff in sorted({c[0] for c in cands}):  # exactly equal first; the nearest counts only when those run out
        pool = [c for c in cands if c[0] == diff]
        for _ in range(1000):
            if len(out) == k:
                return out
            _, nl, mods = rng.choice(pool)
            layers = sorted(rng.sample(range(n_layers), nl))
            key = (tuple(layers), tuple(sorted(mods)))
            if key not in exclude:
                exclude.add(key)
                out.append((layers, [m for m in ALL_MODULES if m in mods]))
    return out


def score(run: Path, ood_n: int) -> dict:
    """Held-out (the run's own final eval) and OOD greedy accuracy and reward of the run's final model."""
    from mechdiag.attribute import Attribution
    from mechdiag.recorder import heldout_eval

    summary = json.loads((run / "summary.json").read_text())
    out = {("heldout", "accuracy"): summary["final_accuracy"], ("heldout", "eval_reward"): summary["final_eval_reward"]}
    att = Attribution(run)
    for split in OOD_SPLITS:
        ex = att.task.examples(split, n=ood_n, seed=0)
        prompts = [att.task.prompt(e, att.tokenizer) for e in ex]
        m, _ = heldout_eval(att.eval_model(), att.tokenizer, att.task, ex, prompts, att.cfg)
        for metric in METRICS:
            out[(split, metric)] = m[metric]
    return out


def mean_std(v: list[float]) -> tuple[float, float]:
    return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:deep")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 3407])
    ap.add_argument("--steps", type=int, default=None, help="max_steps for every run (default: the config's)")
    ap.add_argument("--n-random", type=int, default=2)
    ap.add_argument("--ood-n", type=int, default=500)
    ap.add_argument("--set", action="append", default=[], help="config override for every run (KEY=VALUE)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--study", action="store_true",
                    help="the issue-41 selections at equal trainable parameters (all-linear r=1, first2+last2, middle, "
                         "one layer by attribution, v+o) beside uniform")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.study:
        return study(args, out)

    from mechdiag.attribute import STREAM, Attribution
    from mechdiag.recommend import recommend
    from mechdiag.run import RunDir, load_run

    # 1. uniform on every seed; the first seed's run is attributed and recommended from
    runs: dict[str, list[Path]] = {"uniform": [train_once(make_cfg(args, s), out / f"uniform-{s}")
                                               for s in args.seeds]}
    first = runs["uniform"][0]
    if not RunDir(first).stream(STREAM).exists():
        rows = Attribution(first).rows("both")
        atomic.write_text(RunDir(first).stream(STREAM), "".join(atomic.dumps(r) + "\n" for r in rows))
    rec = recommend([load_run(first)])
    base_cfg = make_cfg(args, args.seeds[0])
    n_layers, per = site_params(args.model, base_cfg.lora.r)
    layers = parse_layers(rec.cfg.lora.layers, n_layers)
    modules = list(rec.cfg.lora.target_modules)
    fired = [f"{f.rule}: {f.evidence}" for f in rec.findings if f.rule in ("reduced_layers", "reduced_modules")
             and f.changes]
    selections = {"uniform": (list(range(n_layers)), list(ALL_MODULES)), "recommended": (layers, modules)}
    target = lora_params(layers, modules, per)
    exclude = {(tuple(v[0]), tuple(sorted(v[1]))) for v in selections.values()}
    for i, sel in enumerate(random_selections(n_layers, per, target, exclude, args.n_random, seed=0)):
        selections[f"random-{i + 1}"] = sel

    # 2. the other selections on every seed, same steps
    for name, (lay, mods) in selections.items():
        if name == "uniform":
            continue
        if (lay, mods) == selections["uniform"]:  # no LoRA rule fired: the recommendation is the uniform runs
            runs[name] = runs["uniform"]
            continue
        runs[name] = [train_once(make_cfg(args, s, lay, mods), out / f"{name}-{s}") for s in args.seeds]

    # 3. scores
    scores = {name: [score(r, args.ood_n) for r in rs] for name, rs in runs.items()}
    pairs = [("heldout", m) for m in METRICS] + [(s, m) for s in OOD_SPLITS for m in METRICS]
    table = []
    for name, (lay, mods) in selections.items():
        row = {"selection": name, "layers": lay, "modules": mods, "params": lora_params(lay, mods, per)}
        for b, m in pairs:
            row[f"{b}.{m}"] = mean_std([s[(b, m)] for s in scores[name]])
        table.append(row)
    uni = table[0]
    for row in table:
        row["pairs_improved_vs_uniform"] = sum(row[f"{b}.{m}"][0] > uni[f"{b}.{m}"][0] for b, m in pairs)
    result = {"model": args.model, "seeds": args.seeds, "steps": args.steps, "overrides": args.set,
              "recommend_fired": fired, "pairs": len(pairs), "table": table}
    atomic.write_json(out / "selection.json", result)
    print(render(result))
    return result


def render(result: dict) -> str:
    cols = ["heldout.accuracy", "ood_steps.accuracy", "ood_numbers.accuracy"]
    lines = ["| selection | layers | modules | r | LoRA params | " + " | ".join(cols)
             + " | pairs improved vs uniform |",
             "|---" * (len(cols) + 6) + "|"]
    for r in result["table"]:
        cells = [f"{r[c][0]:.3f} ± {r[c][1]:.3f}" for c in cols]
        lines.append(f"| {r['selection']} | {','.join(map(str, r['layers']))} | {','.join(r['modules'])} | "
                     f"{r.get('r', '')} | {r['params']:,} | " + " | ".join(cells)
                     + f" | {r['pairs_improved_vs_uniform']} of {result['pairs']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
