"""One GRPO rollout: G samples per prompt, rewards, group advantages, and the old/reference log-probs.

The reference policy is the same model with the adapter disabled under LoRA (no second copy), or a frozen copy
under full fine-tuning. The old and reference log-probs are forwards in inference mode, rows batched by length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mechdiag.generate import (
    Filters,
    encode_prompts,
    eos_ids,
    pad_id,
    policy_logits,  # noqa: F401 - tests import it from here
    policy_logprobs,
    sample_tokens,
)
from mechdiag.models import reference_context
from mechdiag.tasks.rewards import RANDOM, coin, weighted_total
from mechdiag.train import objective as obj


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # (B, T) right-padded
    completion_mask: torch.Tensor
    truncated: torch.Tensor  # (B,) bool
    rewards: torch.Tensor  # (B,) weighted sum of components
    components: dict[str, torch.Tensor]  # name -> (B,) unweighted, in [0, 1]
    advantages: torch.Tensor  # (B,)
    texts: list[str]
    example_ids: list[str]
    group_ids: list[int]
    prompts: list[str]
    old_logp: torch.Tensor | None = None  # (B, T), only when a step makes more than one update
    ref_logp: torch.Tensor | None = None
    sample_logp: torch.Tensor | None = None  # (B, T) log-prob of each sampled token when it was drawn
    sample_entropy: torch.Tensor | None = None  # (B, T) entropy of the sampling distribution

    def __len__(self) -> int:
        return self.completion_ids.size(0)

    def select(self, idx: torch.Tensor) -> Rollout:
        """The rows `idx` (a LongTensor), completion width trimmed to their longest completion."""
        cm = self.completion_mask[idx]
        width = max(int(cm.sum(-1).max()), 1) if len(idx) else 1
        t = lambda x: None if x is None else x[idx][:, :width]  # noqa: E731
        rows = idx.tolist()
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return Rollout(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx][:, :width],
                       cm[:, :width], self.truncated[idx], self.rewards[idx],
                       {k: v[idx] for k, v in self.components.items()}, self.advantages[idx], pick(self.texts),
                       pick(self.example_ids), pick(self.group_ids), pick(self.prompts), t(self.old_logp),
                       t(self.ref_logp), t(self.sample_logp), t(self.sample_entropy))


PASS_TOKENS = 32  # a forward pass's fixed cost, in tokens (another read of the weights): what a split must save


def length_passes(r: Rollout) -> list[torch.Tensor]:
    """The rows of r in forward passes of similar completion length: rows sorted by length, cut where the tokens
    the passes compute (each distinct prompt once per pass, every row padded to its pass's longest completion, and
    PASS_TOKENS a pass) add up to the least (dynamic programming over the sorted rows). One pass when the lengths
    are equal; when a few rows run to the budget and most stop early, those few do not pad the rest."""
    lengths = r.completion_mask.sum(-1).tolist()
    order = sorted(range(len(r)), key=lambda i: -lengths[i])
    prompt_len = r.prompt_mask.sum(-1).tolist()
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for i in range(n):
        seen, prompts = set(), 0
        for j in range(i + 1, n + 1):
            row = order[j - 1]
            if r.group_ids[row] not in seen:
                seen.add(r.group_ids[row])
                prompts += prompt_len[row]
            cost = best[i] + PASS_TOKENS + prompts + (j - i) * lengths[order[i]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    passes, j = [], n
    while j > 0:
        passes.append(torch.tensor(order[cut[j]:j]))
        j = cut[j]
    return passes[::-1]


@torch.inference_mode()
def sequence_logprobs(model, r: Rollout, temperature: float) -> torch.Tensor:
    """Token log-probs of the completions under `model` (no grad, 0 at padding): rows in passes of similar length
    (length_passes), each group's prompt run once per pass and the head applied a chunk of positions at a time."""
    out = None
    for rows in length_passes(r):
        s = r.select(rows)
        lp = policy_logprobs(model, s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask, temperature,
                             prompt_of=torch.tensor(s.group_ids))
        if out is None:
            out = lp.new_zeros(r.completion_mask.shape)
        out[rows.to(out.device), :lp.size(1)] = lp
    return out


