"""GRPO step throughput: mechdiag's trainer vs TRL's GRPOTrainer on the same tiny model, CPU, in one run.

Same model, task (arith), group size, prompts per step, completion budget, LoRA (r, alpha, modules), beta,
loss "grpo", temperature; TRL with bf16 off and no gradient checkpointing. The first `--warmup` steps of
each are excluded. Also reports what the recording hooks cost: their own time per step over the step time.

Runs `--rounds` rounds, each a fresh TRL run and a fresh mechdiag run of the same steps, alternating which goes
first, and reports the median of the per-round ratios with their spread (min-max), so that a shared, noisy
machine moves both sides of a ratio alike. `--profile` prints where mechdiag's step time goes (cProfile).

    python bench/grpo_step.py [--model bundled] [--steps 8] [--rounds 5] [--beta 0] [--threads 2] [--profile]

With --options it measures what each objective option of TRL 1.16's family costs (docs/training.md): the native
trainer with the default objective and with the option, two trainers stepping alternately on the same seeds, the
median step time of each and their ratio (goal: at most 1.10x). bias_kl runs at beta 0.04 against beta 0.04.

    python bench/grpo_step.py --options --steps 4 --warmup 1 --threads 1

With --skip (and --beta 0) it measures instead the trainer's beta = 0 shortcut, which leaves completions with
A = 0 out of the update pass: the same trainer twice, alternating steps, once with exact-zero advantages for
equal-reward groups (objective.group_advantages) and once with the float32 centring it had before (A ~ 1e-3,
never 0, so the shortcut never fires). Reports the share of rows skipped and the median update time of each.

    python bench/grpo_step.py --skip --beta 0 --steps 6 --warmup 1 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from mechdiag import config as C  # noqa: E402
from mechdiag import recorder as R  # noqa: E402


def common(args) -> list[str]:
    return [f"model.name_or_path={args.model}", f"group_size={args.group}", f"prompts_per_step={args.prompts}",
            f"max_completion_tokens={args.completion}", f"beta={args.beta}", "loss_type=grpo", "lora.r=16",
            "lora.alpha=32", "lora.dropout=0", f"threads={args.threads}", "temperature=1.0", "learning_rate=1e-3",
            "eval_n=8", "save_every=0", f"max_steps={args.steps + args.warmup}", "max_prompt_tokens=256"]


def bench_mechdiag(args, out: Path) -> dict:
    from mechdiag.train.trainer import Trainer

    cfg = C.load(None, common(args) + ["record.displacement_every=10", "record.samples_every=10",
                                       "record.shift_at_eval=true"])
    tr = Trainer(cfg, out / "mechdiag")
    tr.recorder.start()  # as fit() does: setup, not step time
    step_times, hook_times, lengths, zero = [], [], [], []
    prof = getattr(args, "profiler", None)
    if prof is not None:
        prof.enable()
    for step in range(1, args.steps + args.warmup + 1):
        t0 = time.perf_counter()
        record, roll = tr.train_step(step)
        t1 = time.perf_counter()
        metrics = tr.recorder.train(record)  # as fit() does: the recorder (its signals, then the hooks)
        tr.recorder.weights(step, tr.model, last=False)
        t2 = time.perf_counter()
        print(f"mechdiag step {step}: {t1 - t0:.2f} s", file=sys.stderr, flush=True)
        if step > args.warmup:
            step_times.append(t1 - t0)
            hook_times.append(t2 - t1)
            lengths.append(metrics["completion_length"])
            zero.append(metrics["frac_zero_std"])
    if prof is not None:
        prof.disable()
    mean_step = statistics.mean(step_times)
    return {"s_per_step": mean_step, "completion_length": statistics.mean(lengths),
            "frac_zero_std": statistics.mean(zero),
            "hook_s_per_step": statistics.mean(hook_times),
            "displacement": "on" if _has("mechdiag.displacement") else "absent (not merged)",
            "shift": "on" if _has("mechdiag.probes.shift") else "absent (not merged)"}


def _float32_advantages(rewards, group_size, scale="group"):
    """The advantage before issue 14's fix: centred in float32, so an equal-reward group is off by ~1 ulp."""
    from mechdiag.train import objective as obj

    r = rewards.view(-1, group_size).to(torch.float32)
    centred = r - r.mean(dim=1, keepdim=True)
    return (centred / (r.std(dim=1, keepdim=True) + obj.STD_EPS)).reshape(-1)


