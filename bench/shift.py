"""Benchmark `mechdiag shift`: nnsight capture vs a plain register_forward_hook capture of the same batches, and
peak memory against the number of prompts.

    python bench/shift.py                      # time (256 ARC prompts) + memory sweep 64..1024
    python bench/shift.py --model random       # a larger random Llama (hidden 256, 8 layers) instead

Time: both sides run the same padded batches through the same models (base = adapter disabled, tuned = adapter
on); "capture" is the two forwards with every post-block residual and the logits kept, "end to end" adds the
same per-prompt reductions (ShiftSums.add). Medians over --repeats interleaved rounds; ratio = mechdiag / hooks.
Memory: each N runs in a fresh process; resident memory is sampled every millisecond during `measure` and the
peak is reported in total and above the level at its start.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag.models import pad_id as pad_id_of  # noqa: E402
from mechdiag.paths import shared_path  # noqa: E402
from mechdiag.probes.capture import Captured, pad_batch  # noqa: E402
from mechdiag.probes.prompts import encode  # noqa: E402
from mechdiag.probes.shift import ShiftSums, measure  # noqa: E402


def arc_prompts(n: int, pool: int | None = None) -> list[str]:
    """n ARC test questions; with `pool`, the first `pool` questions repeated (fixed batch shapes)."""
    path = shared_path("data", "arc_challenge", "ARC-Challenge-Test.ai2format.partial.jsonl")
    stems = [json.loads(ln)["question"]["stem"] for ln in path.read_text().splitlines()][:pool]
    return [stems[i % len(stems)] for i in range(n)]


def make_models(kind: str, work: Path):
    """Base model folder + a random LoRA adapter folder on it (all layers, attention + MLP)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    stories = shared_path("models", "stories260K", "hf")
    if kind == "stories260k":
        base_dir = stories
        model = AutoModelForCausalLM.from_pretrained(stories)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688,
                                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                             max_position_embeddings=512))
        base_dir = work / "base"
        model.save_pretrained(base_dir)
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
            (base_dir / f).write_bytes((stories / f).read_bytes())
    torch.manual_seed(1)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]))
    peft.save_pretrained(work / "adapter")
    return base_dir, work / "adapter"


def load_plain(base_dir: Path, adapter_dir: Path):
    """The same pair loaded independently of mechdiag (never wrapped by nnsight): the hook floor's models."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()


@torch.no_grad()
def hook_capture(inner, batch) -> Captured:
    layers = inner.model.layers
    outs: list[torch.Tensor] = []
    handles = [layers[0].register_forward_pre_hook(lambda m, a, kw: outs.append(a[0] if a else kw["hidden_states"]),
                                                   with_kwargs=True)]
    handles += [layer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
                for layer in layers]
    try:
        logits = inner(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return Captured(outs, logits)


def batches(seqs, pad_id, batch_size):
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    return [(order[s:s + batch_size], pad_batch([seqs[i] for i in order[s:s + batch_size]], pad_id))
            for s in range(0, len(order), batch_size)]


def run_hooks(peft, bs, n_layers, reduce: bool):
    inner = peft.get_base_model()
    sums = ShiftSums(sum(len(i) for i, _ in bs), n_layers)
    for idx, b in bs:
        rows = torch.arange(len(idx))
        with peft.disable_adapter():
            ref = hook_capture(inner, b)
            if reduce:
                lr = inner.lm_head(inner.model.norm(torch.stack([h[rows, b.last] for h in ref.resid[1:]])))
        tun = hook_capture(inner, b)
        if reduce:
            lt = inner.lm_head(inner.model.norm(torch.stack([h[rows, b.last] for h in tun.resid[1:]])))
            sums.add(idx, ref, tun, lr, lt, b.attention_mask)


def run_mechdiag(pair, bs, n_layers, reduce: bool, seqs=None, pad_id=0, batch_size=32):
    if reduce:
        measure(pair.ref, pair.tuned, seqs, pad_id, batch_size, pair.ref_ctx, pair.tuned_ctx)
        return
    for _, b in bs:
        with pair.ref_ctx():
            pair.ref.run(b)
        with pair.tuned_ctx():
            pair.tuned.run(b)


def time_it(fn):
    """(CPU seconds of this process, wall seconds): CPU time is the stable figure on a shared machine."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every millisecond from /proc/self/statm."""

    def __enter__(self):
        self.page = resource.getpagesize()
        self.start = self.now()
        self.peak = self.start
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _watch(self):
        while not self.done.wait(0.001):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.now())


