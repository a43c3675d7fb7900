"""The one recorder from both trainers on the same rollouts: a real TRL GRPOTrainer run (`build_trainer`, the
MechdiagCallback inside), then its rollouts (the same completions and rewards: TRL's logs and completions
parquet, as recorded), and its weights after each step (TRL's checkpoints) fed through the native trainer's
recorder with the native signal set. Same signals, same streams, same keys, equal values."""

from __future__ import annotations

import torch

from mechdiag import config as C
from mechdiag import recorder as R
from mechdiag.integrations.trl import build_trainer
from mechdiag.run import STREAMS, RunDir
from tests.test_trl import _small

torch.set_num_threads(1)
STEPS = 2


def test_same_signals_keys_and_values_from_both_backends(stories260k, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = C.load(None, _small(stories260k, f"max_steps={STEPS}", "save_every=1", "record.displacement_every=1",
                              "record.samples_every=1", "record.shift_at_eval=true", "beta=0.02",
                              "record.signals=[tests.test_user_signals:RewardGap]"))
    trainer, trl_run, cb = build_trainer(cfg, tmp_path / "trl", log_completions=True, num_completions_to_print=0)
    trainer.train()

    tok = trainer.processing_class
    heldout = R.HeldOut.from_config(cfg, tok)
    native = R.signals(cfg, tok, heldout, lora=True, shift_prompts=heldout.prompts)
    assert [type(s).__name__ for s in native] == [type(s).__name__ for s in cb.recorder.signals]

    def weights(step):  # the policy after `step` updates, as TRL saved it
        base = AutoModelForCausalLM.from_pretrained(stories260k)
        if step == 0:
            from mechdiag.train.lora import apply_lora

            return apply_lora(base, cfg.lora)  # the adapter's initial B = 0: the base itself
        return PeftModel.from_pretrained(base, trl_run.path / "trl" / f"checkpoint-{step}")

    rec = R.Recorder(RunDir(tmp_path / "native", create=True), native)
    rec.start()
    rec.eval(0, weights(0), tok)
    samples = trl_run.read("samples")
    for m in trl_run.read("metrics"):  # the native order: the step's rollout, its weights, its eval
        step = m["step"]
        rec.train(step, {k: v for k, v in m.items() if k != "step"},
                  [s for s in samples if s["step"] == step and s.get("split") == "train"])
        model = weights(step)
        rec.weights(step, model, last=step == STEPS)
        if step == STEPS:
            rec.eval(step, model, tok)
            rec.end(step, model, tok)

    ours = RunDir(tmp_path / "native")
    names = [*STREAMS, "reward_gap"]
    held = {n for n in names if trl_run.read(n)}
    assert held == {n for n in names if ours.read(n)} == {"metrics", "eval", "samples", "displacement", "shift",
                                                        "reward_gap"}
    for name in sorted(held):
        a, b = trl_run.read(name), ours.read(name)
        assert [sorted(r) for r in a] == [sorted(r) for r in b], name
        assert a == b, name
    assert any(r["rel_fro"] > 0 for r in ours.read("displacement"))
    assert {e["step"] for e in ours.read("eval")} == {0, STEPS} and len(ours.read("samples")) > 16
