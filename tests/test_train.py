"""The trainer end to end on the tiny real Llama (stories260K) with a dense toy reward."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.metrics import pass_at_k
from mechdiag.run import RunDir
from mechdiag.train import objective
from mechdiag.train.trainer import Trainer, train
from tests.helpers import assert_bad_input, run_cli

TRAIN_KEYS = ["reward", "reward_cv", "kl", "completion_clipped_ratio", "entropy", "completion_length", "reward_std",
              "frac_zero_std", "policy_clip_fraction", "loss", "grad_norm", "lr", "step_time", "tokens_per_s",
              "reward/correctness"]
EVAL_KEYS = ["accuracy", "eval_reward", "entropy", "completion_length"]


def small(model_dir, *extra) -> list[str]:
    return [f"model.name_or_path={model_dir}", "task.name=tests.toy:Toy", "group_size=4", "prompts_per_step=2",
            "max_completion_tokens=12", "max_prompt_tokens=32", "eval_n=8", "threads=1", "learning_rate=0.01",
            "record.displacement_every=0", "record.shift_at_eval=false", "record.samples_every=1", *extra]


def test_run_directory_contract(stories260k, tmp_path):
    cfg = C.load(None, small(stories260k, "max_steps=3", "save_every=2", "eval_every=2"))
    run = train(cfg, tmp_path / "run")
    metrics = run.read("metrics")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert set(TRAIN_KEYS) <= set(m), set(TRAIN_KEYS) - set(m)
        assert 0.0 <= m["completion_clipped_ratio"] <= 1.0 and m["completion_length"] > 0
    assert metrics[0]["lr"] < metrics[1]["lr"] or metrics[1]["lr"] > metrics[2]["lr"]  # warmup + cosine
    assert any(m["kl"] > 0 for m in metrics[1:])  # the policy left the reference
    evals = run.read("eval")
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert all(set(EVAL_KEYS) <= set(e) for e in evals)
    # eval_samples 1 draws no sample: greedy accuracy is `accuracy`, and nothing is called pass@k
    assert cfg.eval_samples == 1 and not any(k.startswith("pass@") for e in evals for k in e)
    samples = [s for s in run.read("samples") if s["split"] == "train"]
    assert len(samples) == 3 * 2 * 4
    step1 = [s for s in samples if s["step"] == 1]
    assert sorted({s["group"] for s in step1}) == [0, 1]
    for g in (0, 1):  # advantages are centred within each group
        adv = [s["advantage"] for s in step1 if s["group"] == g]
        assert len(adv) == 4 and abs(sum(adv)) < 1e-4
    assert run.checkpoint_steps() == [2]
    assert (run.final / "adapter_model.safetensors").exists()
    # update_norm: how far step 3 moved the adapter, = ||final - checkpoint 2|| over the saved factors (float64)
    from safetensors.torch import load_file

    before, after = (load_file(d / "adapter_model.safetensors") for d in (run.checkpoint(2), run.final))
    moved = math.sqrt(math.fsum(float((after[k].double() - before[k].double()).square().sum()) for k in after))
    assert set(after) == set(before) and moved > 0
    assert metrics[2]["update_norm"] == pytest.approx(moved, rel=1e-9)
    s = run.summary()
    # arith runs no model code: no sandbox was needed
    assert s["steps"] == 3 and s["base_accuracy"] == evals[0]["accuracy"] and s["sandbox"] == "none"
    assert s["final_accuracy"] == evals[-1]["accuracy"]
    assert (run.path / "config.yaml").exists() and C.load(run.path / "config.yaml").max_steps == 3


def test_existing_run_needs_resume(stories260k, tmp_path):
    cfg = C.load(None, small(stories260k, "max_steps=1", "save_every=0"))
    train(cfg, tmp_path / "run")
    with pytest.raises(UserError, match="--resume"):
        train(cfg, tmp_path / "run")


def test_resume_after_kill9_matches_uninterrupted(stories260k, tmp_path):
    cli = run_cli  # real processes: the hook kills its own with SIGKILL
    sets = small(stories260k, "max_steps=5", "save_every=2", "lora.dropout=0.1")
    flags = [x for s in sets for x in ("--set", s)]
    ref = cli("train", *flags, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    killed = cli("train", *flags, "--set", "hooks=[tests.toy:kill_at_3]", "--out", str(tmp_path / "cut"))
    assert killed.returncode == -9
    cut = RunDir(tmp_path / "cut")
    assert [m["step"] for m in cut.read("metrics")] == [1, 2, 3]  # step 3 was written, not checkpointed
    # the resumed run must not be killed again: drop the hook from its saved config
    text = (cut.config_path).read_text().replace("- tests.toy:kill_at_3", "").replace("hooks:\n", "hooks: []\n")
    cut.config_path.write_text(text)
    res = cli("train", "--resume", str(tmp_path / "cut"))
    assert res.returncode == 0, res.stderr
    assert [m["step"] for m in cut.read("metrics")] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in cut.read("eval")] == [0, 5]
    assert sorted({s["step"] for s in cut.read("samples") if s["split"] == "train"}) == [1, 2, 3, 4, 5]
    a = load_file(tmp_path / "ref" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # the adapter did train
    ref_m = [json.dumps(m | {"step_time": 0, "rollout_time": 0, "tokens_per_s": 0})
             for m in RunDir(tmp_path / "ref").read("metrics")]
    cut_m = [json.dumps(m | {"step_time": 0, "rollout_time": 0, "tokens_per_s": 0}) for m in cut.read("metrics")]
    assert ref_m == cut_m


def test_nonfinite_updates_are_skipped_then_stop(stories260k, tmp_path, monkeypatch):
    real = objective.grpo_loss
    calls = {"n": 0}

    def flaky(*a, **kw):
        loss, st = real(*a, **kw)
        calls["n"] += 1
        return (loss * math.nan if calls["n"] in (2, 4, 5, 6) else loss), st

    monkeypatch.setattr(objective, "grpo_loss", flaky)
    cfg = C.load(None, small(stories260k, "max_steps=5", "save_every=0", "max_bad_steps=2"))
    tr = Trainer(cfg, tmp_path / "a")
    before = {k: v.clone() for k, v in tr.model.named_parameters() if v.requires_grad}
    with pytest.warns(UserWarning, match="non-finite"):
        with pytest.raises(UserError, match=r"2 non-finite updates in a row \(last at step 5\)"):
            tr.fit()
    m = tr.run.read("metrics")
    assert [r["skipped_updates"] for r in m] == [0, 1, 0, 1]  # step 5 was the second bad one in a row: stop
    assert m[1]["grad_norm"] is None  # NaN -> null in the JSON
    after = dict(tr.model.named_parameters())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # good steps did update


def test_full_finetune_and_multiple_iterations(stories260k, tmp_path):
    cfg = C.load(None, small(stories260k, "max_steps=2", "save_every=0", "lora.enabled=false", "num_iterations=2",
                             "learning_rate=0.003", "epsilon=0.01"))
    tr = Trainer(cfg, tmp_path / "full")
    assert tr.ref_model is not None and not any(p.requires_grad for p in tr.ref_model.parameters())
    w0 = tr.ref_model.lm_head.weight.clone()
    tr.fit()
    m = tr.run.read("metrics")
    assert m[-1]["kl"] > 0
    assert max(r["policy_clip_fraction"] for r in m) > 0  # second pass: ratios differ from 1, tight clip bites
    assert torch.equal(tr.ref_model.lm_head.weight, w0)  # the reference stays frozen
    assert (tr.run.final / "model.safetensors").exists()


def test_pass_at_k_estimator():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 / 4) * (2 / 3))


def test_cli_dry_run_lists_modules(stories260k, cli):
    p = cli("train", "--dry-run", "--set", f"model.name_or_path={stories260k}", "--set", "lora.layers=first1+last1",
            "--set", "lora.target_modules=[v_proj,o_proj]")
    assert p.returncode == 0, p.stderr
    listed = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("#   ")]
    assert listed == ["model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
                      "model.layers.4.self_attn.v_proj", "model.layers.4.self_attn.o_proj"]
    assert "group_size: 8" in p.stdout


@pytest.mark.parametrize("args", [["--set", "lora.rr=3"], ["--set", "beta=-1"], ["--set", "loss_type=ppo"],
                                  ["--resume", "/nonexistent/run"], ["no_such.yaml"]])
def test_cli_bad_input(args, cli):
    assert_bad_input(cli("train", *args))


def test_cli_bad_module_and_layers(stories260k, cli):
    base = ["train", "--dry-run", "--set", f"model.name_or_path={stories260k}"]
    p = cli(*base, "--set", "lora.target_modules=[v_prj]")
    assert_bad_input(p)
    assert "its adaptable modules are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in p.stderr
    assert_bad_input(cli(*base, "--set", "lora.layers=0-9"))


def test_merged_sampler_equals_the_adapted_model(stories260k, tmp_path):
    from mechdiag.generate import generate

    cfg = C.load(None, small(stories260k, "max_steps=2", "save_every=0", "learning_rate=0.05"))
    tr = Trainer(cfg, tmp_path / "run")
    tr.fit()
    prompts = [tr.task.prompt(ex) for ex in tr.eval_examples[:4]]
    sampler = tr.sampler()
    assert sampler is not tr.model
    with torch.no_grad():
        ids = tr.tokenizer(prompts[0], return_tensors="pt")["input_ids"]
        a, b = sampler(ids).logits, tr.model(input_ids=ids).logits
        with tr.model.disable_adapter():
            base = tr.model(input_ids=ids).logits
    # Merging W + BA changes the order of float32 sums, so logits differ by a few ulps of their own magnitude
    # (|logit| ~ 15 here: 1 ulp ~ 1e-6), not by a fixed 1e-5. 128 ulps of the largest logit bounds that rounding
    # with room over depth and width, and is still far below what two training steps move.
    tol = 128 * torch.finfo(torch.float32).eps * float(b.abs().max())
    gap = float((a - b).abs().max())
    moved = float((b - base).abs().max())
    assert gap <= tol and moved > 10 * tol, (gap, moved, tol)  # merged, and trained
    g1 = generate(sampler, tr.tokenizer, prompts, temperature=0, max_new_tokens=10)
    g2 = generate(tr.model, tr.tokenizer, prompts, temperature=0, max_new_tokens=10)
    assert [g[0].token_ids for g in g1] == [g[0].token_ids for g in g2]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_zero_advantage_rows_skipped_exactly_when_beta_is_zero(stories260k, tmp_path, loss_type):
    from mechdiag.train.rollout import collect, policy_logits

    cfg = C.load(None, small(stories260k, "max_steps=1", "beta=0", f"loss_type={loss_type}", "group_size=2",
                             "prompts_per_step=4", "task.name=tests.toy:Half"))
    tr = Trainer(cfg, tmp_path / "run")
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(0))
    assert 0 < int((roll.advantages == 0).sum()) < len(roll)  # some groups carry no signal
    params = [p for p in tr.model.parameters() if p.requires_grad]
    loss, _ = tr._micro_loss(roll, torch.arange(len(roll)))
    fast = torch.autograd.grad(loss, params)
    logits = policy_logits(tr.model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask,
                           prompt_of=torch.tensor(roll.group_ids))  # the update pass's forward, on every row
    logp = objective.token_logprobs(logits, roll.completion_ids, cfg.temperature)
    full, _ = objective.grpo_loss(logp, None, None, roll.advantages, roll.completion_mask,
                                  objective.Objective(loss_type=loss_type))
    slow = torch.autograd.grad(full, params)
    assert loss.item() == pytest.approx(full.item(), abs=1e-7)
    for a, b in zip(fast, slow, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), (a - b).abs().max()  # float32 passes


def test_dapo_update_is_the_token_mean_of_the_whole_rollout(stories260k, tmp_path):
    """grad_accum 3, uneven lengths, truncated completions masked: the update's gradient (Trainer.update, the real
    micro-batch loop) is that of one token mean over every loss token of the rollout, not a mean of micro-batch
    means (TRL's dapo; bnpo would differ)."""
    from mechdiag.train.rollout import collect, policy_logits

    cfg = C.load(None, small(stories260k, "max_steps=1", "beta=0.02", "loss_type=dapo", "grad_accum=3",
                             "mask_truncated_completions=true", "max_grad_norm=1e9"))
    tr = Trainer(cfg, tmp_path / "run")
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(3), tr.ref_model)
    g = torch.Generator().manual_seed(0)  # stories260K never stops: give the completions EOS-like uneven lengths
    lengths = torch.randint(1, cfg.max_completion_tokens + 1, (len(roll),), generator=g)
    roll.completion_mask = roll.completion_mask * (torch.arange(roll.completion_mask.size(1)) < lengths[:, None])
    roll.truncated = lengths == cfg.max_completion_tokens
    roll.advantages = torch.randn(len(roll), generator=g)
    lmask = roll.completion_mask * (~roll.truncated).float()[:, None]
    per_micro = lmask.view(3, -1).sum(-1)
    assert 0 < int(roll.truncated.sum()) < len(roll) and len(set(per_micro.tolist())) > 1, per_micro
    tr.opt.step = lambda: None  # keep the accumulated gradient
    tr.update(1, roll, [torch.arange(s, s + 8) for s in range(0, 24, 8)], tr.plan(roll))
    params = [p for p in tr.model.parameters() if p.requires_grad]
    got = [p.grad.clone() for p in params]
    logits = policy_logits(tr.model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    logp = objective.token_logprobs(logits, roll.completion_ids, cfg.temperature)
    kl = objective.kl_k3(logp, roll.ref_logp)
    per_token = -torch.exp(logp - logp.detach()) * roll.advantages[:, None] + 0.02 * kl
    want = torch.autograd.grad((per_token * lmask).sum() / lmask.sum(), params)
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), (a - b).abs().max()  # float32 passes


