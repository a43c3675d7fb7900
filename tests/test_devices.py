"""Devices and precision of the native trainer: device resolution (one function, mechdiag.models.device),
a device that is not here refused before any heavy work, bfloat16 end to end with float32 log-probs and loss,
and gradient checkpointing (the same loss and gradient)."""

from __future__ import annotations

import pytest
import torch

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.models import device
from mechdiag.recorder import step_metrics
from mechdiag.train.trainer import Trainer
from tests.helpers import assert_bad_input

torch.set_num_threads(1)


def small(model_dir, *extra) -> list[str]:
    return [f"model.name_or_path={model_dir}", "task.name=tests.toy:Toy", "group_size=4", "prompts_per_step=2",
            "max_completion_tokens=12", "max_prompt_tokens=32", "eval_n=8", "threads=1", "learning_rate=0.01",
            "record.shift_at_eval=false", "save_every=0", *extra]


def test_device_here():
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert device("auto") == auto and device(None) == auto and device("") == auto
    assert device("cpu") == "cpu"
    for bad in ("tpu", "cuda:x", "gpu0", " CPU "):
        with pytest.raises(UserError, match="use auto, cpu, cuda, cuda:N or mps"):
            device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("args", [
    ["train", "--device", "cuda", "--max-steps", "1"],
    ["train", "--device", "cuda:1", "--backend", "trl", "--max-steps", "1"],
    ["train", "--set", "device=mps", "--dry-run"],
    ["train", "--device", "tpu"],
])
def test_train_refuses_a_missing_device_before_work(args, cli, tmp_path):
    p = cli(*args, "--out", str(tmp_path / "run"))
    assert_bad_input(p)
    assert "device" in p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_shift_and_eval_refuse_a_missing_device(stories260k, cli, tmp_path):
    p = cli("shift", stories260k, stories260k, "--task", "arith", "--n", "2", "--device", "cuda:0")
    assert_bad_input(p)
    assert "CUDA" in p.stderr
    p = cli("eval", stories260k, "--task", "arith", "--n", "2", "--device", "cuda",
            "--out", str(tmp_path / "ev"))
    assert_bad_input(p)
    assert "CUDA" in p.stderr and not (tmp_path / "ev").exists()


def test_trainer_places_model_on_the_resolved_device(stories260k, tmp_path):
    tr = Trainer(C.load(None, small(stories260k, "max_steps=1", "device=cpu")), tmp_path / "run")
    assert tr.device == torch.device("cpu")
    assert {p.device for p in tr.model.parameters()} == {torch.device("cpu")}


def test_bfloat16_end_to_end_keeps_float32_where_it_matters(stories260k, tmp_path):
    from mechdiag.generate import step_seed
    from mechdiag.train.rollout import collect, policy_logits

    args = ("max_steps=2", "beta=0.04", "record.displacement_every=1")
    tr = Trainer(C.load(None, small(stories260k, *args, "model.dtype=bfloat16")), tmp_path / "bf16")
    ref = Trainer(C.load(None, small(stories260k, *args)), tmp_path / "fp32")
    base_w = {p.dtype for n, p in tr.model.named_parameters() if "lora_" not in n}
    lora_w = {p.dtype for n, p in tr.model.named_parameters() if "lora_" in n}
    assert base_w == {torch.bfloat16} and lora_w == {torch.float32}  # the trained factors keep full precision
    roll = collect(tr.model, tr.tokenizer, tr.task, tr.batch(1), tr.cfg,
                   torch.Generator().manual_seed(step_seed(tr.cfg.seed, 1)), sampler=tr.sampler())
    for t in (roll.sample_logp, roll.ref_logp, roll.sample_entropy, roll.advantages):
        assert t.dtype == torch.float32
    tr.model.train()
    loss, _ = tr._micro_loss(roll, torch.arange(len(roll)))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    grads = torch.autograd.grad(loss, [p for p in tr.model.parameters() if p.requires_grad])
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    with torch.no_grad():  # bf16 log-probs of the same tokens stay close to the float32 model's
        lp = [objective_logp(t.model, roll, policy_logits) for t in (tr, ref)]
    m = roll.completion_mask.bool()
    assert (lp[0][m] - lp[1][m]).abs().mean() < 0.05
    run = tr.fit()
    metrics = run.read("metrics")
    assert [r["step"] for r in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r[k])) for r in metrics for k in ("reward", "grad_norm", "kl", "loss"))
    disp = run.read("displacement")
    assert {r["step"] for r in disp} == {1, 2} and all(r["rel_fro"] >= 0 for r in disp)
    assert run.summary()["memory"]["weights_bytes"] < ref.memory["weights_bytes"]


