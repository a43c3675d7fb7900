"""TRL integration on CPU with trl installed: the callback inside a real GRPOTrainer run, the readers of TRL and
verl runs, `mechdiag train --backend trl`, and objective parity of the two backends on one batch."""

from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
import torch

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.integrations.readers.verl_log import map_verl, read_verl_run
from mechdiag.integrations.trl import GroupCV, MechdiagCallback, config_from_grpo, grpo_args, read_trl_run
from mechdiag.integrations.trl_args import SAME_FIELDS
from mechdiag.outcomes import group_stats
from mechdiag.run import RunDir
from mechdiag.train import objective
from tests.helpers import assert_bad_input, invoke_cli
from tests.test_user_signals import RewardGap

torch.set_num_threads(1)
STEPS = 5


@pytest.fixture
def cli():
    """The CLI in this process (click's runner): the same commands and exit codes, without a fresh interpreter
    paying torch/transformers imports for every call."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    from mechdiag.cli import main

    def run(*args):
        r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        return SimpleNamespace(returncode=r.exit_code, stdout=r.stdout, stderr=r.stderr)

    return run


def _letter_a(prompts=None, completions=None, **_):
    """A dense reward (share of 'a' among letters) so every group has spread."""
    out = []
    for c in completions:
        letters = [ch for ch in c.lower() if ch.isalpha()]
        out.append(letters.count("a") / len(letters) if letters else 0.0)
    return out


def _length(prompts=None, completions=None, **_):
    return [min(len(c), 40) / 40 for c in completions]


@pytest.fixture(scope="module")
def trl_run(stories260k, tmp_path_factory):
    """A user's TRL run: GRPOTrainer + MechdiagCallback, two plain reward functions (so reward_cv must come from
    the completions parquet), an eval at the last step, a checkpoint at step 5."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    out = tmp_path_factory.mktemp("trl") / "out"
    tok = AutoTokenizer.from_pretrained(stories260k)
    tok.pad_token_id = 0
    model = AutoModelForCausalLM.from_pretrained(stories260k)
    data = Dataset.from_list([{"prompt": f"Once upon a time, story {i}"} for i in range(32)])
    args = GRPOConfig(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=10, logging_steps=1, save_steps=STEPS, bf16=False,
                      gradient_checkpointing=False, use_cpu=True, loss_type="grpo", beta=0.02, learning_rate=5e-3,
                      log_completions=True, num_completions_to_print=1, report_to=[], seed=3, eval_strategy="steps",
                      eval_steps=STEPS, per_device_eval_batch_size=8, reward_weights=[1.0, 0.5])
    # an interval the run never reaches: the last step is recorded anyway (final diagnostics)
    cb = MechdiagCallback(displacement_every=STEPS + 1, shift_prompts=["Once upon a time", "The cat sat on"],
                          signals=[RewardGap()])
    trainer = GRPOTrainer(model=model, reward_funcs=[_letter_a, _length], args=args, train_dataset=data,
                          eval_dataset=data.select(range(2)), processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"), callbacks=[cb])
    trainer.train()
    return out, cb


def cb_log_history(out):
    return json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["log_history"]


def _parquet_cv(path, weights):
    """reward_cv by hand from one completions parquet: weighted reward, std/|mean| per prompt, mean."""
    df = pd.read_parquet(path)
    df["r"] = sum(df[k] * w for k, w in weights.items())
    g = df.groupby("prompt")["r"]
    cv = (g.std(ddof=1) / g.mean().abs()).mean()
    return float(cv)


def test_callback_records_run(trl_run):
    out, cb = trl_run
    run = RunDir(out / "mechdiag")
    metrics = run.read("metrics")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for key in ("reward", "reward_std", "kl", "entropy", "completion_length", "completion_clipped_ratio",
                "policy_clip_fraction", "loss", "grad_norm", "lr", "reward/_letter_a", "reward/_length"):
        assert all(key in m for m in metrics), key
    assert all(m["policy_clip_fraction"] == 0.0 for m in metrics)  # num_iterations 1: ratio exactly 1
    # the step's weight change, measured by the callback around TRL's optimizer step (one process)
    assert all(m["update_norm"] > 0 and math.isfinite(m["update_norm"]) for m in metrics)
    # computed from the step's completions (the parquet, GRPOConfig.reward_weights): the reward equals TRL's own
    # logged mean at every step, the eval step included (TRL then writes the eval's completions over the file);
    # reward_cv as computed by hand where the file still holds the step's
    logged = {h["step"]: h for h in cb_log_history(out) if "loss" in h}
    for m in metrics:
        assert m["reward"] == pytest.approx(logged[m["step"]]["reward"], rel=1e-6), m["step"]
        path = out / "completions" / f"completions_{m['step']:05d}.parquet"
        if m["step"] < STEPS:
            expect = _parquet_cv(path, {"_letter_a": 1.0, "_length": 0.5})
            assert math.isclose(m["reward_cv"], expect, rel_tol=1e-9), (m["step"], m["reward_cv"], expect)
        assert m["reward_cv"] != pytest.approx(m["reward_std"] / m["reward"])  # group CV, not batch std / mean
    samples = run.read("samples")
    assert len(samples) == STEPS * 8 and {s["group"] for s in samples if s["step"] == 1} == {0, 1}
    cfg = C.load(run.config_path)  # derived from GRPOConfig + the peft config
    assert (cfg.group_size, cfg.beta, cfg.lora.r, cfg.lora.alpha) == (4, 0.02, 4, 8.0)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.rewards.weights == {"_letter_a": 1.0,
                                                                                          "_length": 0.5}
    evals = run.read("eval")
    assert [e["step"] for e in evals] == [STEPS] and "eval_reward" in evals[0] and "entropy" in evals[0]
    shift = run.read("shift")
    assert sorted(r["layer"] for r in shift) == list(range(5)) and all(r["step"] == STEPS for r in shift)
    assert {r["step"] for r in run.read("displacement")} == {STEPS}  # interval STEPS + 1: the last step anyway
    assert any(r["shift"] > 0 for r in shift)
    s = run.summary()
    assert s["steps"] == STEPS and 0 < s["recorder_s"] <= cb.recorder_s  # the time spent in the callback
    assert 0 < s["recorder_once_s"] < s["recorder_s"]  # its once-per-run part (start, final record) within it
    gaps = [r for r in run.read("reward_gap") if "gap" in r]  # a user signal through signals=, as natively
    assert [r["step"] for r in gaps] == [m["step"] for m in metrics]
    assert [r["gap"] for r in gaps] == [max(v for k, v in m.items() if k.startswith("reward/")) - m["reward"]
                                        for m in metrics]


def test_displacement_rows_equal_checkpoint(trl_run, stories260k, cli, tmp_path):
    out, _ = trl_run
    rows = [r for r in RunDir(out / "mechdiag").read("displacement") if r["step"] == STEPS]
    assert len(rows) == 10 and {r["module"] for r in rows} == {"q_proj", "v_proj"}
    proc = cli("displacement", str(stories260k), str(out / f"checkpoint-{STEPS}"), "--format", "json", "--spectral")
    assert proc.returncode == 0, proc.stderr
    ck = {r["name"]: r for r in json.loads(proc.stdout)}
    for r in rows:
        assert r["delta_fro"] > 0
        for col in ("ref_fro", "delta_fro", "rel_fro", "subspace_overlap"):  # the final step carries the geometry
            assert abs(r[col] - ck[r["name"]][col]) <= 1e-5 * abs(ck[r["name"]][col]), (r["name"], col)
        assert (r["overlap_k"], r["intruders"]) == (ck[r["name"]]["overlap_k"], ck[r["name"]]["intruders"]) \
            and r["overlap_k"] == 4


def test_read_trl_run_with_and_without_callback(trl_run, tmp_path):
    out, _ = trl_run
    rd = read_trl_run(out, into=RunDir(tmp_path / "with", create=True))
    assert rd.read("metrics") == RunDir(out / "mechdiag").read("metrics")
    assert rd.summary()["source"] == "trl"
    # the same output_dir as TRL alone left it: rebuilt from log_history, parquet and checkpoint adapters
    bare = tmp_path / "bare"
    shutil.copytree(out, bare, ignore=shutil.ignore_patterns("mechdiag"))
    plain = read_trl_run(bare, into=tmp_path / "plain", reward_weights={"_letter_a": 1.0, "_length": 0.5})
    got, ref = plain.read("metrics"), rd.read("metrics")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for a, b in zip(got[:-1], ref[:-1], strict=True):  # the last (eval) step's file holds the eval's completions
        for key in ("reward_cv", "kl", "entropy", "completion_clipped_ratio"):
            assert a[key] == pytest.approx(b[key], rel=1e-9), key
        for key in ("reward", "reward/_length"):  # TRL's logged float32 means against ours from the completions
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
    cb_rows = {r["name"]: r for r in rd.read("displacement")}
    ck_rows = plain.read("displacement")
    assert len(ck_rows) == len(cb_rows) and all(r["step"] == STEPS for r in ck_rows)
    for r in ck_rows:
        assert r["delta_fro"] == pytest.approx(cb_rows[r["name"]]["delta_fro"], rel=1e-5)
    assert [e["step"] for e in plain.read("eval")] == [STEPS]
    assert C.load(plain.config_path).lora.r == 4  # from adapter_config.json
    with pytest.raises(UserError, match="already holds"):
        read_trl_run(bare, into=tmp_path / "plain")
    with pytest.raises(UserError, match="not a TRL output directory"):
        read_trl_run(tmp_path / "plain" / "..", into=tmp_path / "x")


def test_recommend_and_report_on_trl_output_dir(trl_run, cli, tmp_path):
    out, _ = trl_run
    proc = cli("recommend", str(out), "--format", "json", "--out", str(tmp_path / "refined.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout), list)
    assert C.load(tmp_path / "refined.yaml").group_size == 4
    proc = cli("report", str(out), "--out", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    html = (tmp_path / "r.html").read_text()
    assert "<span class=tag>trl</span>" in html


def test_attribute_refuses_a_callback_run_without_a_task(trl_run, tmp_path):
    """The callback derived its config from the GRPOConfig (no config=): there are no held-out problems of the run
    to attribute on, so it says how to record one instead of evaluating some default task."""
    out, _ = trl_run
    assert RunDir(out / "mechdiag").summary()["config_derived"] is True
    proc = invoke_cli("attribute", str(out))
    assert_bad_input(proc)
    assert 'evaluate="heldout"' in proc.stderr


# ---- the two backends ---------------------------------------------------------------------------------------
def _small(model_dir, *extra) -> list[str]:
    return [f"model.name_or_path={model_dir}", "task.name=tests.toy:Toy", "group_size=4", "prompts_per_step=2",
            "max_completion_tokens=8", "max_prompt_tokens=32", "eval_n=4", "threads=1", "learning_rate=0.01",
            "record.shift_n=2", *extra]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_same_objective_both_backends(stories260k, tmp_path, loss_type):
    from mechdiag.integrations.trl import build_trainer
    from mechdiag.train.rollout import policy_logits

    cfg = C.load(None, _small(stories260k, f"loss_type={loss_type}", "beta=0.05", "epsilon=0.2",
                              "epsilon_high=0.28", "temperature=0.7", "num_iterations=2", "max_steps=2"))
    trainer, _, _ = build_trainer(cfg, tmp_path / "run")
    model = trainer.model
    with torch.no_grad():  # a trained-looking adapter, so the policy is not the reference
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(n) % 1000))
    model.eval()
    g = torch.Generator().manual_seed(0)
    B, P, T = 8, 6, 7
    prompt_ids = torch.randint(3, 500, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    completion_ids = torch.randint(3, 500, (B, T), generator=g)
    lengths = torch.tensor([7, 3, 5, 7, 1, 6, 4, 2])
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    rewards = torch.rand(B, generator=g)
    adv = objective.group_advantages(rewards, cfg.group_size, cfg.scale_rewards)
    with torch.no_grad():
        logp0 = objective.token_logprobs(policy_logits(model, prompt_ids, prompt_mask, completion_ids,
                                                       completion_mask), completion_ids, cfg.temperature)
    old = logp0 + 0.3 * torch.randn(B, T, generator=g)  # ratios away from 1: the clip is active
    ref = logp0 + 0.2 * torch.randn(B, T, generator=g)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": adv, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum()}
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(model, inputs))
        logp = objective.token_logprobs(policy_logits(model, prompt_ids, prompt_mask, completion_ids,
                                                      completion_mask), completion_ids, cfg.temperature)
        ours, stats = objective.grpo_loss(logp, old, ref, adv, completion_mask, objective.Objective.of(cfg))
    assert stats["policy_clip_fraction"] > 0 and stats["kl"] > 0
    assert abs(trl_loss - float(ours)) <= 1e-5 * max(1.0, abs(float(ours))), (trl_loss, float(ours))
    assert trainer.args.epsilon_high == 0.28 and trainer.args.num_iterations == 2 and trainer.args.max_steps == 4


def test_backend_trl_cli(stories260k, cli, tmp_path):
    out = tmp_path / "run"
    proc = cli("train", "--backend", "trl", "--out", str(out), "--max-steps", "3",
               *[a for s in _small(stories260k, "record.displacement_every=3", "save_every=3", "eval_every=2",
                                         "beta=0.02")
                 for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "base accuracy" in proc.stdout and str(out) in proc.stdout
    assert "{'" not in proc.stdout + proc.stderr and "train step: 3/3" in proc.stderr  # progress lines, no dicts
    run = RunDir(out)
    metrics = run.read("metrics")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(0 <= m["reward_cv"] and "reward/correctness" in m and "kl" in m for m in metrics)  # GroupCV logged
    assert [e["step"] for e in run.read("eval")] == [0, 2, 3] and "accuracy" in run.read("eval")[0]
    assert {r["step"] for r in run.read("displacement")} == {3} and run.read("shift")
    assert (out / "trl" / "checkpoint-3" / "adapter_model.safetensors").exists()
    assert (out / "final" / "adapter_model.safetensors").exists()
    assert C.load(run.config_path).max_steps == 3
    s = run.summary()
    assert s["source"] == "trl" and s["steps"] == 3 and "base_accuracy" in s
    proc = cli("recommend", str(out), "--format", "json")
    assert proc.returncode == 0, proc.stderr


def test_backend_trl_bad_input(stories260k, cli, tmp_path, monkeypatch):
    cfg = C.load(None, _small(stories260k, "group_size=3", "prompts_per_step=1"))
    with pytest.raises(UserError, match="does not split over 2 processes"):
        grpo_args(cfg, tmp_path, n_processes=2)
    proc = cli("train", "--backend", "trl", "--out", str(tmp_path / "r"), "--set", "lora.target_modules=[qq_proj]",
               *[a for s in _small(stories260k) for a in ("--set", s)])
    assert_bad_input(proc)
    assert not (tmp_path / "r").exists()  # refused before anything was written
    proc = cli("train", "--backend", "trl", "--trl", "num_generation=4", "--set", f"model.name_or_path={stories260k}")
    assert_bad_input(proc)
    assert "did you mean num_generations" in proc.stderr
    assert_bad_input(cli("train", "--trl", "top_k=5"))
    proc = cli("train", "--backend", "trl", "--dry-run", "--trl", "top_k=5", "--trl", "beta=0.5",
               *[a for s in _small(stories260k) for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("# TRL GRPOConfig:"))
    assert "num_generations=4" in line and "per_device_train_batch_size=8" in line and "beta=0.5" in line


def test_config_round_trip(stories260k, tmp_path):
    """Our Config -> GRPOConfig -> Config keeps every key TRL has."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from mechdiag.integrations.trl import peft_lora_config

    cfg = C.load(None, _small(stories260k, "beta=0.01", "epsilon_high=0.3", "temperature=0.9", "grad_accum=2",
                              "lora.layers=first2+last2", "lora.target_modules=[v_proj,o_proj]", "max_steps=7",
                              "lr_schedule=linear", "top_p=0.95", "save_every=3", "report_to=[tensorboard]",
                              # TRL 1.16's options, none at its default: each passes through and back
                              "importance_sampling_level=sequence", "delta=1.5", "mask_truncated_completions=true",
                              "top_entropy_quantile=0.2", "entropy_coef=0.01", "use_bias_correction_kl=true",
                              "multi_objective_aggregation=normalize_then_sum", "off_policy_mask_threshold=0.5",
                              "sapo_temperature_neg=1.2", "vespo_k_pos=1.5", "top_k=5",
                              "min_p=0.05", "repetition_penalty=1.1"))
    model = AutoModelForCausalLM.from_pretrained(stories260k)
    model = get_peft_model(model, peft_lora_config(model, cfg.lora))
    back = config_from_grpo(grpo_args(cfg, str(tmp_path)), model, ["correctness"])
    for key in ("group_size", "prompts_per_step", "grad_accum", "beta", "epsilon", "epsilon_high", "temperature",
                "top_p", "learning_rate", "lr_schedule", "max_steps", "max_completion_tokens", "seed", "save_every",
                "loss_type", "scale_rewards", "adam_beta2", "weight_decay", "max_grad_norm", "report_to",
                *SAME_FIELDS):
        assert getattr(back, key) == getattr(cfg, key), key
    # two updates a rollout: TRL counts updates, so its max_steps (read back as the run's steps) doubles
    minis = cfg.model_copy(update={"steps_per_generation": 4})
    back = config_from_grpo(grpo_args(minis, str(tmp_path)), model, ["correctness"])
    assert (back.steps_per_generation, back.grad_accum, back.max_steps) == (4, 2, 14)
    assert back.lora.layers == [0, 1, 3, 4] and back.lora.target_modules == ["o_proj", "v_proj"]
    assert (back.lora.r, back.lora.alpha) == (cfg.lora.r, cfg.lora.alpha)


# ---- GroupCV and the statistics -----------------------------------------------------------------------------
def test_group_cv_wrapper_matches_objective():
    g = torch.Generator().manual_seed(1)
    comps = torch.rand(12, 2, generator=g)
    comps[4:8] = 0.5  # one all-equal group
    weights = [2.0, 0.5]
    logged = {}
    funcs = [lambda prompts=None, completions=None, i=i, **_: comps[:, i].tolist() for i in range(2)]
    cv = GroupCV(funcs, weights, group_size=4)
    prompts = [f"p{i // 4}" for i in range(12)]
    completions = [f"c{i}" for i in range(12)]
    for f in cv.funcs:
        f(prompts=prompts, completions=completions, log_metric=lambda k, v: logged.__setitem__(k, v))
    totals = (comps.double() @ torch.tensor(weights, dtype=torch.float64)).tolist()
    ref = group_stats(totals, [i // 4 for i in range(12)])
    assert logged["reward_cv"] == pytest.approx(ref["reward_cv"], rel=1e-6)
    assert logged["group_frac_zero_std"] == pytest.approx(ref["frac_zero_std"]) == pytest.approx(1 / 3)
    # the batch is the step record's rollout: each function's values, the weighted total, contiguous groups
    roll = cv.take()
    assert roll["group_ids"] == [i // 4 for i in range(12)] and roll["texts"] == completions
    assert roll["rewards"] == pytest.approx(totals, rel=1e-12) and cv.take() is None  # taken once
    # grouping by prompt text gives the same when groups are contiguous
    assert group_stats(totals, prompts)["reward_cv"] == pytest.approx(ref["reward_cv"], rel=1e-6)
    with pytest.raises(UserError, match="2 weights for 1"):
        GroupCV(funcs[:1], weights)


# ---- verl ---------------------------------------------------------------------------------------------------
def _verl_files(tmp_path):
    folder = tmp_path / "verl"
    (folder / "rollouts").mkdir(parents=True)
    lines = [{"step": 0, "data": {"val-core/gsm8k/acc/mean@1": 0.2, "val-core/math/acc/mean@1": 0.4,
                                  "val-core/gsm8k/reward/mean@1": 0.25}}]
    for s in range(1, 6):
        data = {"critic/score/mean": 0.1 * s, "critic/rewards/mean": 0.1 * s - 0.01, "actor/kl_loss": 0.001 * s,
                "actor/pg_clipfrac": 0.0, "response_length/mean": 100.0 + s, "response_length/clip_ratio": 0.05,
                "actor/pg_loss": -0.1, "actor/grad_norm": 0.3, "actor/lr": 1e-6, "timing_s/step": 12.0}
        if s == 5:
            data.update({"val-core/gsm8k/acc/mean@1": 0.3, "val-core/math/acc/mean@1": 0.5,
                         "val-core/gsm8k/acc/best@4/mean": 0.6, "val-core/math/acc/best@4/mean": 0.8})
        lines.append({"step": s, "data": data})
        rows = [{"input": f"q{k}", "output": f"a{k}{j}", "score": float((j + k + s) % 3 == 0)}
                for k in range(2) for j in range(4)]
        (folder / "rollouts" / f"{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_read_verl_run(tmp_path):
    folder = _verl_files(tmp_path)
    rd = read_verl_run(folder / "metrics.jsonl", into=tmp_path / "run", rollout_dir=folder / "rollouts")
    metrics = rd.read("metrics")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    m = metrics[2]
    assert (m["reward"], m["kl"], m["completion_length"], m["completion_clipped_ratio"]) == \
        pytest.approx((0.3, 0.003, 103.0, 0.05))
    assert "entropy" not in m  # verl did not log it: missing, not 0
    scores = [float((j + k + 3) % 3 == 0) for k in range(2) for j in range(4)]
    expect = group_stats(scores, [k for k in range(2) for _ in range(4)])
    assert m["reward_cv"] == pytest.approx(expect["reward_cv"]) and m["frac_zero_std"] == expect["frac_zero_std"]
    evals = rd.read("eval")
    assert [e["step"] for e in evals] == [0, 5]
    assert evals[0]["accuracy"] == pytest.approx(0.3) and evals[1]["pass@4"] == pytest.approx(0.7)
    assert evals[1]["accuracy/math"] == pytest.approx(0.5)
    assert len(rd.read("samples")) == 5 * 8
    assert map_verl({"actor/entropy_loss": 1.5})[0] == {"entropy": 1.5}  # older verl name


def test_recommend_and_report_on_verl(tmp_path, cli):
    folder = _verl_files(tmp_path)
    proc = cli("recommend", str(folder / "metrics.jsonl"), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    proc = cli("report", str(folder), "--out", str(tmp_path / "v.html"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "v.html").stat().st_size > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "data": {}}\n{"step": 2}\n{"step": 3, "data": {}}\n')
    with pytest.raises(UserError, match="not a verl file-logger line"):
        read_verl_run(bad, into=tmp_path / "b")
    assert_bad_input(cli("recommend", str(bad)))