def test_zero_advantage_rows_count_in_the_entropy_quantile_only(stories260k, tmp_path):
    """top_entropy_quantile with beta = 0: rows with A = 0 leave the backward pass but their tokens still set the
    quantile's threshold (a forward without gradient); the loss and gradient are those of every row together."""
    from mechdiag.train.rollout import collect

    cfg = C.load(None, small(stories260k, "max_steps=1", "beta=0", "loss_type=dapo", "group_size=2",
                             "prompts_per_step=4", "task.name=tests.toy:Half", "top_entropy_quantile=0.3"))
    tr = Trainer(cfg, tmp_path / "run")
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(0))
    assert 0 < int((roll.advantages == 0).sum()) < len(roll)
    _assert_pass_equals_full_logits(tr, roll, old_ref=False)


def _assert_pass_equals_full_logits(tr, roll, old_ref: bool) -> None:
    """The trainer's update pass over every row gives the loss and gradient of grpo_loss on the full logits."""
    from mechdiag.train.rollout import policy_logits

    params = [p for p in tr.model.parameters() if p.requires_grad]
    loss, _ = tr._micro_loss(roll, torch.arange(len(roll)))
    fast = torch.autograd.grad(loss, params)
    logits = policy_logits(tr.model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask,
                           prompt_of=torch.tensor(roll.group_ids))
    t = tr.cfg.temperature
    logp = objective.token_logprobs(logits, roll.completion_ids, t) * roll.completion_mask
    full, _ = objective.grpo_loss(logp, roll.old_logp if old_ref else None, roll.ref_logp if old_ref else None,
                                  roll.advantages, roll.completion_mask, tr.objective,
                                  entropy=objective.token_entropy(logits, t))
    slow = torch.autograd.grad(full, params)
    assert loss.item() == pytest.approx(full.item(), rel=1e-5)
    for a, b in zip(fast, slow, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.parametrize("options", [("entropy_coef=0.05", "top_entropy_quantile=0.5"), ("entropy_coef=0.05",)])
def test_entropy_bonus_pass_equals_the_full_logits(stories260k, tmp_path, options):
    """The entropy bonus's update pass (log-probs and entropy from one chunked pass over the head, the entropy's
    gradient included) gives the loss and gradient of the full logits."""
    from mechdiag.train.rollout import collect

    cfg = C.load(None, small(stories260k, "max_steps=1", "loss_type=dapo", "group_size=2", "prompts_per_step=4",
                             "task.name=tests.toy:Half", *options))
    tr = Trainer(cfg, tmp_path / "run")
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(0))
    _assert_pass_equals_full_logits(tr, roll, old_ref=True)