def bench_skip(args, out: Path) -> dict:
    """Update time with the zero-advantage skip firing (exact zeros) vs not (float32 centring), alternating."""
    from unittest import mock

    from mechdiag.train import objective as obj
    from mechdiag.train.trainer import Trainer

    if args.beta != 0:
        raise SystemExit("--skip measures the beta = 0 shortcut: add --beta 0")
    cfg = C.load(None, common(args) + ["record.displacement_every=0", "record.samples_every=0",
                                       "record.shift_at_eval=false"])
    peers = {"exact": Trainer(cfg, out / "exact"), "float32": Trainer(cfg, out / "float32")}
    res = {k: {"update_s": [], "skipped": [], "zero_groups": [], "max_abs_a_equal": []} for k in peers}
    for step in range(1, args.steps + args.warmup + 1):
        order = list(peers) if step % 2 else list(peers)[::-1]  # alternate who goes first
        for name in order:
            patch = mock.patch.object(obj, "group_advantages", _float32_advantages) if name == "float32" else \
                mock.patch.object(obj, "group_advantages", obj.group_advantages)
            with patch:
                record, roll = peers[name].train_step(step)
            metrics = R.step_metrics(record)
            r = roll.rewards.view(-1, cfg.group_size)
            equal = (r == r[:, :1]).all(dim=1)
            a = roll.advantages.cpu().view(-1, cfg.group_size)
            print(f"{name} step {step}: update {metrics['step_time'] - metrics['rollout_time']:.2f} s, "
                  f"{(a == 0).float().mean():.0%} rows A = 0", file=sys.stderr, flush=True)
            if step > args.warmup:
                d = res[name]
                d["update_s"].append(metrics["step_time"] - metrics["rollout_time"])
                d["skipped"].append((a == 0).float().mean().item())
                d["zero_groups"].append(equal.float().mean().item())
                d["max_abs_a_equal"].append(a[equal].abs().max().item() if equal.any() else 0.0)
    return {k: {"update_s": statistics.median(d["update_s"]), "skipped": statistics.mean(d["skipped"]),
                "zero_groups": statistics.mean(d["zero_groups"]), "max_abs_a_equal": max(d["max_abs_a_equal"])}
            for k, d in res.items()}


# option -> its --set overrides (against the default objective; bias_kl against beta 0.04 alone)
OPTIONS = {"dapo": ["loss_type=dapo"], "gspo": ["importance_sampling_level=sequence"], "delta": ["delta=1.5"],
           "clip_higher": ["epsilon_high=0.28"], "mask_truncated": ["mask_truncated_completions=true"],
           "bias_kl": ["beta=0.04", "use_bias_correction_kl=true"],
           "off_policy_mask": ["off_policy_mask_threshold=0.5"],
           "cispo": ["loss_type=cispo", "epsilon_high=5.0"], "sapo": ["loss_type=sapo"],
           "luspo": ["loss_type=luspo", "importance_sampling_level=sequence"], "vespo": ["loss_type=vespo"],
           "gdpo": ["multi_objective_aggregation=normalize_then_sum"], "top_entropy": ["top_entropy_quantile=0.2"],
           "entropy_bonus": ["entropy_coef=0.01"]}


def bench_options(args, out: Path, names: list[str]) -> dict:
    """Median step time of each option against the default objective, two trainers stepping alternately."""
    from mechdiag.train.trainer import Trainer

    quiet = ["record.displacement_every=0", "record.samples_every=0", "record.shift_at_eval=false"]
    res = {}
    for name in names:
        extra = OPTIONS[name]
        base = [x for x in extra if x.startswith("beta=")]  # the option's own baseline (bias_kl: beta > 0)
        peers = {"default": Trainer(C.load(None, common(args) + quiet + base), out / name / "default"),
                 name: Trainer(C.load(None, common(args) + quiet + extra), out / name / "option")}
        times = {k: [] for k in peers}
        for step in range(1, args.steps + args.warmup + 1):
            for k in (list(peers) if step % 2 else list(peers)[::-1]):  # alternate who goes first
                record, _ = peers[k].train_step(step)
                if step > args.warmup:
                    times[k].append(record.update.step_time)
        res[name] = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}: default {res[name]['default']:.3f} s, option {res[name][name]:.3f} s, "
              f"{res[name][name] / res[name]['default']:.2f}x", file=sys.stderr, flush=True)
    return res


def _has(mod: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


def bench_trl(args, out: Path) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mechdiag.models import load_model_and_tokenizer as load_model
    from mechdiag.tasks import get_task, reward_weights

    cfg = C.load(None, common(args))
    weights = reward_weights(cfg)
    model, tok = load_model(args.model)
    task = get_task("arith")
    examples = task.examples("train", n=(args.steps + args.warmup) * args.prompts, seed=0)
    by_prompt = {task.prompt(ex, tok): ex for ex in examples}
    ds = Dataset.from_list([{"prompt": p} for p in by_prompt])

    def reward(prompts, completions, **kw):
        return [task.reward(c, by_prompt[p], weights)[0] for p, c in zip(prompts, completions, strict=True)]

    times, lengths = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t)
            print(f"trl step {state.global_step}: {times[-1]:.2f} s", file=sys.stderr, flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    gcfg = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=args.prompts * args.group,
                      num_generations=args.group, max_completion_length=args.completion, beta=args.beta,
                      loss_type="grpo", learning_rate=1e-3, max_steps=args.steps + args.warmup, logging_steps=1,
                      report_to=[], save_strategy="no", bf16=False, gradient_checkpointing=False, use_cpu=True,
                      temperature=1.0, shuffle_dataset=False, disable_tqdm=True, dataloader_num_workers=0)
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(cfg.lora.target_modules),
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=gcfg, train_dataset=ds, processing_class=tok,
                          peft_config=peft, callbacks=[Clock()])
    trainer.train()
    return {"s_per_step": statistics.mean(times[args.warmup:]), "completion_length": statistics.mean(lengths)}


