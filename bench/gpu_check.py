"""The GPU check behind bench/gpu_check.sh: the 0.5B-shaped model (bench/scale.py) in bf16 on one GPU.

Native trainer (sampler auto and merged) and TRL's GRPOTrainer through `--backend trl`, a few steps each at
G=8, then `mechdiag shift` (on the GPU) and `mechdiag displacement` (streams the checkpoints) on the native run's
adapter. Each trainer runs in its own process so its peak GPU memory (torch.cuda.max_memory_allocated) is its
own. Writes $OUT/gpu_check.json and $OUT/benchmarks_snippet.md (date, GPU, command) for docs/benchmarks.md.

--dry-run: the same sequence on the bundled model on the CPU, one step each (what tests/test_gpu_check.py runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale import RESULT, build, child_result  # noqa: E402


def trainer_case(name: str, backend: str, overrides: list[str], out: Path) -> dict:
    """Run in a child process: train, then report step time, tokens/s and peak memory of this process."""
    import resource

    import torch

    from mechdiag import config as C

    cfg = C.load(None, overrides)
    if backend == "native":
        from mechdiag.train.trainer import train

        run = train(cfg, out)
    else:
        from mechdiag.integrations.trl import train_trl

        run = train_trl(cfg, out)
    metrics = run.read("metrics")
    timed = metrics[1:] or metrics  # the first step pays one-time costs (kernels, allocator)
    s_step = sum(m["step_time"] for m in timed) / len(timed)
    completions = cfg.prompts_per_step * cfg.grad_accum * cfg.group_size
    tokens = sum(m["completion_length"] for m in timed) / len(timed) * completions
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    return {"case": name, "backend": backend, "steps": len(metrics), "s_per_step": s_step,
            "completion_tokens_per_s": tokens / s_step,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "displacement_steps": sorted({r["step"] for r in run.read("displacement")}),
            "memory": run.summary().get("memory")}


def cli_case(name: str, args: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mechdiag", *args], capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"{name} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return {"case": name, "wall_s": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check"))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import warnings

        warnings.filterwarnings("ignore")
        print(RESULT + json.dumps(trainer_case(args.child, args.backend, args.set, args.run)), flush=True)
        return

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        model, device, dtype, steps, gpu = "bundled", "cpu", "bfloat16", 1, "none (dry run on the CPU)"
        sizes = ["group_size=4", "prompts_per_step=2", "max_completion_tokens=16", "eval_n=4", "record.shift_n=4"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: torch sees no CUDA GPU here (use --dry-run for the CPU smoke run)")
        model = str(build(work / "qwen05b-shape"))
        device, dtype, steps, gpu = "cuda", "bfloat16", args.steps, torch.cuda.get_device_name(0)
        sizes = ["group_size=8", "prompts_per_step=8", "max_completion_tokens=128", "eval_n=64",
                 "record.shift_n=64"]
    common = [f"model.name_or_path={model}", f"model.dtype={dtype}", f"device={device}", f"max_steps={steps}",
              "beta=0.04", "save_every=0", "max_time_s=null", "record.displacement_every=2", *sizes]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cases = [("native", "native", []), ("native-merged", "native", ["sampler=merged"]),
             ("native-adapter", "native", ["sampler=adapter"]), ("trl", "trl", [])]
    rows = []
    for name, backend, extra in cases:
        cmd = [sys.executable, __file__, "--child", name, "--backend", backend, "--run", str(work / name)]
        cmd += [a for o in common + extra for a in ("--set", o)]
        rows.append(child_result(cmd, env, name))
        print(f"{name}: {rows[-1]['s_per_step']:.2f} s/step", file=sys.stderr, flush=True)
    adapter = str(work / "native" / "final")
    shift_args = ["shift", model if model != "bundled" else str(ROOT / "mechdiag/assets/arith-base"), adapter,
                  "--task", "arith", "--n", "64" if not args.dry_run else "4", "--device", device, "--dtype", dtype,
                  "--format", "json", "--out", str(work / "shift.json")]
    rows.append(cli_case("shift", shift_args, env))
    rows.append(cli_case("displacement", ["displacement", shift_args[1], adapter, "--format", "json", "--out",
                                          str(work / "displacement.json")], env))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "dry_run": args.dry_run,
              "model": "bundled" if args.dry_run else "0.5B-shaped (bench/scale.py)", "dtype": dtype,
              "steps": steps, "group_size": setting(common, "group_size"), "torch": torch.__version__, "cases": rows}
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (args.out / "benchmarks_snippet.md").write_text(snippet(result))
    print(snippet(result))


def setting(overrides: list[str], key: str) -> str:
    return [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")][-1]


def snippet(r: dict) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    lines = [f"Measured {r['date']} on {r['gpu']} (torch {r['torch']}), `bash bench/gpu_check.sh`"
             + (" --dry-run" if r["dry_run"] else "")
             + f": {r['model']}, {r['dtype']}, {r['steps']} steps, G={r['group_size']}.",
             "", "| case | s/step | completion tokens/s | peak GPU GiB | displacement at steps |",
             "| --- | --- | --- | --- | --- |"]
    for c in r["cases"]:
        if "s_per_step" in c:
            lines.append(f"| {c['case']} | {c['s_per_step']:.2f} | {c['completion_tokens_per_s']:.0f} | "
                         f"{gib(c['peak_gpu_bytes'])} | {c['displacement_steps']} |")
        else:
            lines.append(f"| {c['case']} (CLI) | wall {c['wall_s']:.1f} s | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
