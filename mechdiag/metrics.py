"""Metric definitions shared by the CLI, the report and recommend: which way is better (and whether a change
improved or regressed), display order, series over steps, mean and std over seeds, the pass@k / maj@k estimators,
WDisp and update mass, and the causal share of `mechdiag attribute` (docs/metrics.md has the formulas)."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Iterable

# Which way is better: +1 higher, -1 lower, 0 neither (reported, never coloured, judged or counted). Keys ending in
# "@" or "/" are families (pass@k, reward/<component>); the first matching key wins.
# Entropy, length and KL move both ways in healthy runs, so they stay neutral.
DIRECTION = {"accuracy": 1, "eval_reward": 1, "reward": 1, "reward/": 1, "pass@": 1, "maj@": 1, "format_rate": 1,
             "score": 1, "exact_match": 1, "f1": 1,
             "truncation_rate": -1, "completion_clipped_ratio": -1, "loss": -1, "error_rate": -1, "ppl": -1,
             "entropy": 0, "completion_length": 0, "length": 0, "kl": 0,
             "sampler_kl": -1, "sampler_logp_diff": -1, "sampler_logp_diff_max": -1, "sampler_masked_fraction": -1,
             "sampler_ratio_min": 0, "sampler_ratio_mean": 0, "sampler_ratio_max": 0}
SCORES = ("accuracy", "pass@", "maj@")  # what `mechdiag eval`'s summary line counts (the study counts pass@k cells)
ORDER = ["accuracy", "eval_reward", "format_rate", "completion_length", "truncation_rate", "entropy"]

# The study's eight signals (Figure 1): four from training, four from evaluation (report figures, mechdiag watch).
TRAIN_SIGNALS = [("reward", "train reward"), ("reward_cv", "reward CV (within groups)"),
                 ("kl", "KL to reference"), ("completion_clipped_ratio", "completion clipped ratio")]
EVAL_SIGNALS = [("accuracy", "eval accuracy"), ("eval_reward", "eval reward"), ("entropy", "eval entropy"),
                ("completion_length", "eval completion length")]

# Where a training signal is bad: shared by recommend's rules and the live alerts (docs/recommendations.md).
FRAC_ZERO_STD_HIGH = 0.50  # share of groups with identical rewards above this: no gradient signal
CLIPPED_HIGH = 0.20  # share of completions cut at max_completion_tokens above this
ENTROPY_COLLAPSE_RATIO = 0.3  # entropy below this share of the run's own start has collapsed (no absolute floor)
ENTROPY_RISE_RATIO = 1.5  # entropy above this multiple of the run's own start is rising (the policy diffusing)...
ENTROPY_RISE_MIN = 0.1  # ...by at least this many nats/token: the per-token perplexity up 10% (e^0.1); a near-
# deterministic sampler (temperature 0.1: 0.003 -> 0.007 nats) doubles its entropy without spreading at all
KL_BLOWUP = 1.0  # per-token KL to the reference above this (nats) is a blow-up, whatever the eval says

# The sampler against the trainer (docs/metrics.md, "Sampler gap"): the same policy scoring the same tokens twice,
# once where the completion was sampled (vLLM, a lower-precision copy) and once in the update's forward.
# sampler_ratio_*: pi_train / pi_sampler per token (1 when they agree); sampler_logp_diff(_max): mean (max)
# |log pi_train - log pi_sampler| per token; sampler_kl: mean(log pi_sampler - log pi_train), KL(sampler || train);
# sampler_masked_fraction: tokens (or sequences) the importance-sampling correction masked out.
SAMPLER_KEYS = ("sampler_ratio_min", "sampler_ratio_mean", "sampler_ratio_max", "sampler_logp_diff",
                "sampler_logp_diff_max", "sampler_kl", "sampler_masked_fraction")
SAMPLER_GAP_HIGH = 1e-3  # mean |log pi_train - log pi_sampler| (nats/token) above this: the sampler is off-policy
SAMPLER_GAP_GROWTH = 3.0  # ...or, above a tenth of it, this many times the run's own start: the gap is growing


CAP_REPEATS = 2  # a batch mean exactly at the run's maximum this many times: those batches were cut whole


def whole_batches_at_cap(metrics: list[dict]) -> tuple[int, list[int]] | None:
    """(the cap, the steps where every completion ran to it) from the mean completion length alone: a mean that
    is a whole number of tokens equal to the run's longest mean at CAP_REPEATS steps or more (batches of different
    completions do not land on one value by chance); None otherwise."""
    lengths = [(int(m["step"]), float(m["completion_length"])) for m in metrics
               if is_number(m.get("completion_length")) and is_number(m.get("step"))]
    if not lengths:
        return None
    top = max(v for _, v in lengths)
    at = [s for s, v in lengths if v == top]
    if len(at) < CAP_REPEATS or top != int(top) or top <= 0:
        return None
    return int(top), at


def max_reward(weights: dict[str, float]) -> float:
    """The best total reward: components are in [0, 1] before weighting (tasks/base.py), so the sum of the
    positive weights."""
    return sum(w for w in weights.values() if w > 0) or 1.0


def _matches(metric: str, key: str) -> bool:
    return metric == key or (key.endswith(("@", "/")) and metric.startswith(key))


def direction(metric: str) -> int:
    return next((d for key, d in DIRECTION.items() if _matches(metric, key)), 0)


SAME = 1e-9  # a change within this share of max(1, |base|) is float noise: the same


def change(metric: str, delta, base=0.0, noise: float = 0.0) -> int | None:
    """The one improved / regressed verdict (compare, `mechdiag eval`, the report): +1 better and -1 worse in the
    metric's direction, 0 the same (|delta| within `noise`, e.g. the seeds' spread, or within float noise,
    SAME x max(1, |base|)); None for a neutral metric or a delta that is not a finite number."""
    d = direction(metric)
    if not d or not is_number(delta):
        return None
    if abs(delta) <= max(noise, SAME * max(1.0, abs(base) if is_number(base) else 1.0)):
        return 0
    return 1 if delta * d > 0 else -1


def is_score(metric: str) -> bool:
    return any(_matches(metric, s) for s in SCORES)


def metric_order(metric: str) -> tuple:
    """accuracy, pass@k by k, maj@k by k, then the quality metrics in ORDER, then the rest by name."""
    if metric.startswith(("pass@", "maj@")):
        fam, _, k = metric.partition("@")
        return (1 if fam == "pass" else 2, int(k) if k.isdigit() else 0, metric)
    return (0 if metric == "accuracy" else 3, ORDER.index(metric) if metric in ORDER else 99, metric)


# ---- numbers ----------------------------------------------------------------------------------------------------
def is_number(v) -> bool:
    """A finite int or float (not a bool): what may enter a mean."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records: Iterable[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the records with an integer step and a finite number under `key` (alerts, the report)."""
    return [(r["step"], float(r[key])) for r in records
            if is_number(r.get(key)) and isinstance(r.get("step"), int) and not isinstance(r["step"], bool)]


