"""Group statistics of a rollout: within-group reward CV, zero-std groups and the group outcomes (why a group
carries no signal, or a signal that is not about correctness). The one definition every trainer and reader uses.

A group is the G completions of one prompt. For each completion there is a total reward r (the weighted sum of
the reward components) and, where the task has it, a correctness c (the unweighted `correctness` component):

    zero-std        every r in the group is equal               (A = 0 exactly: the group teaches nothing)
    reward_cv       mean over groups of std(r) / |mean(r)|     (Bessel std; groups with mean 0 left out)
    all correct     zero-std and every c == 1                  (too easy)
    all wrong       zero-std and every c == 0                  (too hard)
    shaping only    not zero-std, every c equal                (the advantages come only from format/shaping terms)

Shares of the groups with at least two scored completions (docs/metrics.md). "Equal" is exact equality, as in
train.objective.group_advantages: frac_zero_std counts exactly the groups whose advantages are 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from mechdiag.metrics import is_number

CORRECTNESS = "correctness"  # the reward component that says whether a completion is right
KEYS = ("frac_groups_all_correct", "frac_groups_all_wrong", "frac_groups_shaping_only")


def all_equal(values: list[float]) -> bool:
    """A zero-std group: every value equal (exactly)."""
    return max(values) == min(values)


def _groups(keys: Iterable, *columns: Iterable) -> list[list[tuple]]:
    """Rows grouped by equal key, a row left out when any of its values is None/NaN (unscorable); groups of >= 2."""
    groups: dict = {}
    for k, *vals in zip(keys, *columns, strict=True):
        if all(is_number(v) for v in vals):
            groups.setdefault(k, []).append(tuple(float(v) for v in vals))
    return [g for g in groups.values() if len(g) >= 2]


def group_stats(rewards: Iterable[float], keys: Iterable, correctness: Iterable[float] | None = None) -> dict:
    """reward_cv and frac_zero_std over groups of equal `keys`, and with `correctness` the three outcome shares
    (over the groups of completions with both scored); {} when no group has two scored completions."""
    rewards, keys = list(rewards), list(keys)
    groups = [[r for (r,) in g] for g in _groups(keys, rewards)]
    if not groups:
        return {}
    cvs = []
    for rs in groups:
        mean = math.fsum(rs) / len(rs)
        if abs(mean) > 1e-12:
            cvs.append(math.sqrt(math.fsum((x - mean) ** 2 for x in rs) / (len(rs) - 1)) / abs(mean))
    out = {"reward_cv": math.fsum(cvs) / len(cvs) if cvs else math.nan,
           "frac_zero_std": sum(all_equal(rs) for rs in groups) / len(groups)}
    both = _groups(keys, rewards, correctness) if correctness is not None else []
    shares = [0, 0, 0]  # all correct, all wrong, shaping only
    for g in both:
        rs, cs = [r for r, _ in g], [c for _, c in g]
        shares = [shares[0] + (all_equal(rs) and min(cs) >= 1.0), shares[1] + (all_equal(rs) and max(cs) <= 0.0),
                  shares[2] + (not all_equal(rs) and all_equal(cs))]
    return out | ({k: v / len(both) for k, v in zip(KEYS, shares, strict=True)} if both else {})
