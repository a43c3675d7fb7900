"""One recorded GRPO step at a real size: a model with Qwen2.5-0.5B's layer shapes, native trainer vs TRL.

The model: 24 Qwen2 layers, hidden 896, MLP 4864, 14 heads / 2 KV heads, the bundled tokenizer (so ~358M
parameters, almost all in the layers), random init, written once as float32 safetensors. Each case is
`mechdiag train` (native, or --backend trl) for one step in its own process, with every recorder on (metrics,
samples, displacement at the end, shift at the final eval). A process's peak RSS (ru_maxrss) is divided by the
float32 weight bytes; s/step is the step's own time from metrics.jsonl.

    python bench/scale.py [--cases native,native-merged,trl] [--model-dir DIR] [--threads 2] [--dtype float32]
        [--real-vocab]   # the full published config: 151,936-entry tokenizer built locally, tied embedding

beta is 0.04 so that both trainers run the backward on every row (a random model's rewards are all equal, and
with beta 0 mechdiag would skip them all).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
}


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


def build(folder: Path, real_vocab: bool = False, shape: dict | None = None) -> Path:
    """The 0.5B-shaped model (random init, seed 0) and the bundled tokenizer in `folder`, once; with real_vocab
    the tokenizer has Qwen2.5-0.5B's 151,936 entries and the model its full published config (tied embedding)."""
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mechdiag.models import load_tokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    load_tokenizer("bundled").save_pretrained(tmp)
    if real_vocab:
        real_vocab_tokenizer(tmp)
    tok = load_tokenizer(tmp)
    cfg = Qwen2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **(shape or SHAPE))
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, folder)
    return folder


def common(args, model_dir: Path) -> list[str]:
    return [f"model.name_or_path={model_dir}", f"model.dtype={args.dtype}", f"device={args.device}",
            "max_steps=1", f"group_size={args.group}", f"prompts_per_step={args.prompts}",
            f"max_completion_tokens={args.completion}", "max_prompt_tokens=96", "beta=0.04", "eval_n=4",
            "record.shift_n=4", "record.samples_every=1", "save_every=0", "max_time_s=null", f"threads={args.threads}"]


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

        run = train_trl(cfg, out)
    wall = time.perf_counter() - t0
    metrics = run.read("metrics")
    disp = run.read("displacement")
    return {"case": case, "s_per_step": metrics[-1]["step_time"], "wall_s": wall,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "displacement_rows": len([r for r in disp if r["step"] == 1]),
            "completion_length": metrics[-1]["completion_length"],
            "summary": run.summary()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="native,native-merged,trl")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the model is built (kept; default: a temp dir)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--real-vocab", action="store_true", help="Qwen2.5-0.5B's 151,936-entry vocabulary (tied)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import warnings

        warnings.filterwarnings("ignore")
        print(RESULT + json.dumps(child(args.child, args.set, args.out)), flush=True)
        return
    with tempfile.TemporaryDirectory() as d:
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
    print(f"0.5B-shaped model: {n_params / 1e6:.0f}M parameters, float32 weights {weights / 2**30:.2f} GiB; "
          f"G={args.group}, prompts/step={args.prompts}, max completion {args.completion}, dtype {args.dtype}, "
          f"threads {args.threads}, load avg at start {load:.1f}")
    print(f"{'case':<16} {'s/step':>7} {'wall s':>7} {'peak RSS GiB':>13} {'x weights':>10} {'disp rows':>10}")
    for r in rows:
        print(f"{r['case']:<16} {r['s_per_step']:7.1f} {r['wall_s']:7.1f} {r['peak_rss_bytes'] / 2**30:13.2f} "
              f"{r['peak_rss_bytes'] / weights:10.2f} {r['displacement_rows']:10d}")


if __name__ == "__main__":
    main()