def sampler_gap_series(records: Iterable[dict]) -> tuple[str, list[tuple[int, float]]]:
    """The sampler gap over steps, as the alert and the rule read it: sampler_logp_diff where logged (TRL, native),
    else |sampler_kl| (verl logs the KL only; never above the mean |difference|, so it reads low)."""
    records = list(records)
    gap = series(records, "sampler_logp_diff")
    if gap:
        return "sampler_logp_diff", gap
    return "|sampler_kl|", [(s, abs(v)) for s, v in series(records, "sampler_kl")]


def mean_std(values: Iterable) -> tuple[float | None, float | None]:
    """Mean and sample std (Bessel) over the finite numbers given (seeds); std None for one value, both None
    for none, 0 for seeds that agree to 1e-9."""
    vals = [float(v) for v in values if is_number(v)]
    if not vals:
        return None, None
    mean = math.fsum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None
    std = statistics.stdev(vals)
    return mean, 0.0 if std <= 1e-9 * max(1.0, abs(mean)) else std  # equal seeds: no float noise


# ---- estimators -------------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Computed as a product, which stays exact in floating point for any n (the binomials overflow first).
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def maj_at_k(keys: list, correct: list[bool], k: int, max_subsets: int = 2000, seed: int = 0) -> float:
    """Expected accuracy of a plurality vote over k of the n samples.

    keys[i] is the answer sample i gave (None: no answer, no vote). The expectation is over all k-subsets of the n
    samples (a seeded random 2000 of them when there are more), ties broken uniformly at random; the winning answer
    scores the fraction of its samples that are correct (one answer, one verdict, whatever its spelling).
    """
    n = len(keys)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n = len(keys) = len(correct), got k={k}, {n}, {len(correct)}")
    right: dict = {}
    for key, ok in zip(keys, correct, strict=True):
        if key is not None:
            right.setdefault(key, []).append(bool(ok))
    if not right:
        return 0.0
    score = {key: sum(v) / len(v) for key, v in right.items()}
    if math.comb(n, k) <= max_subsets:
        subsets: Iterable = itertools.combinations(range(n), k)
        count = math.comb(n, k)
    else:
        rng = random.Random(seed)
        subsets = (rng.sample(range(n), k) for _ in range(max_subsets))
        count = max_subsets
    total = 0.0
    for sub in subsets:
        votes = Counter(keys[i] for i in sub if keys[i] is not None)
        if votes:
            top = max(votes.values())
            winners = [key for key, v in votes.items() if v == top]
            total += sum(score[w] for w in winners) / len(winners)
    return total / count


