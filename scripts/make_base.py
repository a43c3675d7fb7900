"""Pre-train the bundled arith base: a tiny Llama, supervised next-token loss on the gold completion.

Deterministic (fixed seed, fixed thread count, one data order). It checks held-out greedy accuracy on the fixed
500 arith test problems as it trains and stops once it lands inside the target band, so GRPO has room to improve
it. The result (weights, tokenizer, base_card.json) goes to mechdiag/assets/arith-base by default.

    python scripts/make_base.py --out /tmp/b    # try settings elsewhere (default out: the bundled asset)

The second base, bundled:deep (mechdiag/assets/arith-deep, 8 layers), is made the same way with --layers 8
--hidden 64 --ffn 256 and --out mechdiag/assets/arith-deep (docs/base-model.md has the exact commands).

The shipped base is made in two stages (the exact commands are in base_card.json): clean SFT stopped at ~30%,
then SFT from it on a mixture where most 3-step chains stop after step 2, a habit that lowers greedy accuracy
while the right completion keeps a good share of the samples, so GRPO has a clear, quick thing to fix.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag.atomic import write_json  # noqa: E402
from mechdiag.models import bundled_path, generate  # noqa: E402
from mechdiag.tasks import get_task  # noqa: E402
from mechdiag.tasks.arith import build_char_tokenizer  # noqa: E402
from mechdiag.tasks.rewards import format_ok  # noqa: E402

MAX_NEW_TOKENS = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(bundled_path()))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=384)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--band", type=float, nargs=2, default=[0.30, 0.45], help="stop once greedy accuracy is in here")
    p.add_argument("--noise", type=float, default=0.0,
                   help="fraction of training chains with one arithmetic slip (the answer follows the slip)")
    p.add_argument("--skip-last", type=float, default=0.0,
                   help="fraction of training chains that stop one step early and answer that intermediate value")
    p.add_argument("--skip-min-steps", type=int, default=2,
                   help="--skip-last only applies to problems with at least this many steps")
    p.add_argument("--init", default=None, help="start from this saved model (a previous make_base output)")
    p.add_argument("--min-steps", type=int, default=0, help="do not stop before this many steps")
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared CPU")
    p.add_argument("--n-train", type=int, default=100_000)
    return p.parse_args(argv)


def corrupt(example, rng: random.Random) -> str:
    """A gold chain with one step's result off by a small amount, carried through the later steps."""
    steps = [s.split("=") for s in example.meta["reasoning"].split(";")]
    k = rng.randrange(len(steps))
    out, value = [], None
    for i, (lhs, _res) in enumerate(steps):
        op = next(c for c in "+-*" if c in lhs[1:])
        a, b = lhs.rsplit(op, 1)
        a = int(a) if value is None else value
        value = {"+": a + int(b), "-": a - int(b), "*": a * int(b)}[op]
        if i == k:
            value += rng.choice([-2, -1, 1, 2])
        out.append(f"{a}{op}{b}={value}")
    return f"<reasoning>{';'.join(out)}</reasoning><answer>{value}</answer>"


def skip_last(example, min_steps: int = 2) -> str:
    """A chain that stops one step early (a 'gives up before the last step' habit GRPO can unlearn)."""
    steps = example.meta["reasoning"].split(";")
    if len(steps) < max(2, min_steps):
        return example.meta["gold_completion"]
    return f"<reasoning>{';'.join(steps[:-1])}</reasoning><answer>{steps[-2].split('=')[1]}</answer>"


def training_completion(example, rng: random.Random, args) -> str:
    u = rng.random()
    if u < args.skip_last:
        return skip_last(example, args.skip_min_steps)
    if u < args.skip_last + args.noise:
        return corrupt(example, rng)
    return example.meta["gold_completion"]


def encode(tok, task, examples, completions):
    rows = []
    for ex, comp in zip(examples, completions, strict=True):
        p = tok(task.prompt(ex, tok))["input_ids"]
        c = tok(comp, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p + c, len(p)))
    return rows


def batch_of(rows, pad_id):
    n = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (r, lp) in enumerate(rows):  # right padding for training
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, lp:len(r)] = torch.tensor(r[lp:])
        mask[i, :len(r)] = 1
    return ids, mask, labels


