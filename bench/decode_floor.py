"""Decode against its floor: what one sampled token costs a batch of G rows, in mechdiag's decode loop and in
transformers' `generate` (the path TRL's GRPOTrainer samples with when vLLM is off), beside the floor any exact
float32 decode pays: one matmul through every weight matrix of the model (its Linear layers, then the output
head), on G rows, with nothing else.

    python bench/decode_floor.py --model-dir bench/_work/q05-real [--rows 8] [--tokens 32] [--rounds 3]

The rounds alternate the three and reverse their order every other round; medians are printed with each
one's ratio to the floor. A ratio near 1 means the decode is bound by reading the weights, so no exact decode
at this dtype can be much faster: a faster GRPO step has to come from work it does not do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag.generate import sample_tokens  # noqa: E402
from mechdiag.models import encode_prompts, load_model_and_tokenizer  # noqa: E402
from mechdiag.tasks import get_task  # noqa: E402


def weight_matrices(model) -> list[torch.Tensor]:
    """Every Linear weight in forward order, the output head last (a tied head counted once, as it is read)."""
    head = model.get_output_embeddings().weight
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not head]
    return mats + [head]


@torch.inference_mode()
def floor_per_token(mats: list[torch.Tensor], rows: int, tokens: int) -> float:
    xs = {w.size(1): torch.randn(rows, w.size(1)) for w in mats}
    t = time.perf_counter()
    for _ in range(tokens):
        for w in mats:
            F.linear(xs[w.size(1)], w)
    return (time.perf_counter() - t) / tokens


def mechdiag_per_token(model, ids, mask, rows: int, tokens: int, pad: int) -> float:
    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    _, cm, _ = sample_tokens(model, ids, mask, max_new_tokens=tokens, eos=[], pad=pad, temperature=1.0, gen=gen,
                             entropy=[], logprobs=[], repeat=rows)
    assert int(cm.sum()) == rows * tokens
    return (time.perf_counter() - t) / tokens


@torch.inference_mode()
def generate_per_token(model, ids, mask, rows: int, tokens: int, pad: int) -> float:
    t = time.perf_counter()
    out = model.generate(input_ids=ids.repeat_interleave(rows, 0), attention_mask=mask.repeat_interleave(rows, 0),
                         max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=None,
                         top_p=None, pad_token_id=pad)
    assert out.size(1) - ids.size(1) == tokens
    return (time.perf_counter() - t) / tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=8, help="G: rows decoded together")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_model_and_tokenizer(str(a.model_dir))
    model.eval()
    task = get_task("arith")
    ids, mask = encode_prompts(tok, [task.prompt(task.examples("train", 1)[0], tok)], 96)
    mats = weight_matrices(model)
    n_bytes = sum(w.numel() * w.element_size() for w in mats)
    cases = {
        "floor (matmuls only)": lambda: floor_per_token(mats, a.rows, a.tokens),
        "mechdiag sample_tokens": lambda: mechdiag_per_token(model, ids, mask, a.rows, a.tokens, tok.pad_token_id),
        "transformers generate": lambda: generate_per_token(model, ids, mask, a.rows, a.tokens, tok.pad_token_id),
    }
    for warm_up in (mechdiag_per_token, generate_per_token):  # first-call costs are not decode
        warm_up(model, ids, mask, a.rows, 2, tok.pad_token_id)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(a.rounds):
        for name in list(cases) if r % 2 == 0 else list(cases)[::-1]:
            times[name].append(cases[name]())
    floor = statistics.median(times["floor (matmuls only)"])
    print(f"{a.model_dir.name}: {n_bytes / 2**30:.2f} GiB of weight matrices, {a.rows} rows, {a.tokens} tokens, "
          f"{a.threads} thread(s), {a.rounds} rounds (medians)")
    print(f"{'decode':<24} {'ms/token':>9} {'x floor':>8} {'GB/s read':>10}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<24} {m * 1e3:9.1f} {m / floor:8.2f} {n_bytes / m / 1e9:10.2f}")


if __name__ == "__main__":
    main()
