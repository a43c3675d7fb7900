"""Overhead of mechdiag's recorder inside TRL's GRPOTrainer: TRL steps/s without and with MechdiagCallback (+ the
GroupCV reward wrapper) in one run, the recorder switched on for every other step so machine load hits both
alike; prints the ratio.

    .venv/bin/python bench/trl_callback.py [--model DIR] [--steps 42] [--tokens 32] [--per-step 16]

Step time is measured by a timing callback from one on_step_begin to the next (generation, reward, backward,
optimizer step, logging: all the recorder adds to), medians over the on and off steps. Target: ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechdiag.paths import shared_dir  # noqa: E402


def reward_a(prompts=None, completions=None, **_):
    return [c.lower().count("a") / max(1, len(c)) for c in completions]


def reward_len(prompts=None, completions=None, **_):
    return [min(len(c), 80) / 80 for c in completions]


class Alternate:
    """One TRL run, the recorder on for odd steps and off for even ones: each step's wall time (one on_step_begin
    to the next: generation, rewards, backward, optimizer, logging) is paired with its neighbours under the same
    machine load. On steps run MechdiagCallback (displacement every step: the worst case) and the GroupCV
    wrapper; off steps are plain TRL."""

    def __init__(self, cb):
        self.cb, self.on, self.t0 = cb, False, None
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.inside: list[float] = []  # seconds in the callback per recorded step (displacement + metrics)

    def on_train_begin(self, *a, **k):
        self.cb.on_train_begin(*a, **k)

    def on_step_begin(self, args, state, control, **kw):
        now = time.perf_counter()
        if self.t0 is not None and state.global_step > 2:  # the first steps warm caches
            self.times[self.on].append(now - self.t0)
        self.t0, self.on = now, state.global_step % 2 == 0  # step global_step + 1 begins

    def on_step_end(self, *a, **k):
        if self.on:
            t = time.perf_counter()
            self.cb.on_step_end(*a, **k)
            self.inside.append(time.perf_counter() - t)

    def on_log(self, *a, **k):
        if self.on:
            t = time.perf_counter()
            self.cb.on_log(*a, **k)
            self.inside[-1] += time.perf_counter() - t

    def on_train_end(self, *a, **k):
        self.cb.on_train_end(*a, **k)

    def __getattr__(self, name):  # every other TrainerCallback event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def switched(raw, wrapped, alt):
    """Reward functions that are the GroupCV-wrapped ones on recorder steps and the raw ones otherwise."""
    out = []
    for r, w in zip(raw, wrapped, strict=True):
        def f(*a, _r=r, _w=w, **k):
            return (_w if alt.on else _r)(*a, **k)

        f.__name__ = r.__name__
        out.append(f)
    return out


def one_run(model_dir, steps, tokens, per_step, seed):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from mechdiag.integrations.trl import GroupCV, MechdiagCallback

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token_id = 0
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = Dataset.from_list([{"prompt": f"Once upon a time, story {i}"} for i in range(256)])
    raw = [reward_a, reward_len]
    cb = MechdiagCallback(displacement_every=1, reward_weights={"reward_a": 1.0, "reward_len": 0.5})
    alt = Alternate(cb)
    funcs = switched(raw, GroupCV(raw, [1.0, 0.5], group_size=4).funcs, alt)
    with tempfile.TemporaryDirectory() as out:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=per_step,
                              num_generations=4, max_completion_length=tokens, logging_steps=1, save_strategy="no",
                              bf16=False, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
                              loss_type="grpo", beta=0.02, learning_rate=1e-3, report_to=[], seed=seed,
                              reward_weights=[1.0, 0.5], use_bias_correction_kl=False)
            trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=data,
                                  processing_class=tok,
                                  peft_config=LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"]),
                                  callbacks=[alt])
            for c in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(c)
            trainer.train()
    return alt.times, alt.inside


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(shared_dir() / "models" / "stories260K" / "hf"))
    ap.add_argument("--steps", type=int, default=42)
    ap.add_argument("--tokens", type=int, default=32, help="max completion tokens")
    ap.add_argument("--per-step", type=int, default=16, help="completions per step (4 per prompt)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    times, inside = one_run(a.model, a.steps, a.tokens, a.per_step, seed=0)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    per = statistics.median(inside[1:])  # the first call also caches ||W0|| per module
    print(f"model {a.model}: {a.steps} TRL steps, {a.per_step} completions/step (G=4), {a.tokens} tokens, "
          f"LoRA r=8 on all 7 modules, {a.threads} thread(s); recorder on odd steps, off on even steps")
    print(f"{'steps':>28} {'n':>3} {'median s/step':>14} {'steps/s':>8}")
    print(f"{'TRL alone':>28} {len(times[False]):3d} {off:14.4f} {1 / off:8.3f}")
    print(f"{'TRL + MechdiagCallback':>28} {len(times[True]):3d} {on:14.4f} {1 / on:8.3f}")
    print(f"ratio steps/s with / without: {off / on:.3f}  (displacement every step, the worst case)")
    print(f"time inside the callback: {1000 * per:.2f} ms per step = {100 * per / off:.2f}% of a TRL step "
          "(displacement of every LoRA module + a metrics record)")

if __name__ == "__main__":
    main()
