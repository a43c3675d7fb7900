"""The GPU check behind bench/gpu_check.sh: issue 28's real shapes in bf16 on one GPU, native trainer vs TRL.

Two models, random init, the real 151,936-entry vocabulary (tokenizer built locally, bench/scale.py): Qwen2.5-0.5B's
full config and Qwen2.5-1.5B's (28 layers, hidden 1536, MLP 8960, 12/2 heads, tied embedding). At each, G=16 and
512 completion tokens, every recorder on: the native trainer, TRL's GRPOTrainer through `--backend trl`, and TRL
with vLLM colocate (use_vllm, vllm_mode="colocate") when vllm is importable, else recorded as skipped with the
reason; at 0.5B also the native trainer with the merged sampler copy, then `mechdiag shift` (on the GPU) and
`mechdiag displacement` on the native run's adapter. Each trainer case runs in its own process, so its peak GPU
memory (torch.cuda.max_memory_allocated) is its own; s/step is the mean over the steps after the first (which pays
the kernels' and the allocator's one-time costs). A budget (--budget-s) keeps the whole check inside one device
call: a case that would start past it is recorded as skipped. Writes $OUT/gpu_check.json and
$OUT/benchmarks_snippet.md (date, GPU, command, the table with the native / TRL ratios) for docs/benchmarks.md.

--dry-run: the same sequence on the CPU at tiny shapes (1-2 layers, a 4,096-entry vocabulary, G=4, 16 tokens,
one step each): what tests/test_gpu_check.py runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale import RESULT, SHAPE, build  # noqa: E402

QWEN15_SHAPE = dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                    num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6)
DRY_SHAPES = {"0.5B": {**SHAPE, "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                       "num_attention_heads": 2, "num_key_value_heads": 1},
              "1.5B": {**QWEN15_SHAPE, "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
                       "num_attention_heads": 2, "num_key_value_heads": 1}}
DRY_VOCAB = 4096
VLLM_COLOCATE = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}


def vllm_missing() -> str | None:
    """Why TRL's vLLM colocate case cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable in this environment"
    return None


def trainer_case(name: str, backend: str, overrides: list[str], out: Path, trl: dict) -> dict:
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

        run = train_trl(cfg, out, **trl)
    metrics = run.read("metrics")
    timed = metrics[1:] or metrics  # the first step pays one-time costs (kernels, allocator)
    s_step = sum(m["step_time"] for m in timed) / len(timed)
    completions = cfg.prompts_per_step * cfg.grad_accum * cfg.group_size
    tokens = sum(m["completion_length"] for m in timed) / len(timed) * completions
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    return {"case": name, "backend": backend, "steps": len(metrics), "s_per_step": s_step,
            "completion_tokens_per_s": tokens / s_step,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "displacement_steps": sorted({r["step"] for r in run.read("displacement")}),
            "memory": run.summary().get("memory")}


