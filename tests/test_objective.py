"""The GRPO objective against hand-computed values, and parity with TRL's GRPOTrainer loss."""

from __future__ import annotations

import math
import os
import socket
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
    assert obj.aggregate(x, m, "luspo").item() == pytest.approx(10.0 / 2)  # sequence sums
    # one micro-batch of four in an update: grpo is divided by the accumulation, dapo by the update's tokens
    assert obj.aggregate(x, m, "grpo", share=obj.Share(accum=4)).item() == pytest.approx(6.0 / 2 / 4)
    assert obj.aggregate(x, m, "dapo", share=obj.Share(accum=4, update_tokens=20.0)).item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        obj.aggregate(x, m, "nope")


def test_on_policy_loss_value_is_minus_mean_advantage_and_gradient_flows():
    logits = torch.randn(4, 3, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (4, 3))
    mask = torch.ones(4, 3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    logp = obj.token_logprobs(logits, tokens)
    loss, st = obj.grpo_loss(logp, None, logp.detach(), adv, mask, obj.Objective(beta=0.1))
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)  # rho = 1, K = 0
    assert st["kl"] == 0.0 and st["policy_clip_fraction"] == 0.0
    loss.backward()
    assert logits.grad.abs().sum() > 0


# ---- parity with TRL 1.16's own _compute_loss -----------------------------------------------------------------
# Each case: the options as GRPOConfig fields (mechdiag's Config uses the same names). TRL's real _compute_loss
# runs on a GRPOTrainer whose fields are set as its __init__ sets them from a real GRPOConfig, its model forward
# replaced by the logits in hand (TRL's own selective_log_softmax / entropy_from_logits).
CASES = {
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.1},
    "sapo": {"loss_type": "sapo"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-2, "epsilon_high": 4e-2},
    "delta": {"loss_type": "dapo", "delta": 1.1},
    "bias_kl": {"loss_type": "dapo", "use_bias_correction_kl": True},
    "top_entropy": {"loss_type": "dapo", "top_entropy_quantile": 0.3},
    "entropy_bonus": {"loss_type": "grpo", "entropy_coef": 0.05, "top_entropy_quantile": 0.5},
    "off_policy_mask": {"loss_type": "dapo", "off_policy_mask_threshold": 0.02},
    "mini_batches": {"loss_type": "dapo", "steps_per_generation": 2},  # x grad_accum: two updates per rollout
}
BETA, EPS, EPS_HIGH, MAX_LEN = 0.04, 0.2, 0.28, 9


def _trl_trainer(options: dict, accum: int, acc):
    """A GRPOTrainer with no __init__ run: the fields its __init__ derives from a real GRPOConfig."""
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    kw = {"beta": BETA, "epsilon": EPS, "epsilon_high": EPS_HIGH, "use_bias_correction_kl": False, **options}
    spg = kw.pop("steps_per_generation", 1) * accum
    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], per_device_train_batch_size=2,
                      num_generations=2, gradient_accumulation_steps=accum, steps_per_generation=spg,
                      max_completion_length=MAX_LEN, **kw)
    t = object.__new__(GRPOTrainer)
    t.__dict__.update(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level,
        off_policy_mask_threshold=args.off_policy_mask_threshold, top_entropy_quantile=args.top_entropy_quantile,
        entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        _last_world_entropy=float("inf"), _entropy_window_stats=None, max_completion_length=MAX_LEN,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        current_gradient_accumulation_steps=accum, model=SimpleNamespace(training=True), accelerator=acc,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    return t


def _trl_micro_loss(trainer, logits, tokens, inputs):
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def forward(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **kw):
        return selective_log_softmax(logits, tokens), entropy_from_logits(logits), None

    trainer._get_per_token_logps_and_entropies = forward
    return trainer._compute_loss(None, inputs)


ONE = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction="sum": t,
                      gather=lambda t: t, gather_for_metrics=lambda t: t,
                      pad_across_processes=lambda t, dim=0, pad_index=0: t)