def advantages(cfg, rewards: torch.Tensor, components: dict[str, list[float]], weights: dict[str, float]):
    """The rollout's advantages: of the weighted reward (sum_then_normalize), or GDPO's per-component group
    normalisation then weighted sum (multi_objective_aggregation: normalize_then_sum)."""
    if cfg.multi_objective_aggregation == "normalize_then_sum" and components:
        names = list(components)
        c = torch.tensor([components[k] for k in names], dtype=torch.float64).T
        return obj.decoupled_advantages(c, torch.tensor([float(weights.get(k, 0.0)) for k in names]),
                                        cfg.group_size)
    return obj.group_advantages(rewards, cfg.group_size, cfg.scale_rewards)


def collect(model, tokenizer, task, examples, cfg, gen: torch.Generator, ref_model=None, sampler=None) -> Rollout:
    """Sample cfg.group_size completions per example, score them (scored) and add the old and reference
    log-probs (paper-notes §2). `sampler`, if given, decodes in place of `model` (a copy holding the same
    effective weights)."""
    g = cfg.group_size
    prompts = [task.prompt(ex, tokenizer) for ex in examples]
    device = next(model.parameters()).device
    u_ids, u_mask = encode_prompts(tokenizer, prompts, cfg.max_prompt_tokens)
    u_ids, u_mask = u_ids.to(device), u_mask.to(device)
    was_training = model.training
    model.eval()
    try:
        ent, lps = [], []
        c_ids, c_mask, trunc = sample_tokens(sampler or model, u_ids, u_mask, max_new_tokens=cfg.max_completion_tokens,
                                             eos=eos_ids(model, tokenizer), pad=pad_id(tokenizer),
                                             temperature=cfg.temperature, top_p=cfg.top_p, gen=gen, entropy=ent,
                                             filters=Filters(cfg.top_k, cfg.min_p, cfg.repetition_penalty),
                                             logprobs=lps, repeat=g)
        r = scored(tokenizer, task, examples, prompts, cfg, u_ids.repeat_interleave(g, 0),
                   u_mask.repeat_interleave(g, 0), c_ids.clone(), c_mask.clone(), trunc.cpu())
        r.sample_logp, r.sample_entropy = lps[0].clone(), ent[0].clone()  # inference tensors cannot enter autograd
        if cfg.updates_per_step > 1:  # later updates see a policy that moved: ratios against the sampling one
            r.old_logp = sequence_logprobs(model, r, cfg.temperature).clone()
        ref, ctx = reference_context(model, ref_model)
        with ctx:
            r.ref_logp = sequence_logprobs(ref, r, cfg.temperature).clone()
    finally:
        model.train(was_training)
    return r


def scored(tokenizer, task, examples, prompts: list[str], cfg, p_ids, p_mask, c_ids, c_mask, trunc) -> Rollout:
    """The Rollout of cfg.group_size sampled completions per example (token ids, mask with the EOS counted,
    truncated flags): texts decoded, reward components and their weighted total, advantages (`advantages`)."""
    g = cfg.group_size
    texts = [tokenizer.decode(ids[:n], skip_special_tokens=True)
             for ids, n in zip(c_ids.tolist(), c_mask.sum(-1).tolist(), strict=True)]
    comps: dict[str, list[float]] = {}
    totals = []
    # all completions of the step in one parallel batch (a code task runs its sandboxes side by side)
    of = [examples[i // g] for i in range(len(texts))]  # each completion's example
    for text, ex, c in zip(texts, of, task.components_many(texts, of), strict=True):
        if cfg.rewards.control == "random":
            c = {**c, RANDOM: coin(cfg.seed, ex.id, text)}
        for k, v in c.items():
            comps.setdefault(k, []).append(float(v))
        totals.append(weighted_total(c, cfg.rewards.weights))
    rewards = torch.tensor(totals, dtype=torch.float32)
    return Rollout(p_ids, p_mask, c_ids, c_mask, trunc, rewards, {k: torch.tensor(v) for k, v in comps.items()},
                   advantages(cfg, rewards, comps, cfg.rewards.weights).to(c_ids.device), texts,
                   [ex.id for ex in examples for _ in range(g)], [i // g for i in range(len(texts))],
                   [p for p in prompts for _ in range(g)])