def evaluate(model, tok, task, examples, samples: int = 1, temperature: float = 1.0, seed: int = 0) -> dict:
    """Greedy (samples=1) accuracy, format rate and mean completion length; pass@k when sampling."""
    prompts = [task.prompt(ex, tok) for ex in examples]
    if samples == 1:
        comps = generate(model, tok, prompts, MAX_NEW_TOKENS, do_sample=False, batch_size=250)
        ok = [task.correct(c, ex) for c, ex in zip(comps, examples, strict=True)]
        lens = [len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for c in comps]
        return {"accuracy": sum(ok) / len(ok), "format_rate": sum(format_ok(c) for c in comps) / len(comps),
                "mean_completion_tokens": sum(lens) / len(lens)}
    comps = generate(model, tok, [p for p in prompts for _ in range(samples)], MAX_NEW_TOKENS, do_sample=True,
                     temperature=temperature, batch_size=400, generator_seed=seed)
    ok = [task.correct(c, examples[i // samples]) for i, c in enumerate(comps)]
    per = [any(ok[i * samples:(i + 1) * samples]) for i in range(len(examples))]
    return {f"pass@{samples}": sum(per) / len(per), "sample_accuracy": sum(ok) / len(ok),
            "sample_format_rate": sum(format_ok(c) for c in comps) / len(comps)}


def _card_of(folder):
    if not folder or not (Path(folder) / "base_card.json").exists():
        return None
    card = json.loads((Path(folder) / "base_card.json").read_text())
    return {k: card[k] for k in ("command", "seed", "steps", "heldout_greedy_accuracy") if k in card}


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_char_tokenizer()
    task = get_task("arith")
    test = task.examples("test", 500)
    train = task.examples("train", args.n_train, seed=args.seed)
    rng = random.Random(args.seed)
    comps = [training_completion(ex, rng, args) for ex in train]
    rows = encode(tok, task, train, comps)

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM.from_pretrained(args.init) if args.init else LlamaForCausalLM(cfg)
    if args.init:  # the architecture is the init's; record it, not the unused flags
        c = model.config
        args.hidden, args.layers, args.heads, args.ffn = (c.hidden_size, c.num_hidden_layers,
                                                          c.num_attention_heads, c.intermediate_size)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}  train rows {len(rows):,}  prep {time.time() - t0:.0f}s", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    order = list(range(len(rows)))
    rng.shuffle(order)
    pos, step, history, result = 0, 0, [], None
    while step < args.max_steps:
        if pos + args.batch > len(order):
            rng.shuffle(order)
            pos = 0
        ids, mask, labels = batch_of([rows[i] for i in order[pos:pos + args.batch]], tok.pad_token_id)
        pos += args.batch
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.eval_every == 0:
            model.eval()
            m = evaluate(model, tok, task, test)
            history.append({"step": step, "loss": round(loss.item(), 4), **m})
            print(f"step {step} loss {loss.item():.3f} acc {m['accuracy']:.3f} fmt {m['format_rate']:.2f} "
                  f"len {m['mean_completion_tokens']:.1f}  {time.time() - t0:.0f}s", flush=True)
            if step >= args.min_steps and args.band[0] <= m["accuracy"] <= args.band[1]:
                result = m
                break
    if result is None:
        raise SystemExit(f"never landed in the band {args.band}; history: {history[-5:]}")

    model.eval()
    t1 = time.time()
    sampled = evaluate(model, tok, task, test, samples=8, temperature=1.0, seed=args.seed)
    print(f"pass@8 {sampled['pass@8']:.3f} sample acc {sampled['sample_accuracy']:.3f} "
          f"({time.time() - t1:.0f}s for 4000 samples)", flush=True)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    card = {
        "command": "python scripts/make_base.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "init_card": _card_of(args.init),
        "seed": args.seed, "steps": step, "params": n_params, "task": "arith", "difficulty": 2,
        "eval": "greedy on arith test[:500], max_new_tokens 64",
        "heldout_greedy_accuracy": result["accuracy"], "format_rate": result["format_rate"],
        "mean_completion_tokens": result["mean_completion_tokens"],
        "pass@8_t1": sampled["pass@8"], "sample_accuracy_t1": sampled["sample_accuracy"],
        "sample_format_rate_t1": sampled["sample_format_rate"],
        "train_seconds": round(t1 - t0, 1), "history": history,
    }
    write_json(tmp / "base_card.json", card)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(json.dumps({k: v for k, v in card.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
