"""Several runs side by side: group them by how their configs differ (seeds pooled), report held-out eval
metrics as mean +- std over seeds, and say which treatment helped on which metric against a baseline group."""

from __future__ import annotations

from mechdiag.metrics import change, mean_std
from mechdiag.run import Run, base_eval, final_eval, group_runs


# ---- side by side ----------------------------------------------------------------------------------------
def verdict(metric: str, delta: float, base: float, std_a: float, std_b: float, n_a: int, n_b: int) -> str:
    """helped / hurt (metrics.change) when the difference of means exceeds the sum of the seed stds (a deliberately
    conservative band: with two seeds per group a std is a rough estimate); with one seed on a side only the sign
    is known."""
    one = n_a < 2 or n_b < 2
    judged = change(metric, delta, base, noise=0.0 if one else std_a + std_b)
    if judged is None:
        return "not judged"
    word = {1: "helped", -1: "hurt", 0: "no change" if one else "within seed noise"}[judged]
    return word + (" (1 seed)" if one else "")


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean, std = mean_std(values)
    return mean, std or 0.0


def side_by_side(runs: list[Run]) -> list[dict]:
    """One flat record per (group, metric): mean and std over seeds of the final held-out metrics, their mean
    gain over the untrained model (vs_base), the difference to the baseline group (the first run's) and its
    verdict."""
    groups = group_runs(runs)
    stats, gains = [], []
    for g in groups:
        finals = [final_eval(r) for r in g.runs]
        bases = [base_eval(r) for r in g.runs]
        metrics = sorted({k for f in finals for k in f})
        per, gain = {}, {}
        for m in metrics:
            vals = [f[m] for f in finals if m in f]
            per[m] = (*_mean_std(vals), len(vals))
            diffs = [f[m] - b[m] for f, b in zip(finals, bases, strict=True) if m in f and m in b]
            gain[m] = sum(diffs) / len(diffs) if diffs else None
        stats.append(per)
        gains.append(gain)
    base = stats[0]
    out = []
    for g, per, gain in zip(groups, stats, gains, strict=True):
        for m, (mean, std, n) in per.items():
            rec = {"kind": "comparison", "group": g.label, "runs": len(g.runs), "seeds": n, "metric": m,
                   "mean": mean, "std": std, "vs_base": gain[m], "baseline": groups[0].label, "delta": None,
                   "verdict": ""}
            if g is groups[0]:
                rec["verdict"] = "baseline"
            elif m in base:
                b_mean, b_std, b_n = base[m]
                rec["delta"] = mean - b_mean
                rec["verdict"] = verdict(m, mean - b_mean, b_mean, std, b_std, n, b_n)
            out.append(rec)
    return out


def helped_lines(records: list[dict]) -> list[str]:
    """One line per non-baseline group: the judged metrics it helped and hurt."""
    lines = []
    by_group: dict[str, list[dict]] = {}
    for r in records:
        if r["verdict"] not in ("baseline", "not judged", "") and r["delta"] is not None:
            by_group.setdefault(r["group"], []).append(r)
    for group, recs in by_group.items():
        parts = [f"{r['metric']} {r['delta']:+.4g} ({r['verdict']})" for r in recs]
        lines.append(f"{group} vs {recs[0]['baseline']}: " + "; ".join(parts))
    return lines
