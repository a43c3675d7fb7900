"""Report page size and build time on synthetic runs, against the floor: the inlined plotly.js bundle alone.

    .venv/bin/python bench/report_size.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plotly.offline import get_plotlyjs  # noqa: E402

from mechdiag.report import write_report  # noqa: E402
from tests.synth_runs import make_run  # noqa: E402

CASES = [  # name, steps, layers, displacement every, configs, seeds
    ("200 steps, 4 layers, 2 seeds", 200, 4, 20, 1, (42, 3407)),
    ("200 steps, 28 layers, 2 configs x 2 seeds", 200, 28, 10, 2, (42, 3407)),
    ("2000 steps, 28 layers, 2 seeds", 2000, 28, 10, 1, (42, 3407)),
]


def main():
    floor = len(get_plotlyjs().encode())
    print(f"floor: plotly.js bundle {floor / 2**20:.2f} MiB")
    print(f"{'case':45s} {'MiB':>6s} {'x floor':>8s} {'data MiB':>9s} {'build s':>8s}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, steps, layers, every, configs, seeds in CASES:
            runs = []
            for c in range(configs):
                for s in seeds:
                    over = [f"beta={0.005 * (c + 1)}"]
                    runs.append(make_run(Path(tmp) / name.replace(" ", "_") / f"cfg{c}-seed{s}", s, steps=steps,
                                         layers=layers, disp_every=every, eval_every=100, overrides=over).path)
            t = time.perf_counter()
            out = write_report(runs, Path(tmp) / "out.html")
            dt = time.perf_counter() - t
            size = out.stat().st_size
            print(f"{name:45s} {size / 2**20:6.2f} {size / floor:8.3f} {(size - floor) / 2**20:9.3f} {dt:8.2f}")


if __name__ == "__main__":
    main()