# ---- update mass ------------------------------------------------------------------------------------------------
def last_step(rows: list[dict]) -> list[dict]:
    """The rows of the last recorded step (displacement.jsonl holds one block of rows per recorded step)."""
    steps = [r["step"] for r in rows if is_number(r.get("step"))]
    return [r for r in rows if r.get("step") == max(steps)] if steps else []


DELTA_W = 1e-12  # the study's delta_w: keeps wdisp finite for all-zero reference groups


def wdisp(delta_sq, ref_sq, delta_w: float = DELTA_W):
    """The study's WDisp (eq. 10/12) from sum ||W - W_ref||_F^2 and sum ||W_ref||_F^2 over a group; numbers or
    pandas columns."""
    return delta_sq ** 0.5 / (ref_sq + delta_w) ** 0.5


def is_part(row: dict) -> bool:
    """A row of a fused tensor's logical part (qkv_proj.v; mechdiag.parts): sums over whole tensors skip it."""
    return bool(row.get("part_of"))


def group_norms(rows: Iterable[dict], key: Callable[[dict], object], parts: bool = False) -> dict:
    """key(row) -> (sum ||dW||^2, sum ||W||^2) over the finite rows (tensors) of that group (key None: left out);
    what wdisp and the update masses are made of. A fused tensor's part rows (is_part) count only with parts=True:
    its whole tensor is counted already."""
    out: dict = {}
    for r in rows:
        k = key(r)
        if is_number(r.get("delta_fro")) and k is not None and not r.get("nonfinite") and (parts or not is_part(r)):
            d, ref = out.get(k, (0.0, 0.0))
            out[k] = (d + float(r["delta_fro"]) ** 2,
                      ref + (float(r["ref_fro"]) ** 2 if is_number(r.get("ref_fro")) else 0.0))
    return out


def _shares(mass: dict, part_keys: set) -> dict:
    total = math.fsum(v for k, v in mass.items() if k not in part_keys)  # parts: shares of the whole tensors' total
    return {k: v / total for k, v in mass.items()} if total > 0 else {}


