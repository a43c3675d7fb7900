"""Rollout speed of the bundled arith base vs the stories260K peer (a real tiny Llama) on the same prompts.

One GRPO-sized batch: 16 arith prompts x 8 samples, temperature 1, up to 40 new tokens, KV cache, 1 thread.

    python bench/base_generate.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag.models import load_model_and_tokenizer  # noqa: E402
from mechdiag.paths import shared_path  # noqa: E402
from mechdiag.tasks import get_task  # noqa: E402


def rollouts(model, tok, prompts, max_new: int) -> tuple[float, int]:
    enc = tok(prompts, return_tensors="pt", padding=True)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=None, top_p=None,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    dt = time.perf_counter() - t
    comp = out[:, enc["input_ids"].shape[1]:]
    return dt, int((comp != tok.pad_token_id).sum())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-new", type=int, default=40)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    task = get_task("arith")
    exs = task.examples("test", 16)
    rows = []
    for name, src in [("bundled", "bundled"), ("stories260K", shared_path("models", "stories260K", "hf"))]:
        model, tok = load_model_and_tokenizer(src)
        prompts = [task.prompt(e, tok) for e in exs for _ in range(8)]
        plen = tok(prompts[0], return_tensors="pt")["input_ids"].shape[1]
        rollouts(model, tok, prompts[:8], 4)  # warm-up
        best = min((rollouts(model, tok, prompts, a.max_new) for _ in range(a.repeats)), key=lambda r: r[0])
        n = sum(q.numel() for q in model.parameters())
        rows.append((name, n, plen, *best))
        print(f"{name:12s} params {n:>9,}  prompt tokens {plen:3d}  128 rollouts {best[0]:.2f}s  "
              f"{best[1] / best[0]:.0f} new tok/s", flush=True)
    print(f"ratio stories260K/bundled time per batch: {rows[1][3] / rows[0][3]:.2f}x")


if __name__ == "__main__":
    main()
