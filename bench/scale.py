"""One recorded GRPO step at a real size: a model with Qwen2.5-0.5B's layer shapes, native trainer vs TRL.

The model: 24 Qwen2 layers, hidden 896, MLP 4864, 14 heads / 2 KV heads, the bundled tokenizer (so ~358M
parameters, almost all in the layers), random init, written once as float32 safetensors. Each case is
`mechdiag train` (native, or --backend trl) for one step in its own process, with every recorder on (metrics,
samples, displacement at the end, shift at the final eval). A process's peak RSS (ru_maxrss) is divided by the
float32 weight bytes; s/step is the step's own time from metrics.jsonl.

    python bench/scale.py [--cases native,native-merged,trl] [--model-dir DIR] [--threads 2] [--dtype float32]
        [--real-vocab]   # the full published config: 151,936-entry tokenizer built locally, tied embedding

The real-shape grid (issue 28): completion 256 and 512 x G 8 and 16, each case under a memory cap (a cgroup
child; a case the cap kills is recorded as OOM and not retried at that shape or a larger one), the cases
alternating within each round and the order reversed every other round; one JSON line per case run in --log,
then the table of medians:

    python bench/scale.py --real-vocab --grid --rounds 2 --cap 10G --model-dir bench/_work/q05-real \
        --log bench/_work/grid.jsonl
    python bench/scale.py --table bench/_work/grid.jsonl   # the table again from the log

A random model never emits EOS at a real vocabulary, so every completion runs to the budget, where neither
trainer can skip anything. `--stops MEAN` runs on a copy whose completions stop (with_stops: only the EOS row of
the head changes, a per-token EOS probability of 1/MEAN at the model's own samples), built beside --model-dir
as DIR-stopMEAN:

    python bench/scale.py --real-vocab --stops 150 --grid --rounds 1 --cap 10G --model-dir bench/_work/q05-real \
        --log bench/_work/grid-stop.jsonl

beta is 0.04 so that both trainers run the backward on every row (a random model's rewards are all equal, and
with beta 0 mechdiag would skip them all).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=1e6)
RESULT = "RESULT "  # a child process's last word: this prefix, then its result as JSON


def child_result(cmd: list[str], env: dict, name: str) -> dict:
    """Run one benchmark case in its own process (its peak memory is its own) and return its RESULT line."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith(RESULT)]
    if p.returncode or not line:
        sys.exit(f"{name} failed ({p.returncode}):\n{p.stderr.strip()[-3000:]}")
    return json.loads(line[-1][len(RESULT):])


CASES = {  # name -> (backend, config overrides)
    "native": ("native", []),
    "native-adapter": ("native", ["sampler=adapter"]),
    "native-merged": ("native", ["sampler=merged"]),
    "native-gc": ("native", ["gradient_checkpointing=true"]),
    "trl": ("trl", []),
    "trl-rows": ("trl", []),  # TRL in one-row micro-batches (trl_overrides): the native row passes' idea
}


def trl_overrides(case: str, group: int) -> dict:
    """GRPOConfig overrides of a case: trl-rows runs the same G completions as G one-row micro-batches of one
    optimizer step (one generation per step), TRL's own way of trading time for memory."""
    if case != "trl-rows":
        return {}
    return {"per_device_train_batch_size": 1, "gradient_accumulation_steps": group, "steps_per_generation": group}


QWEN_VOCAB = 151_936  # Qwen2.5-0.5B's published vocab_size (its tied embedding's rows)