def _part_keys(rows: list[dict], by: str, parts: bool) -> set:
    return {r.get(by) for r in rows if is_part(r)} if parts else set()


def update_mass(rows: Iterable[dict], by: str = "module", parts: bool = False) -> dict:
    """Raw update mass (the report, `mechdiag attribute`'s disp_share): each group's share of the squared
    displacement, ||dW_g||^2 / sum_h ||dW_h||^2, over the rows (tensors) of a group keyed by row[by] as weights.py
    names it (GPT-2's attn.c_proj and mlp.c_proj stay apart). Rows without finite norms are left out; {} when
    nothing moved. parts: also the fused tensors' parts (qkv_proj.v) as groups, each a share of the same
    whole-tensor total (the parts of qkv_proj sum to its share)."""
    rows = list(rows)
    norms = group_norms(rows, lambda r: r.get(by), parts)
    return _shares({k: d for k, (d, _) in norms.items()}, _part_keys(rows, by, parts))


def update_mass_size_normalised(rows: Iterable[dict], by: str = "module", parts: bool = False) -> dict:
    """Size-normalised update mass (recommend's reduced_modules): the shares of ||dW_g||^2 / ||W_g||^2 (each
    group's WDisp^2), so a module does not carry "the update" just for being a bigger matrix. {} when nothing
    moved or a group has no reference norm. parts: as in update_mass."""
    rows = list(rows)
    norms = group_norms(rows, lambda r: r.get(by), parts)
    if any(ref <= 0 for _, ref in norms.values()):
        return {}
    return _shares({k: d / ref for k, (d, ref) in norms.items()}, _part_keys(rows, by, parts))


# ---- attribution (mechdiag attribute) -----------------------------------------------------------------------------
ATTRIBUTION_REFERENCE = "reference"  # the `by` of the rows "none" (nothing removed) and "all" (everything removed)


def attribution_reference(rows: list[dict], part: str) -> dict | None:
    return next((r for r in rows if r.get("by") == ATTRIBUTION_REFERENCE and r.get("part") == part), None)


def causal_shares(rows: list[dict], by: str) -> dict:
    """Causal share per layer or module: its output_kl_without over the sum over the parts of that `by` (sums to 1;
    {} when nothing was recorded)."""
    parts = [r for r in rows if r.get("by") == by and is_number(r.get("output_kl_without"))]
    total = math.fsum(float(r["output_kl_without"]) for r in parts)
    if total <= 0:
        return {}
    return {(int(r["layer"]) if by == "layer" else r["module"]): float(r["output_kl_without"]) / total for r in parts}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):  # ties share their mean rank
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_correlation(a: dict, b: dict) -> float | None:
    """Spearman's rho between two shares over their common keys: Pearson's r of the (tie-averaged) ranks. None with
    fewer than 3 common keys or a constant side."""
    keys = sorted(set(a) & set(b), key=str)
    if len(keys) < 3:
        return None
    x, y = _ranks([a[k] for k in keys]), _ranks([b[k] for k in keys])
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = math.fsum((u - mx) * (v - my) for u, v in zip(x, y, strict=True))
    sxx, syy = math.fsum((u - mx) ** 2 for u in x), math.fsum((v - my) ** 2 for v in y)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


# a stream that counts answers right (check_answer / check_numbers: Unsloth's GRPO notebooks' correctness rewards)
SUCCESS_KEYS = ("accuracy", "correct", "solved", "succe", "win", "pass", "check_answer", "check_numbers",
                "exact_match", "answer_match")


def counts_right(key: str) -> bool:
    """A stream of the share of answers right: accuracy, a correctness reward, a solved / win / success rate,
    pass@1 (not pass@k, k > 1, nor a std)."""
    if key.startswith(("trl/", "reward_std/")) or (key.startswith("pass@") and key != "pass@1"):
        return False
    return any(w in key.rsplit("/", 1)[-1].lower() for w in SUCCESS_KEYS)
