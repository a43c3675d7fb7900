"""The GRPO objective against hand-computed values, and parity with TRL's GRPOTrainer loss."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from mechdiag.outcomes import group_stats
from mechdiag.train import objective as obj

torch.set_num_threads(1)


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 3.0, 2.0, 2.0])  # two groups of two
    a = obj.group_advantages(r, 2, "group")
    std = math.sqrt(2.0)  # unbiased std of (1, 3)
    assert a[0].item() == pytest.approx(-1 / (std + 1e-4))
    assert a[1].item() == pytest.approx(1 / (std + 1e-4))
    assert a[2:].abs().max().item() == 0.0  # equal rewards -> no signal
    assert obj.group_advantages(r, 2, "none").tolist() == [-1.0, 1.0, 0.0, 0.0]
    b = obj.group_advantages(r, 2, "batch")
    assert b[0].item() == pytest.approx(-1 / (r.std().item() + 1e-4))


@pytest.mark.parametrize("value", [3.7, 0.1, 1e6 + 0.1, -2.35, 123456.789])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_reward_groups_get_exactly_zero_advantage(value, scale):
    """The study's A = 0 for a group of equal rewards, exactly: a float32 mean is off by ~1 ulp, which (0 + 1e-4)
    would blow up to |A| ~ 2e-3 at 3.7 and hundreds at 1e6, and the beta = 0 skip of zero-advantage rows would
    never fire."""
    r = torch.tensor([value] * 8 + [1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25, 1.0], dtype=torch.float32)
    a = obj.group_advantages(r, 8, scale)
    assert a.dtype == torch.float32
    assert (a[:8] == 0).all(), a[:8]
    assert (a[8:] != 0).sum().item() == 8  # the mixed group keeps its signal
    # the rows the trainer keeps when beta = 0 (train/trainer.py: advantages != 0) are the mixed group's
    assert torch.nonzero(a != 0).flatten().tolist() == list(range(8, 16))
    if scale == "group":  # and the mixed group matches the formula computed in float64
        g = r[8:].double()
        want = (g - g.mean()) / (g.std() + obj.STD_EPS)
        assert torch.allclose(a[8:].double(), want, rtol=1e-6, atol=1e-7)


def test_group_stats_cv_and_zero_std():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 0.0])
    s = group_stats(rewards.tolist(), [0, 0, 1, 1, 2, 2])
    # the zero-std groups are exactly those whose advantages are all 0
    a = obj.group_advantages(rewards, 2).view(-1, 2)
    assert s["frac_zero_std"] == (a == 0).all(dim=1).double().mean().item()
    # group 1: std sqrt2, mean 2 -> cv 0.7071; group 2: cv 0; group 3: mean 0 left out
    assert s["reward_cv"] == pytest.approx((math.sqrt(2) / 2 + 0) / 2)
    assert s["frac_zero_std"] == pytest.approx(2 / 3)


def test_token_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = (1/4, 3/4)
    lp = obj.token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75))
    h = obj.token_entropy(logits)
    assert h.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    lp2 = obj.token_logprobs(logits, torch.tensor([[1]]), temperature=2.0)  # p ~ (1, sqrt3)
    assert lp2.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def test_kl_k3_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # r = ref/pi = 0.5 -> 0.5 - log 0.5 - 1
    assert obj.kl_k3(logp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert obj.kl_k3(ref, ref).item() == 0.0


def test_asymmetric_clip_and_fractions():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.25, 0.9]]))
    mask = torch.ones(1, 4)
    pos = torch.tensor([1.0])
    sur, rho = obj.clipped_surrogate(logp, old, pos, epsilon=0.2, epsilon_high=0.3)
    # A > 0: min(rho, clip(rho, 0.8, 1.3)) -> 1.3, 0.5, 1.25, 0.9
    assert sur[0].tolist() == pytest.approx([1.3, 0.5, 1.25, 0.9])
    neg = torch.tensor([-1.0])
    sur, _ = obj.clipped_surrogate(logp, old, neg, epsilon=0.2, epsilon_high=0.3)
    # A < 0: min(-rho, -clip) -> -1.5, -0.8, -1.25, -0.9
    assert sur[0].tolist() == pytest.approx([-1.5, -0.8, -1.25, -0.9])
    f = obj.clip_fractions(rho, pos, mask, 0.2, 0.3)
    assert f == {"clip_fraction_low": 0.0, "clip_fraction_high": 0.25, "policy_clip_fraction": 0.25}
    f = obj.clip_fractions(rho, neg, mask, 0.2, 0.3)
    assert f["clip_fraction_low"] == 0.25 and f["clip_fraction_high"] == 0.0


def test_aggregation_variants_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert obj.aggregate(x, m, "grpo").item() == pytest.approx((2.0 + 4.0) / 2)
    assert obj.aggregate(x, m, "dapo").item() == pytest.approx(10.0 / 4)
    assert obj.aggregate(x, m, "dr_grpo", max_completion_tokens=5).item() == pytest.approx(10.0 / (2 * 5))
    with pytest.raises(ValueError):
        obj.aggregate(x, m, "nope")


def test_on_policy_loss_value_is_minus_mean_advantage_and_gradient_flows():
    logits = torch.randn(4, 3, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (4, 3))
    mask = torch.ones(4, 3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    logp = obj.token_logprobs(logits, tokens)
    loss, st = obj.grpo_loss(logp, None, logp.detach(), adv, mask, beta=0.1)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)  # rho = 1, K = 0
    assert st["kl"] == 0.0 and st["policy_clip_fraction"] == 0.0
    loss.backward()
    assert logits.grad.abs().sum() > 0


# ---- parity with TRL ------------------------------------------------------------------------------------
def _trl_loss(logits, tokens, mask, adv, old, ref, *, loss_type, beta, eps, eps_high, max_len):
    """TRL's own GRPOTrainer._compute_loss on a stand-in trainer whose model forward returns `logits`."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **kw):
        return selective_log_softmax(logits, tokens), entropy_from_logits(logits), None

    acc = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction="sum": t,
                          gather=lambda t: t, gather_for_metrics=lambda t: t)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta, loss_type=loss_type,
        epsilon_low=eps, epsilon_high=eps_high, args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_len, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)}, accelerator=acc)
    fake.args.steps_per_generation = 1
    b = tokens.size(0)
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1),
              "completion_ids": tokens, "completion_mask": mask, "advantages": adv, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, fake._metrics["train"]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_loss_and_gradient_match_trl(loss_type):
    g = torch.Generator().manual_seed(0)
    b, t, v, max_len = 6, 7, 11, 9
    base = torch.randn(b, t, v, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    mask[:, 0] = 1
    adv = torch.randn(b, generator=g)
    old = obj.token_logprobs(base + 0.3 * torch.randn(b, t, v, generator=g), tokens)  # ratios differ from 1
    ref = obj.token_logprobs(base + 0.3 * torch.randn(b, t, v, generator=g), tokens)
    kw = dict(loss_type=loss_type, beta=0.04, eps=0.2, eps_high=0.28, max_len=max_len)

    ours_logits = base.clone().requires_grad_(True)
    logp = obj.token_logprobs(ours_logits, tokens)
    ours, st = obj.grpo_loss(logp, old, ref, adv, mask, epsilon=0.2, epsilon_high=0.28, beta=0.04,
                             loss_type=loss_type, max_completion_tokens=max_len)
    ours.backward()

    trl_logits = base.clone().requires_grad_(True)
    theirs, metrics = _trl_loss(trl_logits, tokens, mask, adv, old, ref, **kw)
    theirs.backward()

    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert torch.allclose(ours_logits.grad, trl_logits.grad, atol=1e-5)
    assert st["kl"] == pytest.approx(metrics["kl"][0], abs=1e-5)
    assert st["clip_fraction_low"] == pytest.approx(metrics["clip_ratio/low_mean"][0], abs=1e-6)
    assert st["clip_fraction_high"] == pytest.approx(metrics["clip_ratio/high_mean"][0], abs=1e-6)
    assert st["policy_clip_fraction"] == pytest.approx(metrics["clip_ratio/region_mean"][0], abs=1e-6)
    assert st["policy_clip_fraction"] > 0  # the case really exercises the clip
    ent = obj.masked_mean(obj.token_entropy(base), mask).item()
    assert ent == pytest.approx(metrics["entropy"][0], abs=1e-5)
