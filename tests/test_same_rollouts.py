"""Both trainers on the same rollouts, through the same step record: a real TRL GRPOTrainer run (`build_trainer`:
GroupCV and the MechdiagCallback inside), then each of its generation batches (TRL's own token ids) scored by the
native trainer's code (rollout.scored: decode, reward components, weighted total, advantages) into the native
trainer's step record. The two records agree field by field, and every signal computed from them agrees: the
metrics and samples TRL's run recorded equal what the native recorder computes from the native records (no
number copied from one side to the other; only TRL's update statistics, which no rollout determines, are given
to both), and the rollout numbers equal TRL's own logs. Displacement, eval and shift: the TRL run's weights after
each step through the native recorder give the same streams."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from mechdiag import config as C
from mechdiag import recorder as R
from mechdiag.integrations import trl as trl_mod
from mechdiag.integrations.trl import build_trainer
from mechdiag.models import eos_ids
from mechdiag.run import STREAMS, RunDir
from mechdiag.train.rollout import scored
from mechdiag.train.trainer import rollout_record
from tests.test_trl import _small
from tests.toy import Shaped

torch.set_num_threads(1)
STEPS = 2


class HalfShaped(Shaped):
    """Odd examples score a constant (correct, half format): zero-std groups; even ones only the format term
    varies: shaping only."""

    def components(self, completion, example):
        if int(example.id.split("-")[1]) % 2:
            return {"correctness": 1.0, "format": 0.5}
        return super().components(completion, example)

ROLLOUT_KEYS = ("reward", "reward_std", "reward_cv", "frac_zero_std", "frac_groups_all_correct",
                "frac_groups_all_wrong", "frac_groups_shaping_only", "reward/correctness", "reward/format",
                "completion_length", "completion_clipped_ratio")


def test_same_rollouts_same_record_and_signals_from_both_trainers(stories260k, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = C.load(None, _small(stories260k, f"max_steps={STEPS}", "save_every=1", "record.displacement_every=1",
                              "record.samples_every=1", "record.shift_at_eval=true", "beta=0.02",
                              "task.name=tests.test_same_rollouts:HalfShaped", "prompts_per_step=4",
                              "rewards.weights={correctness: 2.0, format: 0.5}",
                              "max_completion_tokens=6", "record.signals=[tests.test_user_signals:RewardGap]"))
    batches = []  # TRL's generation batches as its reward functions see them: token ids and example ids
    finish = trl_mod.GroupCV._finish

    def seen(self, prompts, completions, kwargs):
        batches.append((kwargs["completion_ids"], kwargs["example_id"]))
        return finish(self, prompts, completions, kwargs)

    monkeypatch.setattr(trl_mod.GroupCV, "_finish", seen)
    trainer, trl_run, cb = build_trainer(cfg, tmp_path / "trl", log_completions=True, num_completions_to_print=0)
    trainer.train()
    assert len(batches) == STEPS

    tok = trainer.processing_class
    model0 = AutoModelForCausalLM.from_pretrained(stories260k)
    eos, pad = eos_ids(model0, tok), tok.pad_token_id
    task = cb.evaluate.task
    by_id = {ex.id: ex for ex in task.examples(cfg.task.train_split, n=cfg.task.n_train, seed=cfg.seed)}
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}

    def native_record(step, ids, example_ids):
        """The native trainer's record of TRL's completions: its own scoring of the token ids."""
        g = cfg.group_size
        width = max(len(x) for x in ids)
        c_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        c_mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        trunc = torch.tensor([not x or x[-1] not in eos for x in ids])
        examples = [by_id[e] for e in example_ids[::g]]
        prompts = [task.prompt(ex, tok) for ex in examples]
        empty = torch.zeros(len(ids), 1, dtype=torch.long)
        return rollout_record(step, scored(tok, task, examples, prompts, cfg, empty, empty, c_ids, c_mask, trunc),
                              cfg)

    trl_metrics = trl_run.read("metrics")
    native = []
    for m, (ids, example_ids) in zip(trl_metrics, batches, strict=True):
        rec = native_record(m["step"], ids, example_ids)
        # TRL's update statistics are the one thing a rollout does not determine: both records take them as logged
        keep = {k: v for k, v in m.items() if k not in ROLLOUT_KEYS and k != "step" and not k.startswith("reward/")}
        rec.update = R.Update(**{k: keep.pop(k) for k in trl_mod.UPDATE_FIELDS if k in keep})
        rec.extra = keep
        native.append(rec)
        # the rollout numbers equal TRL's own logs of the same batch
        h = logged[m["step"]]
        ours = R.step_metrics(rec)
        assert ours["reward"] == pytest.approx(h["reward"], rel=1e-6)
        assert ours["completion_length"] == pytest.approx(h["completions/mean_length"], rel=1e-6)
        assert ours["completion_clipped_ratio"] == pytest.approx(h["completions/clipped_ratio"], abs=1e-9)
        assert ours["frac_zero_std"] == pytest.approx(h["frac_reward_zero_std"], abs=1e-9)
        assert ours["reward/format"] == pytest.approx(h["rewards/format/mean"], rel=1e-6)
        # the native advantages are TRL's (its completions file), equal-reward groups exactly 0 here
        trl_adv = pd.read_parquet(trl_run.path / "trl" / "completions" / f"completions_{m['step']:05d}.parquet")
        assert rec.advantages == pytest.approx(trl_adv["advantage"].tolist(), abs=1e-3)
        # both sides computed, with differences only of float32 rounding: the native rewards are float32 tensors
        for k in ROLLOUT_KEYS:
            if k in ours:
                assert m[k] == pytest.approx(ours[k], rel=1e-6, abs=1e-9), k
    # groups exist with and without spread, so frac_zero_std and the outcome split are not trivially 0 or 1
    assert 0 < sum(m["frac_zero_std"] for m in trl_metrics) < STEPS
    for m in trl_metrics:  # the constant groups are all correct, the others shaping only
        assert m["frac_groups_all_correct"] == m["frac_zero_std"] == 1 - m["frac_groups_shaping_only"]

    def weights(step):  # the policy after `step` updates, as TRL saved it
        base = AutoModelForCausalLM.from_pretrained(stories260k)
        if step == 0:
            from mechdiag.train.lora import apply_lora

            return apply_lora(base, cfg.lora)  # the adapter's initial B = 0: the base itself
        return PeftModel.from_pretrained(base, trl_run.path / "trl" / f"checkpoint-{step}")

    heldout = R.HeldOut.from_config(cfg, tok)
    signals = R.signals(cfg, heldout, lora=True, shift_prompts=heldout.prompts[:cfg.record.shift_n])
    rec = R.Recorder(RunDir(tmp_path / "native", create=True), signals)
    rec.start()
    rec.eval(0, weights(0), tok)
    for record in native:  # the native order: the step's record, its weights, its eval
        step = record.step
        rec.train(record)
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
    for name in sorted(held - {"metrics", "samples", "reward_gap"}):
        assert trl_run.read(name) == ours.read(name), name
    for name in ("metrics", "reward_gap"):  # from the rewards: float32 rounding apart (the native tensors)
        for a, b in zip(trl_run.read(name), ours.read(name), strict=True):
            assert sorted(a) == sorted(b) and a == pytest.approx(b, rel=1e-6, abs=1e-9), name
    # the native rows also carry what only the native trainer knows (the advantage it computed); the rest is equal
    a, b = trl_run.read("samples"), ours.read("samples")
    assert len(a) == len(b) > 16
    for x, y in zip(a, b, strict=True):
        adv = y.pop("advantage", None)
        assert adv is not None or x.get("split") == "eval"
        assert sorted(x) == sorted(y)
        assert {k: v for k, v in x.items() if not isinstance(v, float)} == \
            {k: v for k, v in y.items() if not isinstance(v, float)}  # texts, groups, ids, lengths, truncation
        assert {k: v for k, v in x.items() if isinstance(v, float)} == \
            pytest.approx({k: v for k, v in y.items() if isinstance(v, float)}, rel=1e-6, abs=1e-9)
    assert any(r["rel_fro"] > 0 for r in ours.read("displacement"))
    assert {e["step"] for e in ours.read("eval")} == {0, STEPS}