def run_child(cmd: list[str], env: dict, timeout: float) -> tuple[dict | None, str]:
    """A case's RESULT, or None and why not (its exit code and stderr's tail, or the timeout)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s (the check's budget)"
    line = [x for x in p.stdout.splitlines() if x.startswith(RESULT)]
    if p.returncode or not line:
        return None, f"failed ({p.returncode}): {p.stderr.strip()[-1500:]}"
    return json.loads(line[-1][len(RESULT):]), ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check"))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=510, help="start no case after this many seconds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--trl-json", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import warnings

        warnings.filterwarnings("ignore")
        row = trainer_case(args.child, args.backend, args.set, args.run, json.loads(args.trl_json))
        print(RESULT + json.dumps(row), flush=True)
        return

    import torch

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        device, steps, gpu = "cpu", 1, "none (dry run on the CPU)"
        group, completion, n_eval = 4, 16, 4
        models = {k: build(work / f"q{k}", real_vocab=DRY_VOCAB, shape=v) for k, v in DRY_SHAPES.items()}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: torch sees no CUDA GPU here (use --dry-run for the CPU smoke run)")
        device, steps, gpu = "cuda", args.steps, torch.cuda.get_device_name(0)
        group, completion, n_eval = 16, 512, 4
        models = {"0.5B": build(work / "q0.5B", real_vocab=True, dtype="bfloat16", device="cuda"),
                  "1.5B": build(work / "q1.5B", real_vocab=True, shape=QWEN15_SHAPE, dtype="bfloat16",
                                device="cuda")}
    sizes = [f"group_size={group}", "prompts_per_step=1", f"max_completion_tokens={completion}",
             "max_prompt_tokens=96", f"eval_n={n_eval}", f"record.shift_n={n_eval}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    no_vllm = vllm_missing()
    cases = []  # (model, name, backend, config overrides, GRPOConfig overrides), the most wanted first
    for m in models:
        cases += [(m, "native", "native", [], {}), (m, "trl", "trl", [], {})]
    cases += [(m, "trl-vllm", "trl", [], VLLM_COLOCATE) for m in models]
    cases += [("0.5B", "native-merged", "native", ["sampler=merged"], {})]
    rows = []
    for m, name, backend, extra, trl in cases:
        row = {"model": m, "case": name}
        left = args.budget_s - (time.perf_counter() - t_start)
        if name == "trl-vllm" and no_vllm:
            rows.append({**row, "skipped": no_vllm})
        elif left <= 0:
            rows.append({**row, "skipped": f"the check's budget of {args.budget_s:.0f} s was spent"})
        else:
            common = [f"model.name_or_path={models[m]}", "model.dtype=bfloat16", f"device={device}",
                      f"max_steps={steps}", "beta=0.04", "save_every=0", "max_time_s=null",
                      "record.displacement_every=2", *sizes, *extra]
            cmd = [sys.executable, __file__, "--child", name, "--backend", backend, "--trl-json", json.dumps(trl),
                   "--run", str(work / f"{m}-{name}")]
            cmd += [a for o in common for a in ("--set", o)]
            res, why = run_child(cmd, env, left)
            rows.append({**row, **res} if res else {**row, "skipped": why})
        r = rows[-1]
        print(f"{m} {name}: " + (f"{r['s_per_step']:.2f} s/step" if "s_per_step" in r else f"skipped: {r['skipped']}"),
              file=sys.stderr, flush=True)
    rows += cli_cases(models["0.5B"], work, device, args, env, t_start)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "dry_run": args.dry_run,
              "models": {k: str(v) for k, v in models.items()}, "dtype": "bfloat16", "steps": steps,
              "group_size": group, "completion_tokens": completion, "torch": torch.__version__,
              "wall_s": time.perf_counter() - t_start, "cases": rows}
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (args.out / "benchmarks_snippet.md").write_text(snippet(result))
    print(snippet(result))


def cli_cases(model: Path, work: Path, device: str, args, env: dict, t_start: float) -> list[dict]:
    """`mechdiag shift` and `mechdiag displacement` on the 0.5B native run's adapter (when it ran)."""
    adapter = work / "0.5B-native" / "final"
    shift = ["shift", str(model), str(adapter), "--task", "arith", "--n", "4" if args.dry_run else "64", "--device",
             device, "--dtype", "bfloat16", "--format", "json", "--out", str(work / "shift.json")]
    disp = ["displacement", str(model), str(adapter), "--format", "json", "--out", str(work / "displacement.json")]
    out = []
    for name, cli in (("shift", shift), ("displacement", disp)):
        left = args.budget_s - (time.perf_counter() - t_start)
        if not adapter.exists() or left <= 0:
            out.append({"model": "0.5B", "case": name, "skipped": "no native adapter" if not adapter.exists()
                        else f"the check's budget of {args.budget_s:.0f} s was spent"})
            continue
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "mechdiag", *cli], capture_output=True, text=True, env=env)
        if p.returncode:
            raise SystemExit(f"{name} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
        out.append({"model": "0.5B", "case": name, "wall_s": time.perf_counter() - t0})
    return out


def snippet(r: dict) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    native = {c["model"]: c for c in r["cases"] if c["case"] == "native" and "s_per_step" in c}
    lines = [f"Measured {r['date']} on {r['gpu']} (torch {r['torch']}), `bash bench/gpu_check.sh`"
             + (" --dry-run" if r["dry_run"] else "")
             + f": {r['dtype']}, G={r['group_size']}, {r['completion_tokens']} completion tokens, {r['steps']} steps "
             f"per case (s/step over those after the first), the whole check {r['wall_s']:.0f} s.",
             "", "| model | case | s/step | completion tokens/s | peak GPU GiB (allocated) | native / this peak "
             "| this / native s/step | displacement at steps |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in r["cases"]:
        n = native.get(c["model"])
        if "s_per_step" in c:
            peak = (f"{n['peak_gpu_bytes'] / c['peak_gpu_bytes']:.2f}" if n and n["peak_gpu_bytes"]
                    and c["peak_gpu_bytes"] else "-")
            speed = f"{c['s_per_step'] / n['s_per_step']:.2f}x" if n else "-"
            lines.append(f"| {c['model']} | {c['case']} | {c['s_per_step']:.2f} | {c['completion_tokens_per_s']:.0f} "
                         f"| {gib(c['peak_gpu_bytes'])} | {peak} | {speed} | {c['displacement_steps']} |")
        elif "wall_s" in c:
            lines.append(f"| {c['model']} | {c['case']} (CLI) | wall {c['wall_s']:.1f} s | | | | | |")
        else:
            lines.append(f"| {c['model']} | {c['case']} | skipped: {c['skipped'][:200]} | | | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
