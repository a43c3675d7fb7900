"""The callback's own time per step under each engine, as a share of the training step (goal: at most 2% at the
default recording period: displacement every 10 steps and at the end, no evaluation).

Each run is two real processes (torchrun, gloo on CPU) of tests/engine_script.py in its bench mode: GRPOTrainer +
LoRA + MechdiagCallback(config=...) for STEPS steps; rank 0 reports TRL's train_runtime and the callback's
recorder_s (the wall time of its events, summary.json's figure) with its once-per-run part recorder_once_s (the
start, the end and the final step's record with its update geometry). The floor in the same run is the step
itself: per-step share = (recorder_s - recorder_once_s) / train_runtime, the goal's figure; whole-run share =
recorder_s / train_runtime, which on a short toy run is dominated by the once-per-run part. Engines alternate
within each round; medians over rounds.

    python bench/engines.py [--steps 10] [--rounds 3] [--engines ddp fsdp2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engines import ENGINES  # noqa: E402


def run_once(engine: str, steps: int) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
               "-m", "tests.engine_script", engine, str(Path(tmp) / "out"), str(steps)]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise SystemExit(f"{engine}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        info = json.loads((Path(tmp) / "out" / "ranks" / "0.json").read_text())
    recurring = info["recorder_s"] - info["recorder_once_s"]
    return {"step_s": info["train_runtime"] / steps, "per_step_s": recurring / steps,
            "share": recurring / info["train_runtime"], "once_s": info["recorder_once_s"],
            "run_share": info["recorder_s"] / info["train_runtime"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    a = ap.parse_args()
    results: dict[str, list[dict]] = {e: [] for e in a.engines}
    for r in range(a.rounds):
        order = a.engines if r % 2 == 0 else a.engines[::-1]  # alternate: drift on a shared machine evens out
        for e in order:
            results[e].append(run_once(e, a.steps))
            print(f"round {r + 1} {e}: {results[e][-1]}", file=sys.stderr, flush=True)
    print(f"medians of {a.rounds} rounds, {a.steps} steps per run")
    print("| engine | step (s) | callback per step (s) | per-step share (goal <= 2%) | once per run (s) "
          "| whole-run share |")
    print("|---|---|---|---|---|---|")
    for e, rows in results.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        print(f"| {e} | {med['step_s']:.3f} | {med['per_step_s']:.4f} | {100 * med['share']:.2f}% | "
              f"{med['once_s']:.3f} | {100 * med['run_share']:.2f}% |")


if __name__ == "__main__":
    main()