def real_vocab_tokenizer(folder: Path, n_vocab: int = QWEN_VOCAB) -> None:
    """Rewrite the tokenizer saved in `folder` (the bundled WordLevel one) to n_vocab entries, built locally with
    the tokenizers library: the bundled words keep their ids, filler words take the rest, so the model's
    vocabulary-wide tensors have the real width while prompts tokenize as before."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    spec = json.loads(Tokenizer.from_file(str(path)).to_str())
    words = spec["model"]["vocab"]
    taken = set(words.values()) | {t["id"] for t in spec.get("added_tokens", [])}
    free = (i for i in range(n_vocab) if i not in taken)
    for k, i in zip(range(n_vocab - len(taken)), free, strict=False):
        words[f"w{k}"] = i
    Tokenizer.from_str(json.dumps(spec)).save(str(path))


def build(folder: Path, real_vocab: bool | int = False, shape: dict | None = None, dtype: str = "float32",
          device: str = "cpu") -> Path:
    """The 0.5B-shaped model (random init, seed 0) and the bundled tokenizer in `folder`, once; with real_vocab
    the tokenizer has Qwen2.5-0.5B's 151,936 entries (or real_vocab entries, an int) and the model its full
    published config (tied embedding). dtype: the saved weights'; device: where the init runs (a GPU's is fast)."""
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mechdiag.models import load_tokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    load_tokenizer("bundled").save_pretrained(tmp)
    if real_vocab:
        real_vocab_tokenizer(tmp, QWEN_VOCAB if real_vocab is True else int(real_vocab))
    tok = load_tokenizer(tmp)
    cfg = Qwen2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **(shape or SHAPE))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    os.replace(tmp, folder)
    return folder


def with_stops(src: Path, folder: Path, mean_tokens: float, prompts: int = 4, probe_tokens: int = 96) -> Path:
    """A copy of the model in `src` whose completions stop: its EOS row of the (tied) output head is set to
    beta * n, n the unit mean of the final hidden states at sampled completion positions, with beta found by
    bisection so that the mean per-token EOS probability there is 1 / mean_tokens (lengths then spread about
    like a constant hazard's: geometric, mean ~ mean_tokens, some rows running to the budget). The hidden states
    are those of the model's own samples from the bench task's train prompts; no other weight changes."""
    if (folder / "model.safetensors").exists():
        return folder
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from mechdiag.generate import sample_tokens
    from mechdiag.models import encode_prompts, eos_ids, load_tokenizer
    from mechdiag.tasks import get_task

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = load_tokenizer(src)
    eos = eos_ids(model, tok)[0]
    task = get_task("arith")
    ids, mask = encode_prompts(tok, [task.prompt(e, tok) for e in task.examples("train", prompts)], 96)
    gen = torch.Generator().manual_seed(0)
    c, cm, _ = sample_tokens(model, ids, mask, max_new_tokens=probe_tokens, eos=[eos], pad=tok.pad_token_id,
                             temperature=1.0, gen=gen, repeat=2)
    with torch.inference_mode():
        full = torch.cat([ids.repeat_interleave(2, 0), c], 1)
        am = torch.cat([mask.repeat_interleave(2, 0), cm], 1)
        h = model.model(input_ids=full, attention_mask=am).last_hidden_state[:, ids.size(1) - 1:-1]
        h = h[cm.bool()].double()  # the positions that predict a completion token
        w = model.lm_head.weight.double()
        z = h @ w.T
        z[:, eos] = -torch.inf
        rest = torch.logsumexp(z, -1)  # every other token's mass, unchanged by the EOS row
        del z
        n = h.mean(0) / h.mean(0).norm()
        proj = h @ n
        hazard = lambda b: torch.sigmoid(b * proj - rest).mean().item()  # noqa: E731
        lo, hi = 0.0, 1.0
        while hazard(hi) < 1 / mean_tokens:
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if hazard(mid) < 1 / mean_tokens else (lo, mid)
        model.lm_head.weight[eos] = (hi * n).to(model.lm_head.weight.dtype)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "STOPS.json").write_text(json.dumps({"src": str(src), "mean_tokens": mean_tokens, "beta": hi,
                                                "probe_positions": int(h.size(0))}))
    os.replace(tmp, folder)
    return folder


def common(args, model_dir: Path) -> list[str]:
    return [f"model.name_or_path={model_dir}", f"model.dtype={args.dtype}", f"device={args.device}",
            "max_steps=1", f"group_size={args.group}", f"prompts_per_step={args.prompts}",
            f"max_completion_tokens={args.completion}", f"max_prompt_tokens={args.prompt_tokens}", "beta=0.04",
            "eval_n=4", "record.shift_n=4", "record.samples_every=1", "save_every=0", "max_time_s=null",
            f"threads={args.threads}"]


def child(case: str, overrides: list[str], out: Path) -> dict:
    """Run one case in this process and return its figures (called in a fresh interpreter per case)."""
    from mechdiag import config as C

    backend, extra = CASES[case]
    cfg = C.load(None, overrides + extra)
    t0 = time.perf_counter()
    if backend == "native":
        from mechdiag.train.trainer import train

        run = train(cfg, out)
    else:
        from mechdiag.integrations.trl import train_trl

        run = train_trl(cfg, out, **trl_overrides(case, cfg.group_size))
    wall = time.perf_counter() - t0
    metrics = run.read("metrics")
    disp = run.read("displacement")
    return {"case": case, "s_per_step": metrics[-1]["step_time"], "wall_s": wall,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "displacement_rows": len([r for r in disp if r["step"] == 1]),
            "completion_length": metrics[-1]["completion_length"],
            "summary": run.summary()}


# ---- the real-shape grid under a memory cap ------------------------------------------------------------------
GRID = [(256, 8), (256, 16), (512, 8), (512, 16)]  # (max completion tokens, G)


def parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


class MemoryCap:
    """A memory cgroup child capped at `limit` bytes with no swap (cgroup v2, else v1), which child processes
    join before they exec; oom_kills() counts the kernel's kills in it so far."""

    def __init__(self, limit: int, name: str = "mechdiag-bench"):
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text():
            self.dir, files = v2 / name, {"memory.max": limit, "memory.swap.max": 0}
            self.events, self.key = self.dir / "memory.events", "oom_kill"
        else:
            self.dir = v2 / "memory" / name
            files = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
            self.events, self.key = self.dir / "memory.oom_control", "oom_kill"
            now = self.dir / "memory.limit_in_bytes"
            if now.exists() and limit > int(now.read_text()):  # v1 keeps memsw >= the limit: raise memsw first
                files = dict(reversed(files.items()))
        self.dir.mkdir(exist_ok=True)
        for f, v in files.items():
            if (self.dir / f).exists():
                (self.dir / f).write_text(str(v))
        self.limit = limit

    def join(self) -> None:  # a Popen preexec_fn: runs in the child before exec
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        for line in self.events.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == self.key:
                return int(v)
        return 0


def grid_case(args, model_dir: Path, case: str, completion: int, group: int, work: Path, cap: MemoryCap | None):
    """One case at one shape in its own capped process: its RESULT figures, or {"oom": True}."""
    a = argparse.Namespace(**{**vars(args), "completion": completion, "group": group})
    cmd = [sys.executable, __file__, "--child", case, "--out", str(work / f"{case}-{completion}-{group}")]
    cmd += [x for o in common(a, model_dir) for x in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    before = cap.oom_kills() if cap else 0
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=cap.join if cap else None)
    row = {"case": case, "completion": completion, "group": group, "start": t0, "load": os.getloadavg()[0]}
    line = [x for x in p.stdout.splitlines() if x.startswith(RESULT)]
    if cap and (cap.oom_kills() > before or p.returncode == -9):
        return {**row, "oom": True, "cap_bytes": cap.limit}
    if p.returncode or not line:
        sys.exit(f"{case} {completion}x{group} failed ({p.returncode}):\n{p.stderr.strip()[-3000:]}")
    r = json.loads(line[-1][len(RESULT):])
    return {**row, "oom": False, "s_per_step": r["s_per_step"], "peak_rss_bytes": r["peak_rss_bytes"],
            "memory": r["summary"].get("memory"), "completion_length": r["completion_length"]}


def run_grid(args, model_dir: Path, work: Path) -> None:
    cap = MemoryCap(parse_bytes(args.cap), args.cgroup) if args.cap else None
    cases = args.cases.split(",")
    oom: dict[str, list] = {c: [] for c in cases}  # shapes a case was killed at: larger ones are not retried
    shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")] if args.shapes else GRID
    for rnd in range(args.rounds):
        for completion, group in shapes:
            for case in cases if rnd % 2 == 0 else cases[::-1]:
                if any(completion >= c and group >= g for c, g in oom[case]):
                    continue
                row = {**grid_case(args, model_dir, case, completion, group, work, cap), "round": rnd}
                with open(args.log, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if row["oom"]:
                    oom[case].append((completion, group))
                print(f"round {rnd} {case} {completion}x{group}: " + ("OOM" if row["oom"] else
                      f"{row['s_per_step']:.1f} s/step, peak {row['peak_rss_bytes'] / 2**30:.2f} GiB"),
                      file=sys.stderr, flush=True)


def table(log: Path, weights: int | None = None, trl: str = "trl") -> str:
    """The grid's table from its log: medians per case and shape, native beside TRL (case `trl`), with the
    ratios; the model prediction is the native runs' summary.json memory.predicted_peak_bytes."""
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    out = ["| shape (completion x G) | native peak GiB | model prediction GiB | TRL peak GiB | ratio (native / TRL) "
           "| native s/step | TRL s/step | speed ratio (TRL / native) | mean completion tokens (native, TRL) "
           "| rounds (native, TRL) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for completion, group in GRID:
        got = {c: [r for r in rows if r["case"] == c and r["completion"] == completion and r["group"] == group]
               for c in ("native", trl)}
        if not got["native"] and not got[trl]:
            out.append(f"| {completion} x {group} | not run | | not run | | | | | | 0, 0 |")
            continue
        fig = {}
        for c, rs in got.items():
            ok = [r for r in rs if not r["oom"]]
            cap = next((r["cap_bytes"] for r in rs if r["oom"]), None)
            fig[c] = (statistics.median(r["peak_rss_bytes"] for r in ok) if ok else None,
                      statistics.median(r["s_per_step"] for r in ok) if ok else None, cap, len(ok),
                      f"{statistics.median(r['completion_length'] for r in ok):.0f}" if ok else "-")
        (n_peak, n_s, n_cap, n_k, n_len), (t_peak, t_s, t_cap, t_k, t_len) = fig["native"], fig[trl]
        pred = [r["memory"]["predicted_peak_bytes"] for r in got["native"]
                if not r["oom"] and "predicted_peak_bytes" in (r.get("memory") or {})]
        pred = statistics.median(pred) if pred else None
        t_peak_s = gib(t_peak) if t_peak else (f"> {gib(t_cap)} (OOM)" if t_cap else "-")
        n_peak_s = gib(n_peak) if n_peak else (f"> {gib(n_cap)} (OOM)" if n_cap else "-")
        ratio = (f"{n_peak / t_peak:.2f}" if n_peak and t_peak else
                 f"< {n_peak / t_cap:.2f}" if n_peak and t_cap else "-")
        speed = f"{t_s / n_s:.2f}x" if n_s and t_s else "-"
        x_w = f" ({n_peak / weights:.2f}x weights)" if weights and n_peak else ""
        out.append(f"| {completion} x {group} | {n_peak_s}{x_w} | {gib(pred) if pred else '-'} | {t_peak_s} | "
                   f"{ratio} | {f'{n_s:.1f}' if n_s else '-'} | {f'{t_s:.1f}' if t_s else '-'} | {speed} | "
                   f"{n_len}, {t_len} | {n_k}, {t_k} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="native,native-merged,trl")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the model is built (kept; default: a temp dir)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=96, help="max_prompt_tokens (a chat template needs more)")
    ap.add_argument("--real-vocab", action="store_true", help="Qwen2.5-0.5B's 151,936-entry vocabulary (tied)")
    ap.add_argument("--stops", type=float, default=None,
                    help="run on a copy whose completions stop: mean EOS wait in tokens (with_stops)")
    ap.add_argument("--model", default=None,
                    help="a real model in place of the built 0.5B shape: a name (smollm2-135m-instruct, gemma3-270m), "
                         "a .gguf file or a folder; its converted folder is used as it is")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--grid", action="store_true", help="completion 256/512 x G 8/16, rounds, medians")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default=None, help="the grid's shapes in order, e.g. 256x8,512x16 (default all)")
    ap.add_argument("--cap", default=None, help="memory cap per case, e.g. 10G (a cgroup child; needs root)")
    ap.add_argument("--cgroup", default="mechdiag-bench", help="the cap's cgroup (one per grid run at once)")
    ap.add_argument("--log", type=Path, default=None, help="the grid's JSON lines (appended)")
    ap.add_argument("--table", type=Path, default=None, help="print the grid's table from this log and stop")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        weights = (args.model_dir / "model.safetensors").stat().st_size if args.model_dir else None
        for trl in ("trl", "trl-rows"):
            print(f"TRL case {trl}:\n" + table(args.table, weights, trl))
        return
    if args.grid:
        if not args.log:
            sys.exit("scale.py: --grid needs --log FILE")
        with tempfile.TemporaryDirectory() as d:
            model_dir = build(args.model_dir or Path(d) / "qwen05b-shape", real_vocab=args.real_vocab)
            if args.stops:
                model_dir = with_stops(model_dir, model_dir.with_name(f"{model_dir.name}-stop{args.stops:g}"),
                                       args.stops)
            cases = "native,trl" if args.cases == ap.get_default("cases") else args.cases
            run_grid(argparse.Namespace(**{**vars(args), "cases": cases}), model_dir, Path(d))
        weights = (model_dir / "model.safetensors").stat().st_size if args.model_dir else None
        for trl in [c for c in cases.split(",") if c.startswith("trl")]:
            print(f"TRL case {trl}:\n" + table(args.log, weights, trl))
        return
    if args.child:
        import warnings

        warnings.filterwarnings("ignore")
        print(RESULT + json.dumps(child(args.child, args.set, args.out)), flush=True)
        return
    with tempfile.TemporaryDirectory() as d:
        if args.model:
            from mechdiag import models

            model_dir = models.checkpoint_folder(args.model)
        else:
            model_dir = build(args.model_dir or Path(d) / "qwen05b-shape", real_vocab=args.real_vocab)
        weights = (model_dir / "model.safetensors").stat().st_size
        n_params = weights // 4
        load = os.getloadavg()[0]
        rows = []
        for case in args.cases.split(","):
            cmd = [sys.executable, __file__, "--child", case, "--out", str(Path(d) / case)]
            cmd += [a for o in common(args, model_dir) for a in ("--set", o)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
            r = child_result(cmd, env, case)
            rows.append(r)
            print(f"{case}: {r['s_per_step']:.1f} s/step, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB = "
                  f"{r['peak_rss_bytes'] / weights:.2f}x weights", file=sys.stderr, flush=True)
    print(f"{args.model or '0.5B-shaped model'}: {n_params / 1e6:.0f}M parameters, float32 weights "
          f"{weights / 2**30:.2f} GiB; "
          f"G={args.group}, prompts/step={args.prompts}, max completion {args.completion}, dtype {args.dtype}, "
          f"threads {args.threads}, load avg at start {load:.1f}")
    print(f"{'case':<16} {'s/step':>7} {'wall s':>7} {'peak RSS GiB':>13} {'x weights':>10} {'predicted GiB':>14} "
          f"{'disp rows':>10} {'length':>7}")
    for r in rows:
        pred = (r["summary"].get("memory") or {}).get("predicted_peak_bytes")  # the native trainer's memory model
        print(f"{r['case']:<16} {r['s_per_step']:7.1f} {r['wall_s']:7.1f} {r['peak_rss_bytes'] / 2**30:13.2f} "
              f"{r['peak_rss_bytes'] / weights:10.2f} {pred / 2**30 if pred else float('nan'):14.2f} "
              f"{r['displacement_rows']:10d} {r['completion_length']:7.1f}")


if __name__ == "__main__":
    main()
