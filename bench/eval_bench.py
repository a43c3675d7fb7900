"""`mechdiag eval` scoring loop vs the loop a user would write with `model.generate`, and its memory.

Same model (the bundled base), same problems, greedy + S samples per problem, scored by the same task:
  mechdiag   evaluate.evaluate_model: left-padded batches, KV cache, completions streamed out per chunk
  peer       transformers model.generate (greedy, then do_sample with num_return_sequences=S) per chunk
Prints seconds per problem and the ratio, then the Python heap peak (tracemalloc) of evaluate_model at two
benchmark sizes: a flat peak means completions are not accumulated.

    python bench/eval_bench.py --n 200 --samples 5
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mechdiag import evaluate as E  # noqa: E402
from mechdiag.models import load_model_and_tokenizer as load_model  # noqa: E402


def peer(model, tok, bench, samples: int, max_new: int, chunk: int) -> float:
    task, correct = bench.task, 0
    tok.padding_side = "left"
    for s in range(0, len(bench.examples), chunk):
        exs = bench.examples[s:s + chunk]
        enc = tok([task.prompt(e, tok) for e in exs], return_tensors="pt", padding=True)
        width = enc["input_ids"].shape[1]
        with torch.no_grad():
            g = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
            r = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=0.8, top_k=0,
                               num_return_sequences=samples, pad_token_id=tok.pad_token_id)
        greedy = tok.batch_decode(g[:, width:], skip_special_tokens=True)
        sampled = tok.batch_decode(r[:, width:], skip_special_tokens=True)
        correct += sum(task.correct_many(greedy, exs))
        task.correct_many(sampled, [e for e in exs for _ in range(samples)])
    return correct / len(bench.examples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("bundled")
    model.eval()
    bench = E.load_benchmarks([("arith", "test")], args.n)[0]
    st = E.Settings(ks=[1, args.samples], samples=args.samples, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size).check()
    chunk = max(1, args.batch_size // args.samples)

    t0 = time.perf_counter()
    ours = E.evaluate_model(model, tok, bench, st, write=lambda recs: None)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    acc_peer = peer(model, tok, bench, args.samples, args.max_new_tokens, chunk)
    t_peer = time.perf_counter() - t0
    print(f"problems {args.n} x (greedy + {args.samples} samples), {args.max_new_tokens} new tokens, "
          f"{chunk} problems per chunk, {args.threads} threads")
    print(f"mechdiag evaluate_model   {1000 * t_ours / args.n:7.1f} ms/problem   accuracy {ours['accuracy']:.3f}")
    print(f"peer model.generate loop  {1000 * t_peer / args.n:7.1f} ms/problem   accuracy {acc_peer:.3f}")
    print(f"ratio peer / mechdiag     {t_peer / t_ours:7.2f}x")

    peaks = []
    for n in (args.n // 4, args.n):
        b = E.load_benchmarks([("arith", "test")], n)[0]
        tracemalloc.start()
        E.evaluate_model(model, tok, b, st, write=lambda recs: None)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    print(f"python heap peak: {peaks[0] / 2**20:.1f} MiB at n={args.n // 4}, {peaks[1] / 2**20:.1f} MiB at "
          f"n={args.n} (ratio {peaks[1] / peaks[0]:.2f} for {4}x the problems)")


if __name__ == "__main__":
    main()
