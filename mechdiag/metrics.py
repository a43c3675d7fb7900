"""Which way is better for each metric: the one direction table that colours and counts deltas everywhere."""

from __future__ import annotations

# +1 higher is better, -1 lower is better, 0 neither (reported, never coloured or counted: entropy and length
# move both ways in healthy runs). Keys match a metric exactly, its sub-keys ("reward/correctness"), or, for
# keys ending in "@", every k ("pass@1", "maj@5").
DIRECTION = {"accuracy": 1, "eval_reward": 1, "reward": 1, "pass@": 1, "maj@": 1, "format_rate": 1, "score": 1,
             "exact_match": 1, "f1": 1,
             "truncation_rate": -1, "loss": -1, "error_rate": -1, "ppl": -1,
             "entropy": 0, "completion_length": 0, "length": 0, "kl": 0}


def direction(metric: str) -> int:
    m = metric.lower()
    for key, d in DIRECTION.items():
        if m == key or m.startswith(key + "/") or (key.endswith("@") and m.startswith(key)):
            return d
    return 0