def _batch(seed: int = 0, b: int = 32, t: int = MAX_LEN, v: int = 13):
    """Uneven completion lengths (1..t), ratios away from 1, a reference apart from the policy."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(b, t, v, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    adv = torch.randn(b, generator=g)
    old = obj.token_logprobs(base + 0.3 * torch.randn(b, t, v, generator=g), tokens)
    ref = obj.token_logprobs(base + 0.3 * torch.randn(b, t, v, generator=g), tokens)
    return base, tokens, mask, adv, old, ref


def _objective(options: dict) -> obj.Objective:
    kw = {"beta": BETA, "epsilon": EPS, "epsilon_high": EPS_HIGH, **options}
    kw.pop("steps_per_generation", None)
    return obj.Objective(max_completion_tokens=MAX_LEN, **kw)


def _ours_update(logits, tokens, mask, adv, old, ref, rows_of, options, accum, update_tokens, processes=1,
                 gather=None):
    """Our loss over the micro-batches `rows_of` (one update), each a Share of it; returns (loss, stats list).
    `gather` pools the entropy quantile's values over processes."""
    o = _objective(options)
    total, stats = 0.0, []
    for rows in rows_of:
        lg = logits[rows]
        logp = obj.token_logprobs(lg, tokens[rows])
        ent = obj.token_entropy(lg) if o.entropy_needed else None
        pool = None if ent is None or gather is None else gather(ent.detach()[mask[rows].bool()])
        loss, st = obj.grpo_loss(logp, old[rows], ref[rows], adv[rows], mask[rows], o,
                                 obj.Share(accum=accum, update_tokens=update_tokens, processes=processes),
                                 entropy=ent, entropy_pool=pool)
        loss.backward()
        total += loss.item()
        stats.append(st)
    return total, stats


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("accum", [1, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_update_matches_trl(case, accum):
    """One update of `accum` micro-batches of uneven lengths: TRL's summed micro-batch losses and gradient equal
    ours to 1e-6 relative, and each micro-batch's logged clip fractions and KL."""
    options = CASES[case]
    base, tokens, mask, adv, old, ref = _batch()
    spg = options.get("steps_per_generation", 1) * accum
    n = base.size(0) // (spg // accum)  # the rows of the first update (the rollout holds spg / accum updates)
    micro = [torch.arange(s, s + n // accum) for s in range(0, n, n // accum)]
    tokens_all = mask.sum()  # TRL's num_items_in_batch: the whole generation batch

    trl_logits = base.clone().requires_grad_(True)
    trainer = _trl_trainer(options, accum, ONE)
    theirs = 0.0
    for rows in micro:
        inputs = {"prompt_ids": torch.zeros(len(rows), 1, dtype=torch.long), "prompt_mask": torch.ones(len(rows), 1),
                  "completion_ids": tokens[rows], "completion_mask": mask[rows], "advantages": adv[rows],
                  "old_per_token_logps": old[rows], "ref_per_token_logps": ref[rows],
                  "num_items_in_batch": tokens_all}
        loss = _trl_micro_loss(trainer, trl_logits[rows], tokens[rows], inputs)
        loss.backward()
        theirs += loss.item()

    ours_logits = base.clone().requires_grad_(True)
    ours, stats = _ours_update(ours_logits, tokens, mask, adv, old, ref, micro, options, accum,
                               float(tokens_all) * accum / spg)

    assert abs(ours - theirs) <= 1e-6 * abs(theirs), (ours, theirs)
    assert _rel(ours_logits.grad, trl_logits.grad) <= 1e-6
    assert trl_logits.grad.abs().max() > 0
    m = trainer._metrics["train"]
    assert [s["kl"] for s in stats] == pytest.approx(m["kl"], rel=1e-6)
    if "clip_ratio/region_mean" in m:
        assert [s["policy_clip_fraction"] for s in stats] == pytest.approx(m["clip_ratio/region_mean"], abs=1e-7)
        assert [s["clip_fraction_low"] for s in stats] == pytest.approx(m["clip_ratio/low_mean"], abs=1e-7)
        assert [s["clip_fraction_high"] for s in stats] == pytest.approx(m["clip_ratio/high_mean"], abs=1e-7)
    if case == "cispo":
        assert [s["clip_fraction_high"] for s in stats] == pytest.approx(m["cispo_clip_ratio"], abs=1e-7)
    if case in ("grpo", "dapo", "gspo", "delta", "cispo") and accum == 1:  # the case really exercises the clip
        assert max(s["policy_clip_fraction"] for s in stats) > 0
    if case == "dapo" and spg == accum:  # the update is the token mean of the whole batch, in float64
        lp = obj.token_logprobs(base.double(), tokens)
        rho, a = torch.exp(lp - old.double()), adv.double()[:, None]
        sur = torch.min(rho * a, rho.clamp(1 - EPS, 1 + EPS_HIGH) * a)
        want = ((-sur + BETA * obj.kl_k3(lp, ref.double())) * mask).sum() / mask.sum()
        assert ours == pytest.approx(want.item(), rel=1e-6)


def _rank(rank: int, port: str, result: dict) -> None:
    """One of two gloo processes: TRL's _compute_loss on this rank's half of the generation batch (its
    accelerator's collectives are torch.distributed's), gradients averaged as DDP does; ours the same way."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)

    def gather(t):
        out = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(out, t.contiguous())
        return torch.cat(out) if t.dim() else torch.stack(out)

    def reduce(t, reduction="sum"):
        t = t.clone()
        dist.all_reduce(t)
        return t

    def pad(t, dim=0, pad_index=0):
        n = torch.tensor([t.size(0)])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return torch.cat([t, t.new_full((int(n) - t.size(0),), pad_index)])

    def gather_object(t):
        out = [None, None]
        dist.all_gather_object(out, t)
        return out

    acc = SimpleNamespace(num_processes=2, sync_gradients=True, reduce=reduce, gather=gather,
                          gather_for_metrics=gather, pad_across_processes=pad)
    accum = 4
    base, tokens, mask, adv, old, ref = _batch(seed=1)
    half = torch.arange(rank * 16, rank * 16 + 16)  # this rank's rows; lengths differ between the ranks
    tokens_all = reduce(mask[half].sum())
    micro = [half[s:s + 4] for s in range(0, 16, 4)]
    for case in ("grpo", "dapo", "cispo", "top_entropy"):
        options = CASES[case]
        trainer = _trl_trainer(options, accum, acc)
        trl_logits = base.clone().requires_grad_(True)
        for rows in micro:
            inputs = {"prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1),
                      "completion_ids": tokens[rows], "completion_mask": mask[rows], "advantages": adv[rows],
                      "old_per_token_logps": old[rows], "ref_per_token_logps": ref[rows],
                      "num_items_in_batch": tokens_all}
            _trl_micro_loss(trainer, trl_logits[rows], tokens[rows], inputs).backward()
        ours_logits = base.clone().requires_grad_(True)
        _ours_update(ours_logits, tokens, mask, adv, old, ref, micro, options, accum, float(tokens_all), 2,
                     gather=lambda t: torch.cat(gather_object(t)))
        theirs, ours = reduce(trl_logits.grad) / 2, reduce(ours_logits.grad) / 2  # DDP's average
        result[f"{case}_rank{rank}"] = _rel(ours, theirs)
        if case == "dapo" and rank == 0:  # one process over both halves: the same update
            whole = base.clone().requires_grad_(True)
            both = [torch.cat([m, m + 16]) for m in [torch.arange(s, s + 4) for s in range(0, 16, 4)]]
            _ours_update(whole, tokens, mask, adv, old, ref, both, options, accum, float(tokens_all))
            result["dapo_one_process"] = _rel(whole.grad, theirs)
    dist.destroy_process_group()


def test_two_ranks_match_trl():
    """2 real gloo processes, uneven lengths across ranks, grad_accum 4: the DDP-averaged gradient of TRL's loss
    equals ours; for dapo it also equals one process's update over the whole batch (the normaliser counts every
    process's tokens)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_rank, args=(port, result), nprocs=2, join=True)
        result = dict(result)
    assert len(result) == 9, result
    assert all(v <= 1e-6 for v in result.values()), str(result)


def test_sequence_level_ratio_is_the_length_mean():
    logp = torch.log(torch.tensor([[2.0, 0.5, 1.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    w = obj.log_importance_weights(logp, torch.zeros(2, 3), mask, "sequence")
    assert w.shape == (2, 1) and w.exp().flatten().tolist() == pytest.approx([1.0, 1.0])


def test_decoupled_advantages_by_hand():
    """GDPO: each component normalised within its group, weighted sum, normalised over the batch."""
    comps = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])  # two groups of two, two components
    a = obj.decoupled_advantages(comps, torch.tensor([1.0, 0.5]), 2)
    z = 0.5 / (math.sqrt(0.5) + 1e-4)  # (1 - 0.5) / std of (1, 0) (unbiased: sqrt(0.5))
    r = torch.tensor([z, -z, 0.5 * z, -0.5 * z], dtype=torch.float64)
    want = (r - r.mean()) / (r.std() + 1e-4)
    assert a.tolist() == pytest.approx(want.tolist(), rel=1e-6)


def test_adaptive_entropy_matches_trl():
    """Skywork-OR1's controller over four updates of two micro-batches: the bonus applied only once the previous
    update's entropy is at or below the target, the coefficient moved after each update; TRL's loss, gradient and
    coefficient equal ours at every update (the trainer's sequence: applied_entropy_coef, grpo_loss,
    acting_tokens, adapt_entropy_coef)."""
    import dataclasses

    base, tokens, mask, adv, old, ref = _batch(seed=2)
    options = {"loss_type": "dapo", "use_adaptive_entropy": True, "entropy_coef": 0.02, "entropy_target": 2.3,
               "entropy_coef_delta": 0.01, "top_entropy_quantile": 0.8}
    acc = SimpleNamespace(**vars(ONE))
    trainer = _trl_trainer(options, 2, acc)
    o = _objective({k: v for k, v in options.items() if not k.startswith("entropy_") or k == "entropy_coef"})
    coef, last, coefs, applieds = 0.02, math.inf, [], []
    for u in range(4):
        rows_of = [torch.arange(8 * u + 4 * j, 8 * u + 4 * j + 4) for j in range(2)]
        tokens_all = float(mask[8 * u:8 * u + 8].sum())
        trl_logits, ours_logits = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
        applied = obj.applied_entropy_coef(coef, last, 2.3, True)
        applieds.append(applied)
        window = [0.0, 0.0]
        for j, rows in enumerate(rows_of):
            acc.sync_gradients = j == 1  # the update's last micro-batch
            inputs = {"prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1),
                      "completion_ids": tokens[rows], "completion_mask": mask[rows], "advantages": adv[rows],
                      "old_per_token_logps": old[rows], "ref_per_token_logps": ref[rows],
                      "num_items_in_batch": torch.tensor(tokens_all)}
            _trl_micro_loss(trainer, trl_logits[rows], tokens[rows], inputs).backward()
            lg = ours_logits[rows]
            ent = obj.token_entropy(lg)
            loss, _ = obj.grpo_loss(obj.token_logprobs(lg, tokens[rows]), old[rows], ref[rows], adv[rows], mask[rows],
                                    dataclasses.replace(o, entropy_coef=applied),
                                    obj.Share(accum=2, update_tokens=tokens_all), entropy=ent)
            loss.backward()
            acts = obj.acting_tokens(ent, mask[rows], o).detach()
            window = [window[0] + float((ent.detach() * acts).sum()), window[1] + float(acts.sum())]
        last = window[0] / window[1]
        coef = obj.adapt_entropy_coef(coef, last, 2.3, 0.01, 0.0, 1.0)
        coefs.append(coef)
        assert _rel(ours_logits.grad, trl_logits.grad) <= 1e-6, u
        assert trainer.entropy_coef == pytest.approx(coef, abs=1e-12) and trainer._last_world_entropy == \
            pytest.approx(last, rel=1e-6)
    assert applieds[0] == 0 and any(a > 0 for a in applieds)  # the gate: no bonus before a measurement, then some
    assert max(coefs) > 0.02 or min(coefs) < 0.02  # the controller moved the coefficient