def test_equal_reward_groups_are_skipped_with_beta_zero(stories260k, tmp_path):
    """Issue 14: a group of eight rewards 1.85 (weight 3.7 x 0.5) had float32 advantages ~1e-3, never 0, so the
    beta = 0 shortcut never left those rows out. Now they are exactly 0 and the update pass skips them."""
    from mechdiag.train.rollout import collect

    cfg = C.load(None, small(stories260k, "max_steps=1", "beta=0", "group_size=8", "prompts_per_step=4",
                             "task.name=tests.toy:Half", "rewards.weights={correctness: 3.7}"))
    tr = Trainer(cfg, tmp_path / "run")
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(0))
    r = roll.rewards.view(-1, 8)
    equal = (r == r[:, :1]).all(dim=1)
    assert equal.any() and r[equal].float().mean().item() == pytest.approx(1.85)  # Half's constant groups
    assert (roll.advantages.view(-1, 8)[equal] == 0).all()
    assert int((roll.advantages != 0).sum()) == 8 * int((~equal).sum())  # the rows the update pass keeps


def test_shared_prompt_logprobs_equal_full_forward(stories260k, tmp_path):
    from mechdiag.train.rollout import collect, policy_logits, sequence_logprobs

    cfg = C.load(None, small(stories260k, "max_steps=1", "group_size=3", "prompts_per_step=3"))
    tr = Trainer(cfg, tmp_path / "run")
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(0))
    shared = sequence_logprobs(tr.model, roll, cfg.temperature)
    with torch.no_grad():
        logits = policy_logits(tr.model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    full = objective.token_logprobs(logits, roll.completion_ids, cfg.temperature)
    m = roll.completion_mask.bool()
    assert torch.allclose(shared[m], full[m], atol=1e-5)
    assert torch.allclose(roll.ref_logp[m], full[m], atol=1e-5)  # adapter still zero: reference = policy
    assert torch.allclose(roll.sample_logp[m], full[m], atol=1e-4)  # decode-time log-probs agree too


def test_reference_passes_by_length_equal_one_full_forward(stories260k, tmp_path):
    """Rows whose completions stop early run in their own pass, not padded to the longest (length_passes); the
    log-probs are the full forward's; equal lengths stay one pass."""
    from mechdiag.train.rollout import collect, length_passes, policy_logits, sequence_logprobs

    cfg = C.load(None, small(stories260k, "max_steps=1", "group_size=4", "prompts_per_step=3",
                             "max_completion_tokens=48"))
    tr = Trainer(cfg, tmp_path / "run")
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(0))
    width = roll.completion_ids.size(1)
    keep = torch.tensor([width, 3, 4, 2, 5, 3, width, 2, 4, 3, 2, 5])  # two rows run long, ten stop early
    roll.completion_mask = (torch.arange(width)[None, :] < keep[:, None]).long()
    roll.completion_ids = roll.completion_ids.masked_fill(roll.completion_mask == 0, 0)
    passes = length_passes(roll)
    assert sorted(torch.cat(passes).tolist()) == list(range(12)) and len(passes) >= 2
    assert sorted(passes[0].tolist()) == [0, 6]  # the two long rows together, the others without their padding
    got = sequence_logprobs(tr.model, roll, cfg.temperature)
    with torch.no_grad():
        logits = policy_logits(tr.model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    full = objective.token_logprobs(logits, roll.completion_ids, cfg.temperature) * roll.completion_mask
    assert got.shape == full.shape and (got[roll.completion_mask == 0] == 0).all()
    assert torch.allclose(got, full, atol=1e-5)
    roll.completion_mask = torch.ones_like(roll.completion_mask)
    assert len(length_passes(roll)) == 1


def test_update_pass_runs_each_prompt_once_with_the_same_gradient(stories260k, tmp_path):
    """policy_logits with prompt_of (the update pass) gives the full forward's logits and LoRA gradients, also for
    a subset of rows cutting groups (what the zero-advantage skip keeps)."""
    from mechdiag.train.rollout import collect, policy_logits

    cfg = C.load(None, small(stories260k, "max_steps=1", "group_size=4", "prompts_per_step=3", "lora.r=4"))
    tr = Trainer(cfg, tmp_path / "run")
    with torch.no_grad():  # a non-zero adapter, so the gradient reaches A too
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), cfg, torch.Generator().manual_seed(0))
    tr.model.train()
    params = [p for p in tr.model.parameters() if p.requires_grad]
    for rows in (torch.arange(len(roll)), torch.tensor([0, 2, 3, 5, 9, 10, 11])):
        mb = roll.select(rows)
        out = []
        for prompt_of in (None, torch.tensor(mb.group_ids)):
            tr.model.zero_grad(set_to_none=True)
            logits = policy_logits(tr.model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
                                   prompt_of=prompt_of)
            logp = objective.token_logprobs(logits, mb.completion_ids, cfg.temperature)
            (logp * mb.completion_mask).sum().backward()
            out.append((logp.detach(), [p.grad.clone() for p in params]))
        (full, g_full), (shared, g_shared) = out
        m = mb.completion_mask.bool()
        assert torch.allclose(shared[m], full[m], atol=1e-5)
        for a, b in zip(g_shared, g_full, strict=True):  # float32: ~1e-5 apart (the backward sums in another order)
            assert float((a - b).norm()) <= 1e-4 * float(b.norm())
        assert any(float(g.abs().sum()) > 0 for g in g_full)