def objective_logp(model, roll, policy_logits):
    from mechdiag.train import objective

    logits = policy_logits(model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    return objective.token_logprobs(logits, roll.completion_ids)


def test_gradient_checkpointing_same_loss_and_gradient(stories260k, tmp_path):
    from mechdiag.train.rollout import collect

    args = ("max_steps=1", "beta=0.04", "lora.dropout=0")
    plain = Trainer(C.load(None, small(stories260k, *args)), tmp_path / "plain")
    ckpt = Trainer(C.load(None, small(stories260k, *args, "gradient_checkpointing=true")), tmp_path / "ckpt")
    roll = collect(plain.model, plain.tokenizer, plain.task, plain.batch(1), plain.cfg,
                   torch.Generator().manual_seed(0))
    out = []
    for tr in (plain, ckpt):
        saved: list[int] = []  # tensors autograd keeps from the forward; checkpointed layers keep their inputs

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        tr.model.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = tr._micro_loss(roll, torch.arange(len(roll)))
        params = [p for p in tr.model.parameters() if p.requires_grad]
        out.append((loss.detach(), torch.autograd.grad(loss, params), sum(saved)))
    (l0, g0, s0), (l1, g1, s1) = out
    assert s1 < s0 / 2  # checkpointing is on: under half the activations are kept
    assert torch.allclose(l0, l1, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in g0)
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_sampler_choice_and_its_memory(stories260k, tmp_path):
    from mechdiag.train.trainer import SAMPLER_AUTO_MAX_PARAMS, sampler_choice

    auto = Trainer(C.load(None, small(stories260k, "max_steps=1")), tmp_path / "auto")
    assert auto.memory["sampler"] == "merged"  # a tiny model: the copy pays
    assert auto.memory["sampler_bytes"] == auto.memory["weights_bytes"] - sum(
        p.numel() * 4 for n, p in auto.model.named_parameters() if "lora_" in n)
    off = Trainer(C.load(None, small(stories260k, "max_steps=1", "sampler=adapter")), tmp_path / "off")
    assert off._sampler is None and off.sampler() is off.model and off.memory["sampler_bytes"] == 0
    cfg = C.load(None, ["sampler=auto"])
    assert sampler_choice(cfg, SAMPLER_AUTO_MAX_PARAMS) == "merged"
    assert sampler_choice(cfg, 358_000_000) == "adapter"  # the 0.5B shape: not worth a second copy
    assert sampler_choice(C.load(None, ["sampler=merged"]), 358_000_000) == "merged"
    assert sampler_choice(C.load(None, ["sampler=merged", "lora.enabled=false"]), 1000) == "adapter"
    with pytest.raises(UserError, match="sampler"):
        C.load(None, ["sampler=copy"])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_update_split_into_row_passes_gives_the_same_step(stories260k, tmp_path, loss_type):
    """update_rows=1 (one forward/backward per completion) accumulates the same gradient and stats as one pass."""
    args = ("max_steps=1", "beta=0.04", f"loss_type={loss_type}")
    out = []
    for rows in (None, 1):
        extra = [] if rows is None else [f"update_rows={rows}"]
        tr = Trainer(C.load(None, small(stories260k, *args, *extra)), tmp_path / f"r{rows}")
        record, roll = tr.train_step(1)
        metrics = step_metrics(record)
        assert tr.rows_per_pass(roll) == (rows or tr.rows_per_pass(roll))
        if rows is None:  # a tiny model: the activation budget holds the whole micro-batch, one pass
            assert tr.rows_per_pass(roll) >= len(roll)
        out.append((metrics, [p.detach().clone() for p in tr.model.parameters() if p.requires_grad]))
    (m0, p0), (m1, p1) = out
    for k in ("loss", "kl", "clip_fraction_low", "clip_fraction_high", "policy_clip_fraction", "grad_norm"):
        assert m0[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(p0, p1, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)

