"""Group outcomes: why a GRPO group carries no signal, or a signal that is not about correctness.

A group is the G completions of one prompt. For each completion there is a total reward r (the weighted sum of
the reward components) and a correctness c (the unweighted `correctness` component, in [0, 1]). Then

    zero-std        std(r) <= EQ_TOL                       (no advantage: the group teaches nothing)
    all correct     zero-std and every c == 1              (too easy)
    all wrong       zero-std and every c == 0              (too hard)
    shaping only    not zero-std, max(c) - min(c) <= EQ_TOL (the advantages come only from format/shaping terms)

frac_groups_all_correct, frac_groups_all_wrong and frac_groups_shaping_only are shares of all groups with at
least two scored completions (docs/metrics.md). all_correct + all_wrong <= frac_zero_std.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

CORRECTNESS = "correctness"  # the reward component that says whether a completion is right
EQ_TOL = 1e-8  # as frac_zero_std: a std (or spread) at or below this is "equal"
KEYS = ("frac_groups_all_correct", "frac_groups_all_wrong", "frac_groups_shaping_only")


def group_outcomes(rewards: Iterable[float], correctness: Iterable[float], keys: Iterable) -> dict[str, float]:
    """The three shares over groups of equal `keys`; {} when no group has two scored completions.

    A completion whose reward or correctness is None/NaN (unscorable) is left out of its group."""
    groups: dict = {}
    for r, c, k in zip(rewards, correctness, keys, strict=True):
        if r is None or c is None or not (math.isfinite(r) and math.isfinite(c)):
            continue
        groups.setdefault(k, []).append((float(r), float(c)))
    n = correct = wrong = shaping = 0
    for vals in groups.values():
        if len(vals) < 2:
            continue
        n += 1
        rs, cs = [v[0] for v in vals], [v[1] for v in vals]
        mean = math.fsum(rs) / len(rs)
        zero_std = math.sqrt(math.fsum((x - mean) ** 2 for x in rs) / (len(rs) - 1)) <= EQ_TOL
        if zero_std:
            correct += all(x >= 1.0 for x in cs)
            wrong += all(x <= 0.0 for x in cs)
        else:
            shaping += max(cs) - min(cs) <= EQ_TOL
    if n == 0:
        return {}
    return dict(zip(KEYS, (correct / n, wrong / n, shaping / n), strict=True))


def outcomes_from(rewards, components: dict, keys) -> dict[str, float]:
    """group_outcomes with correctness taken from `components` (name -> values; tensors or lists); {} when the
    task has no correctness component."""
    c = components.get(CORRECTNESS)
    if c is None:
        return {}
    as_list = lambda x: x.tolist() if hasattr(x, "tolist") else list(x)  # noqa: E731
    return group_outcomes(as_list(rewards), as_list(c), list(keys))