def test_time_budget_stops_early_and_evaluates_the_last_model(stories260k, tmp_path):
    cfg = C.load(None, small(stories260k, "max_steps=5", "save_every=0", "max_time_s=0.001"))
    with pytest.warns(UserWarning, match="max_time_s"):
        run = train(cfg, tmp_path / "run")
    s = run.summary()
    assert s["steps"] == 1 and s["planned_steps"] == 5
    assert [e["step"] for e in run.read("eval")] == [0, 1]


def test_reference_sync_is_trl_s_mixup_and_is_checkpointed(stories260k, tmp_path):
    """sync_ref_model (full fine-tuning, beta > 0): after every update pi_ref <- alpha pi_theta + (1 - alpha) pi_ref,
    TRL's own SyncRefModelCallback arithmetic; the moved reference is saved with the checkpoint and resumed."""
    import copy

    from trl.trainer.callbacks import SyncRefModelCallback

    cfg = C.load(None, small(stories260k, "lora.enabled=false", "beta=0.05", "sync_ref_model=true",
                             "ref_model_sync_steps=1", "ref_model_mixup_alpha=0.6", "max_steps=2", "eval_n=2"))
    tr = Trainer(cfg, tmp_path / "run")
    ref0 = copy.deepcopy(tr.ref_model)
    tr.train_step(1)
    tr.save_checkpoint(1)
    SyncRefModelCallback._sync_target_model(tr.model, ref0, 0.6)  # TRL's update of the step-0 reference
    moved = [(a - b).abs().max() for a, b in zip(tr.ref_model.parameters(), ref0.parameters(), strict=True)]
    assert max(moved) == 0
    assert any((a - b).abs().max() > 0 for a, b in zip(tr.ref_model.parameters(), tr.model.parameters(), strict=True))
    again = Trainer(cfg, tmp_path / "run", resume=True)
    pairs = zip(again.ref_model.parameters(), tr.ref_model.parameters(), strict=True)
    assert again.step == 1 and all(torch.equal(a, b) for a, b in pairs)