def bench_time(args, base_dir, adapter_dir):
    from mechdiag.probes.load import load_pair

    pair = load_pair(base_dir, adapter_dir)
    assert pair.shared
    peft = load_plain(base_dir, adapter_dir)
    seqs, _ = encode(pair.tokenizer, arc_prompts(args.n), 512)
    pad_id = pad_id_of(pair.tokenizer)
    bs = batches(seqs, pad_id, args.batch_size)
    n_layers = pair.ref.n_layers
    n_tok = sum(len(s) for s in seqs)
    print(f"model {args.model}: {n_layers} layers, {args.n} ARC prompts, {n_tok} tokens, batch {args.batch_size}, "
          f"{torch.get_num_threads()} thread(s), {args.repeats} rounds")
    for reduce in (False, True):
        fns = {"hooks": lambda r=reduce: run_hooks(peft, bs, n_layers, r),
               "mechdiag": lambda r=reduce: run_mechdiag(pair, bs, n_layers, r, seqs, pad_id, args.batch_size)}
        for f in fns.values():
            f()  # warm-up
        times = {k: [] for k in fns}
        for _ in range(args.repeats):  # interleaved rounds: machine noise hits both sides alike
            for k, f in fns.items():
                times[k].append(time_it(f))
        cpu = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
        wall = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
        what = "end to end (capture + reductions)" if reduce else "capture only"
        print(f"  {what:34s} CPU s: hooks {cpu['hooks']:.3f} mechdiag {cpu['mechdiag']:.3f} "
              f"ratio {cpu['mechdiag'] / cpu['hooks']:.3f}x | wall s: hooks {wall['hooks']:.3f} "
              f"mechdiag {wall['mechdiag']:.3f} ratio {wall['mechdiag'] / wall['hooks']:.3f}x")


def bench_memory_one(args, base_dir, adapter_dir):
    from mechdiag.probes.load import load_pair

    pair = load_pair(base_dir, adapter_dir)
    seqs, _ = encode(pair.tokenizer, arc_prompts(args.mem, None if args.distinct else 64), 512)
    with PeakRSS() as rss:
        measure(pair.ref, pair.tuned, seqs, pad_id_of(pair.tokenizer), args.batch_size, pair.ref_ctx,
                pair.tuned_ctx)
    print(json.dumps({"n": args.mem, "peak_rss_mb": rss.peak / 2**20, "growth_mb": (rss.peak - rss.start) / 2**20,
                      "max_prompt_tokens": max(len(s) for s in seqs)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["stories260k", "random"], default="stories260k")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--distinct", action="store_true", help="memory sweep on distinct prompts (longer maxima)")
    ap.add_argument("--mem", type=int, help=argparse.SUPPRESS)  # child process: one memory point
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        if args.mem:
            return bench_memory_one(args, work / "base" if args.model == "random" else
                                    shared_path("models", "stories260K", "hf"), work / "adapter")
        base_dir, adapter_dir = make_models(args.model, work)
        bench_time(args, base_dir, adapter_dir)
        pool = "distinct ARC prompts" if args.distinct else "the first 64 ARC prompts repeated (same batch shapes)"
        print(f"  peak memory (fresh process per N, batch {args.batch_size}, {pool}):")
        points = []
        for n in map(int, args.sizes.split(",")):
            out = subprocess.run([sys.executable, __file__, "--mem", str(n), "--model", args.model, "--work",
                                  str(work), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
                                 + (["--distinct"] if args.distinct else []),
                                 capture_output=True, text=True, check=True)
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            points.append(rec)
            print(f"    N={n:5d}  peak RSS {rec['peak_rss_mb']:.1f} MB, of which during measure "
                  f"{rec['growth_mb']:.1f} MB (longest prompt {rec['max_prompt_tokens']} tokens)")
        print(f"  peak RSS N={points[-1]['n']} / N={points[0]['n']}: "
              f"{points[-1]['peak_rss_mb'] / points[0]['peak_rss_mb']:.3f}x")


if __name__ == "__main__":
    main()