def profile(args, out: Path) -> None:
    """cProfile of mechdiag's steps and hooks (setup excluded): the functions that take the most time."""
    import cProfile
    import pstats

    args.profiler = cProfile.Profile()
    bench_mechdiag(args, out)
    pstats.Stats(args.profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(args.profiler).sort_stats("cumtime").print_stats(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--completion", type=int, default=48)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip", action="store_true", help="measure the beta = 0 zero-advantage skip (see above)")
    ap.add_argument("--options", nargs="*", choices=list(OPTIONS), default=None,
                    help="each objective option's cost against the default objective (all when none named)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    if args.options is not None:
        with tempfile.TemporaryDirectory() as d:
            res = bench_options(args, Path(d), args.options or list(OPTIONS))
        print(f"model {args.model}, G={args.group}, prompts/step={args.prompts}, max completion {args.completion}, "
              f"beta {args.beta}, LoRA r16, threads {args.threads}, {args.steps} measured steps (alternating), "
              f"load avg at start {load:.1f}")
        print(f"{'option':<16} {'default s/step':>15} {'option s/step':>14} {'ratio':>6}")
        for name, r in res.items():
            print(f"{name:<16} {r['default']:15.3f} {r[name]:14.3f} {r[name] / r['default']:6.2f}")
        return
    if args.skip:
        with tempfile.TemporaryDirectory() as d:
            res = bench_skip(args, Path(d))
        print(f"model {args.model}, G={args.group}, prompts/step={args.prompts}, max completion {args.completion}, "
              f"beta 0, LoRA r16, threads {args.threads}, {args.steps} measured steps, load avg at start {load:.1f}")
        print(f"{'advantages':<10} {'equal groups':>13} {'rows A=0':>9} {'max |A| equal':>14} {'update s':>9}")
        for name, r in res.items():
            print(f"{name:<10} {r['zero_groups']:13.1%} {r['skipped']:9.1%} {r['max_abs_a_equal']:14.3g} "
                  f"{r['update_s']:9.3f}")
        print(f"update pass, float32 / exact: {res['float32']['update_s'] / res['exact']['update_s']:.2f}x")
        return
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        if args.profile:
            profile(args, Path(d) / "profile")
            return
        for r in range(args.rounds):
            out = Path(d) / f"round{r}"
            order = ("trl", "mechdiag") if r % 2 == 0 else ("mechdiag", "trl")
            res = {name: (bench_trl if name == "trl" else bench_mechdiag)(args, out) for name in order}
            rounds.append(res)
            t, m = res["trl"], res["mechdiag"]
            print(f"round {r + 1}: TRL {t['s_per_step']:.3f} s/step, mechdiag {m['s_per_step']:.3f} s/step, "
                  f"ratio {t['s_per_step'] / m['s_per_step']:.2f}x, hooks "
                  f"{100 * m['hook_s_per_step'] / m['s_per_step']:.2f}%", file=sys.stderr, flush=True)
    ratios = [x["trl"]["s_per_step"] / x["mechdiag"]["s_per_step"] for x in rounds]
    hooks = [x["mechdiag"]["hook_s_per_step"] / x["mechdiag"]["s_per_step"] for x in rounds]
    med = lambda k, who: statistics.median(x[who][k] for x in rounds)  # noqa: E731
    m0 = rounds[0]["mechdiag"]
    zero = statistics.median(x["mechdiag"]["frac_zero_std"] for x in rounds)
    print(f"model {args.model}, G={args.group}, prompts/step={args.prompts}, max completion {args.completion}, "
          f"beta {args.beta}, LoRA r16, threads {args.threads}, {args.rounds} alternating rounds of "
          f"{args.steps} steps (+{args.warmup} warm-up), load avg at start {load:.1f}")
    print(f"{'trainer':<10} {'s/step':>8} {'steps/s':>8} {'mean len':>9}   (medians over rounds)")
    for name in ("trl", "mechdiag"):
        s_step = med("s_per_step", name)
        print(f"{name:<10} {s_step:8.3f} {1 / s_step:8.2f} {med('completion_length', name):9.1f}")
    print(f"speed-up mechdiag / TRL: median {statistics.median(ratios):.2f}x, spread {min(ratios):.2f}-"
          f"{max(ratios):.2f}x over {len(ratios)} rounds ({', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"recording hooks: median {100 * statistics.median(hooks):.2f}% of step time, max {100 * max(hooks):.2f}% "
          f"(displacement {m0['displacement']}, shift {m0['shift']}); mechdiag groups with equal rewards "
          f"(rows skipped when beta = 0): {100 * zero:.0f}%")


if __name__ == "__main__":
    main()
