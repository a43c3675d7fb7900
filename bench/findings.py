"""The study's findings read off one run directory's own records (docs/findings.md): where the weight displacement
concentrates (module types, raw and size-normalised update mass; layers: ends vs middle, thirds) at the last
recorded step, and the activation shift by layer at each eval (does it rise in the last layers?).

    python bench/findings.py RUN    # RUN: a `mechdiag train` run directory with displacement.jsonl and shift.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag.metrics import last_step, update_mass, update_mass_size_normalised  # noqa: E402
from mechdiag.run import RunDir  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
END_LAYERS = 2  # the study's first 2 + last 2


def _shares(d: dict) -> str:
    return ", ".join(f"{k} {v:.1%}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    run = RunDir(ap.parse_args().run)
    rows = last_step(run.read("displacement"))
    if not rows:
        sys.exit(f"findings: {run.path} has no displacement records")
    raw, norm = update_mass(rows, "module"), update_mass_size_normalised(rows, "module")
    print(f"displacement at step {rows[0]['step']} ({len(rows)} tensors)")
    print(f"  module types, raw update mass: {_shares(raw)}")
    print(f"  module types, size-normalised: {_shares(norm)}")
    print(f"  attention's share: raw {sum(raw.get(m, 0) for m in ATTENTION):.1%}, "
          f"size-normalised {sum(norm.get(m, 0) for m in ATTENTION):.1%}")
    layer = update_mass(rows, "layer")
    n = len(layer)
    ends = [i for i in range(n) if i < END_LAYERS or i >= n - END_LAYERS]
    middle = [i for i in range(n) if i not in ends]
    if middle:
        ratio = (sum(layer[i] for i in ends) / len(ends)) / (sum(layer[i] for i in middle) / len(middle))
        print(f"  layers: first{END_LAYERS}+last{END_LAYERS} per layer / middle per layer = {ratio:.2f}")
    thirds = [sum(layer[i] for i in range(a * n // 3, (a + 1) * n // 3)) for a in range(3)]
    print(f"  layers by third (first, middle, last): {', '.join(f'{t:.1%}' for t in thirds)}")
    shift = run.read("shift")
    for step in sorted({r["step"] for r in shift}):
        prof = sorted((r for r in shift if r["step"] == step), key=lambda r: r["layer"])
        s = [r["shift"] for r in prof]
        inc = [r.get("increment", 0.0) for r in prof]
        top = sorted(range(len(inc)), key=lambda i: -inc[i])[:5]
        print(f"shift at eval step {step}: layer 0 {s[0]:.4f}, layer {len(s) // 2} {s[len(s) // 2]:.4f}, "
              f"last {s[-1]:.4f} (largest at layer {max(range(len(s)), key=s.__getitem__)}); the increments' "
              f"largest at layers {top}; the last 3 layers add {sum(inc[-3:]) / max(sum(inc), 1e-30):.1%} "
              f"of the increments (uniform {3 / len(inc):.1%})")


if __name__ == "__main__":
    main()
