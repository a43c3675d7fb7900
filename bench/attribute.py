"""Cost of `mechdiag attribute`: one part (its *_without and *_only evaluations, output KL included, toggling
in place) against one plain evaluation of the tuned model (the trainer's greedy eval, what final_accuracy cost).

Rounds alternate plain and part (cycling through the parts) in one process with one model in memory; medians
over the rounds, and their ratio (the floor is 2: a part needs two evaluations).

    python bench/attribute.py RUN [--rounds 5] [--by both] [--n N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag.attribute import Attribution  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--by", default="both", choices=["layer", "module", "both"])
    ap.add_argument("--n", type=int, default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    att = Attribution(args.run, n=args.n)
    t_load = time.perf_counter() - t0
    parts = att.parts(args.by)
    everything = list(att.sites)
    att.keep(everything)
    att.evaluate()  # the tuned model's completions and log-probs (the KL reference); warms up too
    plain, part = [], []
    for i in range(args.rounds):
        att.keep(everything)
        t = time.perf_counter()
        att.evaluate(kl=False)
        plain.append(time.perf_counter() - t)
        p = parts[i % len(parts)]
        t = time.perf_counter()
        att.keep([n for n in everything if n not in set(p.names)])
        att.evaluate()
        att.keep(p.names)
        att.evaluate()
        part.append(time.perf_counter() - t)
    att.keep(everything)
    out = {"run": args.run, "n_problems": len(att.examples), "parts": len(parts), "rounds": args.rounds,
           "load_s": round(t_load, 2), "plain_eval_s": round(statistics.median(plain), 3),
           "per_part_s": round(statistics.median(part), 3),
           "part_over_eval": round(statistics.median(part) / statistics.median(plain), 2),
           "whole_command_evals": att.n_evals(args.by)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
