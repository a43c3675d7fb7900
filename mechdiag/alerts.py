"""Live alerts: pure functions over the records of a run that say, while it trains, that something is wrong.

`check(metrics, evals, displacement, max_reward)` returns one Alert per condition that has held at some step:
its name, the first step where it held, and the evidence. `mechdiag watch` shows them; the native trainer and
the TRL callback print each once, when it first fires (Watcher). Thresholds: docs/recommendations.md.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import asdict, dataclass

from mechdiag.metrics import (
    CLIPPED_HIGH,
    ENTROPY_COLLAPSE_RATIO,
    ENTROPY_RISE_MIN,
    ENTROPY_RISE_RATIO,
    FRAC_ZERO_STD_HIGH,
    KL_BLOWUP,
    SAMPLER_GAP_GROWTH,
    SAMPLER_GAP_HIGH,
    group_norms,
    sampler_gap_series,
    series,
    wdisp,
)

NO_UPDATE_STEPS = 10  # after this many steps the adapter must have moved...
NO_UPDATE_WDISP = 1e-6  # ...its wdisp (sqrt(sum delta^2) / sqrt(sum ref^2)) above this; or reward/loss not all 0
KL_SPIKE_FACTOR = 5.0  # kl above this many times the median of the steps before it...
KL_WINDOW = 50  # ...over at most this many steps before it...
KL_MIN_HISTORY = 5  # ...given at least this many...
KL_SPIKE_MIN = 0.1  # ...and above this (nats/token): healthy runs drift up to ~0.05 from ~0, many medians high
UPDATE_SPIKE_FACTOR = 5.0  # a step's weight change above this many times the median of the steps before it
# (KL_WINDOW, KL_MIN_HISTORY): AdamW's steps are near lr-sized, so a jump is the lr, the optimizer or a gradient
# gone wrong, seen in the step that did it (before the next rollout's KL or any eval can show it)...
UPDATE_RUNAWAY_FACTOR = 2.5  # ...or above this many times it after UPDATE_RUNAWAY_STEPS steps in a row that each
UPDATE_RUNAWAY_GROWTH = 1.5  # grew by this factor over the one before: a build-up (a linear warmup grows by
UPDATE_RUNAWAY_STEPS = 2  # (k+1)/k per step, under 1.5 from its third step on)
WINDOW = 5  # truncation, entropy, KL and zero_std look at the mean over this many steps ending at each step
WINDOW_MIN_RECORDS = 6  # ...and over two records at least where the log holds more than this many
GAP_REWARD_RISE = 0.10  # reward_accuracy_gap: train reward up by this share of the maximum reward...
GAP_ACC_FLAT = 0.01  # ...while eval accuracy is at most this far above the base (flat or falling)
ZERO = 1e-12  # reward and loss at or below this (absolute) count as exactly zero

NAMES = ("no_update", "update_spike", "kl_spike", "kl_blowup", "truncation", "entropy_collapse", "entropy_rise",
         "zero_std", "reward_accuracy_gap", "sampler_mismatch")
# record.halt_on: a run that will not recover
CRITICAL = ("no_update", "update_spike", "kl_spike", "kl_blowup", "entropy_collapse")


@dataclass(frozen=True)
class Alert:
    alert: str
    step: int
    evidence: str

    def to_dict(self) -> dict:
        return asdict(self)


def _span(points: list[tuple[int, float]]) -> int:
    """How many records cover WINDOW steps: WINDOW where every step is logged, fewer where the log is sparser
    (logging_steps 10: one record already spans ten steps), but never one record alone where the log holds more
    than WINDOW_MIN_RECORDS of them: one noisy record is not a trend (a published log every 5 steps raised
    entropy_rise on one record of 0.46 in a run flat at 0.35)."""
    gaps = sorted(b[0] - a[0] for a, b in zip(points, points[1:], strict=False) if b[0] > a[0])
    gap = gaps[len(gaps) // 2] if gaps else 1
    least = 2 if len(points) > WINDOW_MIN_RECORDS else 1
    return max(least, min(WINDOW, round(WINDOW / gap)))


def _windows(points: list[tuple[int, float]], n: int | None = None):
    """(step, mean of the n values ending at that step) from the n-th value on; n: the records of WINDOW steps."""
    n = _span(points) if n is None else n
    for i in range(n - 1, len(points)):
        yield points[i][0], math.fsum(v for _, v in points[i - n + 1:i + 1]) / n


# ---- the alerts ---------------------------------------------------------------------------------------------
def no_update(metrics: list[dict], displacement: list[dict]) -> Alert | None:
    """The adapter has not moved after NO_UPDATE_STEPS steps: its displacement is ~0 (exactly 0: LoRA B is still
    zero), or reward and loss have been exactly 0 for NO_UPDATE_STEPS steps in a row."""
    for row in sorted(_per_step(displacement), key=lambda r: r["step"]):
        step = row["step"]
        if step < NO_UPDATE_STEPS:
            continue
        moved = wdisp(row["delta_fro"] ** 2, row["ref_fro"] ** 2)
        if row["delta_fro"] == 0.0:
            return Alert("no_update", step, f"every LoRA delta is exactly zero at step {step} (B still zero)")
        if moved <= NO_UPDATE_WDISP:
            return Alert("no_update", step, f"wdisp {moved:.2e} <= {NO_UPDATE_WDISP:g} at step {step}")
    nan_grad = 0  # a logged grad_norm of NaN/inf (null in the records): the optimizer skipped or zeroed the step
    for r in metrics:
        g = r.get("grad_norm", 0.0)
        nan_grad = nan_grad + 1 if g is None or (isinstance(g, float) and not math.isfinite(g)) else 0
        if nan_grad >= NO_UPDATE_STEPS:
            return Alert("no_update", r["step"], f"grad_norm NaN on {nan_grad} logged steps in a row (to step "
                                                 f"{r['step']}): no update reaches the weights")
    zero_grad = 0  # a logged grad_norm of exactly 0: that optimizer step changed nothing
    for r in metrics:
        g = r.get("grad_norm")
        zero_grad = zero_grad + 1 if isinstance(g, (int, float)) and g == 0 else 0
        if zero_grad >= NO_UPDATE_STEPS:
            return Alert("no_update", r["step"], f"grad_norm exactly 0 on {zero_grad} logged steps in a row (to step "
                                                 f"{r['step']}): no update")
    run = 0
    for r in metrics:
        reward, loss = r.get("reward"), r.get("loss")
        flat = isinstance(reward, (int, float)) and isinstance(loss, (int, float)) and abs(reward) <= ZERO \
            and abs(loss) <= ZERO
        run = run + 1 if flat else 0
        if run >= NO_UPDATE_STEPS:
            return Alert("no_update", r["step"], f"reward 0 and loss 0 for {run} steps in a row (to step {r['step']})")
    return None


def kl_spike(metrics: list[dict]) -> Alert | None:
    kl = series(metrics, "kl")
    for i, (step, v) in enumerate(kl):
        before = [x for _, x in kl[max(0, i - KL_WINDOW):i]]
        if len(before) < KL_MIN_HISTORY or v <= KL_SPIKE_MIN:
            continue
        med = statistics.median(before)
        if v > KL_SPIKE_FACTOR * med:
            ratio = f"{v / med:.1f}x" if med > 0 else "inf x"
            return Alert("kl_spike", step, f"kl {v:.4g} = {ratio} the median {med:.3g} of the {len(before)} steps "
                                           f"before (threshold {KL_SPIKE_FACTOR:g}x)")
    return None


def update_spike(metrics: list[dict]) -> Alert | None:
    """update_norm (how far the step moved the trainable weights) above UPDATE_SPIKE_FACTOR x the median of the
    steps before it, or above UPDATE_RUNAWAY_FACTOR x it at the end of a run of growing steps (UPDATE_RUNAWAY_*);
    steps with a zero gradient left out."""
    # steps whose gradient was exactly 0 (every group alike) moved by weight decay alone: not a step size to
    # compare the first real update with
    moved = series([r for r in metrics if r.get("grad_norm") != 0], "update_norm")
    for i, (step, v) in enumerate(moved):
        before = [x for _, x in moved[max(0, i - KL_WINDOW):i]]
        if len(before) < KL_MIN_HISTORY or (med := statistics.median(before)) <= 0:
            continue
        run = [x for _, x in moved[i - UPDATE_RUNAWAY_STEPS:i + 1]]
        growth = [b / a for a, b in zip(run, run[1:], strict=False) if a > 0]
        if v > UPDATE_SPIKE_FACTOR * med:
            return Alert("update_spike", step, f"the weights moved {v:.3g} at step {step} = {v / med:.1f}x the median "
                                               f"{med:.3g} of the {len(before)} steps before (threshold "
                                               f"{UPDATE_SPIKE_FACTOR:g}x): the lr or the gradient jumped")
        if v > UPDATE_RUNAWAY_FACTOR * med and len(growth) == UPDATE_RUNAWAY_STEPS and \
                min(growth) >= UPDATE_RUNAWAY_GROWTH:
            return Alert("update_spike", step, f"the weights' step grew x{' then x'.join(f'{g:.2g}' for g in growth)} "
                                               f"to {v:.3g} at step {step} = {v / med:.1f}x the median {med:.3g} of "
                                               f"the {len(before)} steps before (thresholds x{UPDATE_RUNAWAY_GROWTH:g} "
                                               f"per step, {UPDATE_RUNAWAY_FACTOR:g}x): the lr or the gradient runs "
                                               "away")
    return None


def kl_blowup(metrics: list[dict]) -> Alert | None:
    """Mean KL over WINDOW steps above KL_BLOWUP: far from the reference, with or without a held-out stream."""
    kl = series(metrics, "kl")
    for step, m in _windows(kl):
        if m > KL_BLOWUP:
            return Alert("kl_blowup", step, f"kl {m:.3g} (mean of {_span(kl)} records to {step}) > {KL_BLOWUP:g} "
                                            "nats/token: the policy samples far from its reference")
    return None


def entropy_rise(metrics: list[dict]) -> Alert | None:
    """Mean entropy over WINDOW steps at or above ENTROPY_RISE_RATIO x the first WINDOW steps' and ENTROPY_RISE_MIN
    nats above them (the policy diffusing; entropy_collapse watches the other direction)."""
    ent = series(metrics, "entropy")
    n = _span(ent)
    if len(ent) < 2 * n:
        return None
    head = math.fsum(v for _, v in ent[:n]) / n
    for i, (step, m) in enumerate(_windows(ent, n)):
        if i >= n and head > 0 and m >= ENTROPY_RISE_RATIO * head and m - head >= ENTROPY_RISE_MIN:
            return Alert("entropy_rise", step, f"entropy {m:.3g} (mean of {n} records to {step}) vs {head:.3g} in "
                                               f"the first {n} (>= {ENTROPY_RISE_RATIO:g}x)")
    return None


def truncation(metrics: list[dict]) -> Alert | None:
    """Mean clipped share over WINDOW steps above CLIPPED_HIGH; where a trainer logs no clipped share but the
    mean length of completions that ended (TRL's mean_terminated_length), a step with none ended counts as all cut."""
    clipped = series(metrics, "completion_clipped_ratio")
    if not clipped:
        clipped = [(s, 1.0 if v == 0 else 0.0) for s, v in series(metrics, "terminated_length")]
    by_step = {r["step"]: r for r in metrics if isinstance(r.get("step"), int)}
    for step, m in _windows(clipped):
        if m > CLIPPED_HIGH:
            r = by_step.get(step, {})
            lengths = (f"; at step {step} the longest completion is {r['completion_length_max']:g} tokens, those that "
                       f"ended average {r['terminated_length']:.3g}" if "completion_length_max" in r and
                       "terminated_length" in r else "")
            return Alert("truncation", step, f"{m:.0%} of completions cut at max_completion_tokens (mean of "
                                             f"{_span(clipped)} records to {step}; > {CLIPPED_HIGH:.0%}): an answer "
                                             f"cut off scores as wrong{lengths}")
    return None


def entropy_collapse(metrics: list[dict]) -> Alert | None:
    ent = series(metrics, "entropy")
    n = _span(ent)
    if len(ent) < 2 * n:
        return None
    head = math.fsum(v for _, v in ent[:n]) / n
    for i, (step, m) in enumerate(_windows(ent, n)):
        if i < n:  # the head itself is not a collapse from the head
            continue
        if m < ENTROPY_COLLAPSE_RATIO * head:
            return Alert("entropy_collapse", step,
                         f"entropy {m:.3g} (mean of {n} records to {step}) vs {head:.3g} in the first {n} "
                         f"(< {ENTROPY_COLLAPSE_RATIO:g}x)")
    return None


def zero_std(metrics: list[dict]) -> Alert | None:
    by_step = {r["step"]: r for r in metrics if isinstance(r.get("step"), int)}
    zs = series(metrics, "frac_zero_std")
    for step, m in _windows(zs):
        if m > FRAC_ZERO_STD_HIGH:
            r = by_step[step]
            split = ""
            if "frac_groups_all_correct" in r and "frac_groups_all_wrong" in r:
                split = (f"; at step {step} all correct {r['frac_groups_all_correct']:.0%}, all wrong "
                         f"{r['frac_groups_all_wrong']:.0%}")
            return Alert("zero_std", step, f"{m:.0%} of groups have identical rewards (mean of {_span(zs)} records to "
                                           f"{step}; > {FRAC_ZERO_STD_HIGH:.0%}): no gradient signal{split}")
    return None


def reward_accuracy_gap(metrics: list[dict], evals: list[dict], max_reward: float) -> Alert | None:
    """At an eval after the base: train reward (mean of WINDOW steps to it) up by GAP_REWARD_RISE x max_reward from
    the first WINDOW steps, while accuracy is at most GAP_ACC_FLAT above the base eval's."""
    reward = series(metrics, "reward")
    acc = series(evals, "accuracy")
    if len(reward) < 2 * WINDOW or len(acc) < 2:
        return None
    base_step, base = acc[0]
    head = math.fsum(v for _, v in reward[:WINDOW]) / WINDOW
    for step, a in acc[1:]:
        upto = [v for s, v in reward if s <= step][-WINDOW:]
        if step <= base_step or len(upto) < WINDOW or len([s for s, _ in reward if s <= step]) < 2 * WINDOW:
            continue
        tail = math.fsum(upto) / WINDOW
        if tail - head > GAP_REWARD_RISE * max_reward and a - base <= GAP_ACC_FLAT:
            rise = (tail - head) / max_reward
            return Alert("reward_accuracy_gap", step,
                         f"train reward {head:.3g} -> {tail:.3g} (+{rise:.0%} of max {max_reward:.3g}) while eval "
                         f"accuracy {base:.3g} -> {a:.3g} (step {base_step} -> {step}): suspected reward hacking")
    return None


def sampler_mismatch(metrics: list[dict]) -> Alert | None:
    """The sampler and the trainer disagree on the policy (metrics.sampler_gap_series: mean |log pi_train -
    log pi_sampler|, else |KL(sampler || train)|): its mean over WINDOW steps above SAMPLER_GAP_HIGH, or above a
    tenth of it and SAMPLER_GAP_GROWTH times the first WINDOW steps' (a growing gap)."""
    key, gap = sampler_gap_series(metrics)
    if not gap:
        return None
    head, n = None, _span(gap)
    for i, (step, m) in enumerate(_windows(gap, n)):
        head = m if i == 0 else head
        if m > SAMPLER_GAP_HIGH:
            return Alert("sampler_mismatch", step, f"{key} {m:.3g} (mean of {n} records to {step}; > "
                                                   f"{SAMPLER_GAP_HIGH:g}): the sampler is off the trained policy")
        if i >= n and m > SAMPLER_GAP_HIGH / 10 and m > SAMPLER_GAP_GROWTH * head:
            return Alert("sampler_mismatch", step, f"{key} {head:.3g} -> {m:.3g} (means of {n} records, to step "
                                                   f"{step}; > {SAMPLER_GAP_GROWTH:g}x the start): the sampler "
                                                   "drifts from the trained policy")
    return None


def check(metrics: list[dict], evals: list[dict] = (), displacement: list[dict] = (),
          max_reward: float = 1.0) -> list[Alert]:
    """Every alert that has fired, in the order of NAMES."""
    metrics = sorted((r for r in metrics if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    evals = sorted((r for r in evals if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    found = [no_update(metrics, list(displacement)), update_spike(metrics),
             kl_spike(metrics), kl_blowup(metrics), truncation(metrics),
             entropy_collapse(metrics), entropy_rise(metrics), zero_std(metrics),
             reward_accuracy_gap(metrics, evals, max_reward), sampler_mismatch(metrics)]
    return [a for a in found if a is not None]


# ---- in a trainer: print each alert once ---------------------------------------------------------------------
class Watcher:
    """Holds a run's records as they come and prints each alert once, the first time it fires."""

    def __init__(self, max_reward: float = 1.0, out=None):
        self.max_reward = max_reward
        self.metrics: list[dict] = []
        self.evals: list[dict] = []
        self.displacement: list[dict] = []
        self.fired: dict[str, Alert] = {}
        self.out = out

    def update(self, metrics=(), evals=(), displacement=(), announce: bool = True) -> list[Alert]:
        """Add records; print (unless `announce` is False: records of a resumed run) and return the alerts that
        fire for the first time."""
        self.metrics += list(metrics)
        self.evals += list(evals)
        self.displacement += _per_step(displacement)
        new = [a for a in check(self.metrics, self.evals, self.displacement, self.max_reward)
               if a.alert not in self.fired]
        for a in new:
            self.fired[a.alert] = a
            if announce:
                print(f"mechdiag: alert {a.alert} at step {a.step}: {a.evidence}", file=self.out or sys.stderr,
                      flush=True)
        return new


def _per_step(rows) -> list[dict]:
    """Displacement rows summed per step into one row (metrics.group_norms), which is all no_update reads:
    a long run's history stays a row per recorded step."""
    sums = group_norms(rows, lambda r: r["step"] if isinstance(r.get("step"), int) and r.get("ref_fro") is not None
                       else None)
    return [{"step": s, "delta_fro": math.sqrt(d), "ref_fro": math.sqrt(ref)} for s, (d, ref) in sums.items()]