def test_step_record_carries_the_controller_and_the_sampler_gap(stories260k, tmp_path):
    """steps_per_generation 2 at grad_accum 1: two updates on one rollout; the adaptive entropy coefficient after
    each (the entropy stays under a target of 100 nats, so each adds delta) reaches the step record as their mean
    and metrics.jsonl's record through recorder.step_metrics, with the first update's sampler gap."""
    from mechdiag.metrics import SAMPLER_KEYS
    from mechdiag.recorder import step_metrics

    cfg = C.load(None, small(stories260k, "max_steps=1", "steps_per_generation=2", "use_adaptive_entropy=true",
                             "entropy_coef=0.01", "entropy_coef_delta=0.005", "entropy_target=100", "eval_n=2"))
    tr = Trainer(cfg, tmp_path / "run")
    record, roll = tr.train_step(1)
    assert len(roll) == 2 * cfg.prompts_per_step * cfg.group_size and tr.sched.last_epoch == 2
    assert tr.entropy_coef == pytest.approx(0.02) and record.update.entropy_coef == pytest.approx(0.0175)
    m = step_metrics(record)
    assert m["entropy_coef"] == pytest.approx(0.0175)
    assert set(SAMPLER_KEYS) - {"sampler_masked_fraction"} <= set(m) and m["sampler_logp_diff"] < 1e-4


def test_random_reward_control_pays_the_coin_alone_and_logs_the_task(stories260k, tmp_path):
    """rewards.control: random (the Spurious-rewards control): each completion's reward is its coin, a fixed
    function of (seed, example, text) with even odds, blind to correctness; the task's components are still
    scored and logged at weight 0, and config.yaml says so. The same through TRL's reward functions."""
    from mechdiag.integrations.trl import task_reward_funcs
    from mechdiag.tasks import resolve_rewards
    from mechdiag.tasks.rewards import coin
    from mechdiag.train.rollout import collect

    cfg = resolve_rewards(C.load(None, small(stories260k, "max_steps=1", "group_size=8", "prompts_per_step=4",
                                             "rewards.control=random", "temperature=2.0")))
    w = cfg.rewards.weights
    assert w["random"] == 1.0 and w["correctness"] == 0.0 and set(w.values()) == {0.0, 1.0}
    tr = Trainer(cfg, tmp_path / "run")
    examples = tr.batch(1)
    roll = collect(tr.model, tr.tokenizer, tr.task, examples, cfg, torch.Generator().manual_seed(0))
    coins = [coin(cfg.seed, roll.example_ids[i], t) for i, t in enumerate(roll.texts)]
    assert roll.rewards.tolist() == coins and roll.components["random"].tolist() == coins
    assert "correctness" in roll.components and 0 < sum(coins) < len(coins)
    # the coin is fair and ignores the text's content: over many texts, about half pay
    many = [coin(7, "e", f"<answer>{i}</answer>") for i in range(4000)]
    assert abs(sum(many) / len(many) - 0.5) < 0.03
    funcs, weights = task_reward_funcs(tr.task, examples, cfg.rewards.weights, cfg.seed)
    by_name = dict(zip([f.__name__ for f in funcs], weights, strict=True))
    assert by_name["random"] == 1.0 and by_name["correctness"] == 0.0 and set(by_name.values()) == {0.0, 1.0}
    got = next(f for f in funcs if f.__name__ == "random")(completions=roll.texts, example_id=roll.example_ids)
    assert got == coins
    with pytest.raises(Exception, match="control"):
        C.load(None, ["rewards.control=sometimes"])
