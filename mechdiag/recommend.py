"""From diagnostics to a refined config (paper-notes §5): each rule is a symptom detector over the recorded
signals of one or more run directories, a treatment on the Config, the evidence that fired it and a confidence.

Every threshold is a named constant below (those the live alerts share: metrics.py) and is explained in
docs/recommendations.md. Several runs (seeds of
one config) are pooled: train and eval signals are averaged per step, displacement and shift shares per run
then averaged. A healthy run fires no rule and leaves the config unchanged; a run with too few train records is
not judged at all (too_few_records), and a run with no learning signal (no_signal) gets its cause, not tuning.
Rules judge a cause together with its cost: a symptom that costs nothing (entropy falling while held-out
accuracy rises and the groups still differ) changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mechdiag import config as configlib
from mechdiag.compare import side_by_side
from mechdiag.config import ALL_MODULES, Config, parse_layers
from mechdiag.errors import UserError
from mechdiag.evidence import MIN_POINTS, WINDOW_FRAC, Signals
from mechdiag.metrics import (  # the thresholds the live alerts share
    CLIPPED_HIGH,
    ENTROPY_COLLAPSE_RATIO,
    ENTROPY_RISE_MIN,
    ENTROPY_RISE_RATIO,
    FRAC_ZERO_STD_HIGH,
    KL_BLOWUP,
    SAMPLER_GAP_GROWTH,
    SAMPLER_GAP_HIGH,
    counts_right,
    sampler_gap_series,
    whole_batches_at_cap,
)
from mechdiag.metrics import is_number as _num
from mechdiag.parts import family_name
from mechdiag.reward_check import CORRECT_MARGIN_MIN
from mechdiag.run import Run, final_eval, flatten_config, group_runs
from mechdiag.tasks import reward_weights

# ---- thresholds (docs/recommendations.md) -----------------------------------------------------------------
MIN_RECORDS = 8  # fewer train records than this: too few to judge at all (two per head/tail window)
CONFIDENT_POINTS = 20  # train records for full confidence from the data-size factor

REWARD_CV_LOW = 0.10  # tail mean within-group reward CV below this: groups barely differ
REWARD_HIGH_FRAC = 0.75  # reward at or above this share of the maximum counts as "high" (7B-on-MCQ case)
REWARD_LOW_FRAC = 0.10  # below this share the data is too hard: easier data once temperature is at its cap
TEMPERATURE_STEP = 0.2  # raise sampling temperature by this much per round...
TEMPERATURE_MAX = 1.2  # ...up to this
TEMPERATURE_FLOOR = 0.7  # ...and at least to this: the low end of the working range (study 0.8, TRL 1.0)
EPSILON_HIGH_TARGET = 0.3  # the study's asymmetric upper clip (0.2 -> 0.3)

KL_HIGH = 0.10  # tail mean per-token KL to the reference above this (nats) is high
KL_RISE_RATIO = 1.5  # tail mean over the mean of the second quarter above this is "rising"...
KL_RISE_MIN = 0.02  # ...when the tail mean is also above this (ignore noise near zero)
ACC_DROP = 0.02  # eval accuracy this far below its best (base included) is "falling"
BETA_FACTOR = 3.0  # the study's 0.003 -> 0.01
BETA_FROM_ZERO = 0.005  # beta when it was 0 (Table 7's math/code value)
BETA_MAX = 0.2  # never raise beta above this; lower the learning rate instead
LR_FACTOR = 0.5

REWARD_RISE_FRAC = 0.10  # tail minus head reward above this share of the maximum reward is "rising"
ACC_FLAT = 0.01  # final minus base accuracy at or below this is "flat or falling"
CORRECT_SHARE_MAX = 0.5  # where reward/correctness is recorded: fire only if it paid for less of the rise
CORRECTNESS_FACTOR = 2.0  # the study's code reshaping 1.0 -> 2.0
CORRECTNESS_MAX = 8.0
FORMAT_FACTOR = 0.5
FORMAT_MIN = 0.05
FORMAT_COMPONENTS = ("xml_count", "format", "numeric", "reasoning_nonempty", "answer_nonempty", "valid_option",
                     "syntax")

LENGTH_SHRINK = 0.10  # or: clipped above CLIPPED_HIGH in the head and the length shrank by this share since
LENGTH_NEAR_BUDGET = 0.80  # or: tail mean completion length above this share of the budget...
CLIPPED_SOME = 0.01  # ...after head or tail cut some completions: the policy settled just under the cap
COMPLETION_FACTOR = 1.5
COMPLETION_TOKENS_MAX = 1024
WHOLE_CUT_SHARE = 0.1  # truncation without a clipped stream: at least this share of the batches cut whole

END_LAYERS = 2  # the study's reduced layers: first 2 and last 2
END_RATIO = 2.0  # mean per-layer share at the ends over the middle's mean above this is "concentrated"
END_RATIO_STRONG = 4.0  # concentrated this much fires even without a regression
MIN_LAYERS_FOR_ENDS = 2 * END_LAYERS + 2  # need a middle of at least 2 layers
LAYERS_KEPT_MIN = 4  # reduced_layers by attribution keeps at least this many layers (bench/selection.py --study)

MODULE_MASS_COVER = 0.5  # the fewest modules that carry this share of the update mass...
MODULE_CONCENTRATION = 1.5  # ...carry at least this many times their uniform share...
MIN_MODULES = 2  # ...and we keep at least this many modules (the study's v_proj + o_proj)
LORA_RANK_LOW = 32  # narrow_lora widens to all linear layers at this rank at most (LoRA Without Regret: 1-32)
CONTROL_GAIN = 0.02  # a held-out gain above this earns the note: trust it beside a random-reward control run

CV_FALL_RATIO = 0.5  # ...and costs diversity when the tail reward CV fell below this share of the head's

NO_SIGNAL_NEAR = 0.95  # ...or groups alike on this share on average over the run: a sliver of signal, a floor
NO_SIGNAL_EPS = 1e-9  # reward (or correctness) at most this on every record: nothing to learn from
NO_SIGNAL_FORMAT_MIN = 0.05  # under this share of sampled completions with a closed answer block: format never made
NO_SIGNAL_MIN_BUDGET = 24  # a budget under this many tokens cannot hold a reasoning + answer block (arith needs ~22)

KL_STILL = 0.01  # held_still: tail mean KL to the reference below this (nats/token)...
REWARD_STILL_MIN = 16  # ...without an eval stream, a train reward flat over at least this many records, whose
REWARD_STILL_NOISE = 0.25  # ...step-to-step noise (2 SE of head vs tail) is under this share of its span
EVAL_REWARD_FLAT = 0.02  # ...eval reward gain at most this share of the maximum, accuracy gain <= ACC_FLAT...
BETA_FREE_DIV = 10.0  # ...with beta on: beta / this, at most BETA_FREE_MAX; with beta 0: the learning rate, sized
BETA_FREE_MAX = 0.01
HELD_ZERO_STD_MAX = 0.9  # ...while fewer than this share of the groups score all alike (the groups still differ)

# sick starts (docs/recommendations.md, "Sized from the evidence"; bench/clinic.py measures each)
KL_WORKING = 0.01  # the per-token KL a short run that learns reaches (embedded default: 0.005-0.01 by step 12)
WORKING_STEPS = 12  # ...after this many steps; a step of Adam moves ~lr in a steady direction, so a working run's
# KL grows with the square of its steps (20 steps: 0.033 measured, (20/12)^2 x 0.01 = 0.028)...
KL_WORKING_MAX = 0.04  # ...and levels off as the schedule decays and the policy settles (40 steps: 0.048)
LR_FREE_MIN, LR_FREE_MAX = 3.0, 100.0  # held_still's learning-rate factor sqrt(KL_WORKING / kl), within these
COLLAPSE_FRAC = 0.5  # step_too_large: final held-out accuracy under this share of its best (base included)...
KL_COLLAPSE = 1.0  # ...with the tail KL above this (nats/token): the policy left its base, it did not drift
LR_CUT_MIN, LR_CUT_MAX = 3.0, 100.0  # the learning rate is divided by sqrt(kl_head / KL_WORKING), within these
GROUP_SIZE_USUAL = 8  # group_small: groups smaller than this (the study's and TRL's usual 8)...
ZERO_STD_TARGET = 0.25  # ...grow until the expected share of equal-reward groups falls under this
GROUP_SIZE_MAX = 32
CLIP_FRACTION_HIGH = 0.2  # clip_tight: with num_iterations > 1, a tail policy_clip_fraction above this...
CLIP_FRACTION_TARGET = 0.05  # ...widens epsilon until about this share of tokens would be clipped...
EPSILON_WORKING = 0.2  # ...at most to the usual 0.2 (the study's, TRL's default); an epsilon under a tenth of it
CLIP_BINDS = 0.01  # that clips more than this share is a setting off the working range: it goes there in one round
ROLLOUTS_USUAL = 64  # group_small: larger groups keep the prompts per step up to this many rollouts (8 x 8)
HOT_RATIO = 0.5  # sampling_too_hot: the rollouts' success rate (head and tail) under this share of the greedy base...
HOT_MIN_BASE = 0.1  # ...accuracy, where greedy decoding solves at least this share (a ratio of noise below it)...
TEMPERATURE_MODEL = 1.0  # ...cools the temperature to the model's own distribution, or from there to the floor
LORA_NARROW_FRAC = 0.25  # lora_narrow: LoRA on under this share of the model's (layer, module) sites
CORRECTNESS_SHARE_MIN = CORRECT_MARGIN_MIN  # correctness_unpaid: correctness under this share of the maximum

SATURATION_FRAC = 0.9  # reward at or above this share of its own scale (Signals.reward_scale) is saturated...
SATURATED_GROUPS = 0.5  # ...or, with no scale shown, this share of the groups all correct (group outcomes)
SATURATION_EARLY = 0.3  # ...reached within this share of the steps is "early"
DIFFICULTY_MAX = 4  # arith's hardest level

NO_UPDATE_NAN_SHARE = 0.5  # grad_norm or loss NaN on at least this share of the logged steps: no update reached...
CLIPPED_NEARLY_ALL = 0.9  # no_update: grad_norm 0 where more than this share was cut (all masked, nothing learns)
NO_UPDATE_KL_EPS = 0.0  # ...or kl exactly this at every logged step (the policy never left its reference)
NO_UPDATE_KL_MOVED = 1e-4  # a KL that grows over the steps of grad_norm 0 shows updates (a logger's 0, not the run's)
GRAD_BURST = 100.0  # kl_blowup: a grad_norm this many times the run's median beside it is named with it
KL_BLOWUP_RISE = 10.0  # kl_blowup: tail KL above KL_BLOWUP, or above KL_HIGH and this many times the head's, no eval
REWARD_STALL = 0.05  # entropy_rise: reward gained at most this share of its span (or held-out accuracy fell)
DECLINE_SHARE = 0.1  # reward_declined: the tail this share of the reward's span under its best window (and 4 SE)
ENTROPY_FLOOR = 0.01  # entropy_collapse where the log does not show the fall: tail entropy under this (nats/token)
LENGTH_COLLAPSE_RATIO = 0.3  # tail completion length below this share of the head's...
LENGTH_COLLAPSE_TOKENS = 16  # ...and under this many tokens: completions shrank to nothing
REPEAT_NGRAM = 4  # degenerate text: the share of repeated word 4-grams in a completion...
REPEAT_SHARE = 0.5  # ...above this (or an empty completion)...
DEGENERATE_SAMPLES = 0.3  # ...in at least this share of the latest sampled completions
DEGENERATE_MIN_WORDS = 12  # completions shorter than this are not judged for repetition


# ---- findings ---------------------------------------------------------------------------------------------
@dataclass
class Change:
    key: str  # dotted config path
    old: object
    new: object
    rule: str = ""

    def __str__(self) -> str:
        if isinstance(self.old, dict) and isinstance(self.new, dict):  # name only the entries that change
            keys = [k for k in {**self.old, **self.new} if self.old.get(k) != self.new.get(k)]
            return f"{self.key}: " + ", ".join(f"{k} {_show(self.old.get(k))} -> {_show(self.new.get(k))}"
                                               for k in keys)
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"

    def record(self) -> dict:
        return {"key": self.key, "old": self.old, "new": self.new, "rule": self.rule}


@dataclass
class Finding:
    rule: str
    symptom: str
    evidence: str  # the numbers and steps that fired the rule
    changes: list[Change]
    reason: str
    confidence: float
    data: dict = field(default_factory=dict)  # the same numbers, machine-readable
    onset: int | None = None  # the first step the symptom holds from (None: the whole run, or not a trend)
    cost: dict = field(default_factory=dict)  # Signals.cost: steps since onset, rollouts on zero-advantage groups

    def record(self) -> dict:
        rec = {"kind": "finding", "rule": self.rule, "symptom": self.symptom, "evidence": self.evidence,
               "change": "; ".join(str(c) for c in self.changes) or "none (advice only)",
               "reason": self.reason, "confidence": self.confidence, "onset_step": self.onset}
        rec.update({f"evidence.{k}": v for k, v in self.data.items()})
        rec.update({f"cost.{k}": v for k, v in self.cost.items()})
        return rec


def _show(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_show(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return str(v)


def confidence(margin: float, n_points: int) -> float:
    """0.5 at the threshold, rising to 0.95 when the signal is past it by its own size (margin 1), scaled down
    when few train records back it."""
    base = 0.5 + 0.45 * min(1.0, max(0.0, margin))
    return round(base * min(1.0, 0.5 + 0.5 * n_points / CONFIDENT_POINTS), 2)


# ---- rules ------------------------------------------------------------------------------------------------
RuleFn = Callable[[Signals], "Finding | None"]
RULES: list[tuple[str, str, RuleFn]] = []


def rule(name: str, symptom: str):
    def register(fn: RuleFn) -> RuleFn:
        RULES.append((name, symptom, fn))
        fn.rule_name, fn.symptom = name, symptom
        return fn
    return register


def _finding(fn, evidence: str, changes: list[Change], reason: str, conf: float, onset: int | None = None,
             **data) -> Finding:
    return Finding(fn.rule_name, fn.symptom, evidence, changes, reason, conf, data, onset)


def _raise_temperature(cfg: Config) -> Change | None:
    if cfg.temperature >= TEMPERATURE_MAX - 1e-9:
        return None
    # a temperature far under the working range goes to its floor in one round, not by 0.2 steps
    new = max(cfg.temperature + TEMPERATURE_STEP, TEMPERATURE_FLOOR)
    return Change("temperature", cfg.temperature, round(min(TEMPERATURE_MAX, new), 4))


def _raise_epsilon_high(cfg: Config) -> Change | None:
    """None also at num_iterations 1: each rollout is used for one update, the ratio is exactly 1 and no clip
    binds, so a wider clip cannot act."""
    if cfg.num_iterations <= 1:
        return None
    if (cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high) >= EPSILON_HIGH_TARGET - 1e-9:
        return None
    return Change("epsilon_high", cfg.epsilon_high, EPSILON_HIGH_TARGET)


def _raise_beta(cfg: Config) -> Change | None:
    if cfg.beta >= BETA_MAX - 1e-12:
        return None
    new = BETA_FROM_ZERO if cfg.beta == 0 else min(BETA_MAX, cfg.beta * BETA_FACTOR)
    return Change("beta", cfg.beta, round(new, 6))


def _difficulty(cfg: Config) -> int | None:
    level = cfg.task.options.get("difficulty", 2 if cfg.task.name == "arith" else None)
    return level if isinstance(level, int) and not isinstance(level, bool) else None


def _easier_data(cfg: Config) -> Change | None:
    level = _difficulty(cfg)
    if level is None or level <= 1:
        return None
    return Change("task.options", dict(cfg.task.options), {**cfg.task.options, "difficulty": level - 1})


def _saturated(s: Signals) -> tuple[float, str] | None:
    """The tail reward when it sits at the top of the reward's own scale (Signals.reward_scale), or most groups
    are all correct (group outcomes); None without either: a flat mean alone is never "saturated"."""
    tail = s.window("reward", "tail")
    if tail is None:
        return None
    level = s.reward_level(tail[0])
    if level is not None and level >= SATURATION_FRAC:
        return tail
    solved = s.window("frac_groups_all_correct", "tail")
    if level is None and solved and solved[0] >= SATURATED_GROUPS:
        return tail
    return None


# With fewer than MIN_RECORDS train records only these rules run: each judges a level that holds at any record
# (NaN or zero gradients, completions cut at the budget, a blown KL, text that degenerated), not a trend
LEVEL_RULES = ("no_update", "run_crashed", "cannot_judge", "no_signal", "component_never_pays", "truncation",
               "kl_blowup", "low_diversity", "length_collapse", "degenerate_text")
FEW_MIN_POINTS = 2  # ...reading head and tail windows from as few as this many records


@rule("too_few_records", "too few train records to judge trends: only the rules that read levels are run")
def too_few_records(s: Signals):
    if s.n_train >= MIN_RECORDS:
        return None
    return _finding(too_few_records, f"too few records to judge ({s.n_train} < {MIN_RECORDS} train records)", [],
                    "train longer (more steps, or a larger max_time_s) before judging the run", 0.95,
                    n_records=s.n_train, min_records=MIN_RECORDS)


def _raise_budget(s: Signals) -> Change | None:
    """A longer completion budget, inside the model's context (the refined config must train: prompts then keep
    fewer tokens, models.fit_prompt_budget) when the run shows its model (a foreign run that does not is never
    held to our default model's context)."""
    from mechdiag.models import context_of  # noqa: PLC0415 - transformers, only when a budget is raised

    cfg = s.cfg
    cur = cfg.max_completion_tokens
    top = COMPLETION_TOKENS_MAX
    context = context_of(cfg.model.name_or_path) if s.known("model.name_or_path") else None
    if context is not None:
        top = min(top, context - 1)
    if cur >= top:
        return None
    # a budget under NO_SIGNAL_MIN_BUDGET cannot hold reasoning + answer: twice that floor, not one 1.5x step
    floor = 2 * NO_SIGNAL_MIN_BUDGET if cur < NO_SIGNAL_MIN_BUDGET else 0
    new = min(top, max(floor, int(math.ceil(cur * COMPLETION_FACTOR / 8) * 8)))
    return Change("max_completion_tokens", cur, new)


def _how(s: Signals, key: str) -> str:
    """How the run shows config key `key`, for evidence text."""
    held = s.known(key)
    if s.provenance is None:
        return "its config"
    return f"{held.get('how')} from {held.get('evidence')}" if held else "not shown"


def _success(s: Signals) -> tuple[list[list[float]], str]:
    """The values of each stream that counts answers right (held-out accuracy, a correctness reward, a solved or
    win rate; the base eval as one more), and the name of the first, or ([], "")."""
    streams, names = [], []
    for stream, src in (("eval", s.eval), ("train", s.train)):
        keys = sorted({k for d in src.values() for k in d if counts_right(k)})
        for k in keys:
            streams.append(s.series(k, stream)[1])
            names.append(k)
    if "accuracy" in s.base:
        streams.append([s.base["accuracy"]])
    return [v for v in streams if v], (names[0] if names else "accuracy")


def _never_right(streams: list[list[float]]) -> bool:
    """No answer was ever right: every success stream is one value at or below 0 throughout (a batch mean of a
    signed reward, -2.6 one step and -2.0 the next, can hide a right answer among penalties; a constant cannot)."""
    return bool(streams) and all(max(v) <= NO_SIGNAL_EPS and max(v) - min(v) <= NO_SIGNAL_EPS for v in streams)


@rule("no_update", "the weights never moved: grad_norm NaN or exactly 0 at most steps (loss NaN), or KL exactly 0 "
      "at every step")
def no_update(s: Signals):
    hits, onset = [], None
    for key in ("grad_norm", "loss"):
        bad, logged = s.nonfinite(key), s.logged(key)
        if logged and len(bad) >= NO_UPDATE_NAN_SHARE * len(logged):
            hits.append(f"{key} NaN/inf at {len(bad)} of {len(logged)} logged steps ({bad[0]}..{bad[-1]})")
            onset = bad[0] if onset is None else min(onset, bad[0])
    # grad_norm exactly 0 where the groups differ: the loss reached no weight (every token masked, e.g. truncated
    # completions left out of the loss while nearly all were cut, or a frozen model)
    z_steps, zero_std = s.series("frac_zero_std")
    all_alike = {st for st, v in zip(z_steps, zero_std, strict=True) if v >= 1 - NO_SIGNAL_EPS}
    g_steps, grads = s.series("grad_norm")
    zero_grad = [st for st, g in zip(g_steps, grads, strict=True) if g == 0.0 and st not in all_alike]
    steps, kl = s.series("kl")
    kl_at = dict(zip(steps, kl, strict=True))
    kl_zero = [kl_at[st] for st in zero_grad if st in kl_at]
    moved = len(kl_zero) >= 2 and kl_zero[-1] > max(NO_UPDATE_KL_MOVED, 1.5 * kl_zero[0])  # a 0 logged, not made
    masked = False  # the zero gradients come from completions all cut at the budget and left out of the loss
    if g_steps and len(zero_grad) >= NO_UPDATE_NAN_SHARE * len(g_steps) and len(zero_grad) >= 2 and not moved:
        hit = (f"grad_norm exactly 0 at {len(zero_grad)} of {len(g_steps)} logged steps "
               f"({zero_grad[0]}..{zero_grad[-1]})")
        cut = dict(zip(*s.series("completion_clipped_ratio"), strict=True))
        cut_there = [cut[st] for st in zero_grad if st in cut]
        masked = bool(cut_there) and min(cut_there) > CLIPPED_NEARLY_ALL
        if masked:
            hit += (f", where at least {min(cut_there):.0%} of completions were cut at the budget: with truncated "
                    "completions left out of the loss (mask_truncated_completions, DAPO's overlong filter) no token "
                    "is left to learn from")
        hits.append(hit)
        onset = zero_grad[0] if onset is None else min(onset, zero_grad[0])
    _, rstd = s.series("reward_std")
    # KL stays 0 also when every group scores alike (no advantage, no gradient): no_signal's case, not this one.
    # reward_std is a batch statistic (TRL, verl): it tells groups apart only where frac_zero_std is not logged
    differ = min(zero_std) < 1 - NO_SIGNAL_EPS if zero_std else bool(rstd) and max(rstd) > NO_SIGNAL_EPS
    if differ and _kl_all_zero(s) and (_kl_measured(s) or hits):  # a KL 0 at beta 0 alone is no evidence
        hits.append(f"kl exactly 0 at all {len(kl)} logged steps ({steps[0]}..{steps[-1]}): the policy never left "
                    "its reference")
        onset = steps[0] if onset is None else min(onset, steps[0])
    if not hits or (len(hits) == 1 and hits[0].startswith("loss")):
        return None
    changes = []
    if masked and len(hits) == 1:  # the cause is the budget: completions that end inside it have tokens to learn
        change = _raise_budget(s)
        changes = [change] if change else []
        reason = ("no update reached the weights: nearly every completion ran into the completion budget and was "
                  "masked out of the loss; a longer budget (or a prompt or length penalty that ends completions "
                  "sooner) leaves tokens to learn from")
    else:
        reason = ("no update reached the weights: a NaN gradient is skipped or zeroed (check fp16 overflow, the "
                  "learning-rate warm-up from 0, bf16 support, a reward that returns NaN, a frozen model); fix the "
                  "cause before tuning")
    return _finding(no_update, "; ".join(hits), changes, reason, 0.95, onset=onset, signs=len(hits))


def _kl_all_zero(s: Signals) -> bool:
    _, kl = s.series("kl")
    return len(kl) >= MIN_POINTS and max(abs(v) for v in kl) <= NO_UPDATE_KL_EPS


def _kl_measured(s: Signals) -> bool:
    """Whether a logged KL measures the drift: mechdiag always scores the rollout against its reference, TRL and
    Unsloth only with beta > 0 (at beta = 0 they load no reference and log kl 0, or nothing)."""
    beta = s.value("beta")
    return s.provenance is None or (beta is not None and beta > 0)


@rule("run_crashed", "the log ends in a traceback after its last record: the run did not finish")
def run_crashed(s: Signals):
    error = s.ending.get("error")
    if not error:
        return None
    last = max(s.train) if s.train else None
    planned = s.ending.get("planned_steps")
    where = f"after step {last}" if last is not None else "before its first record"
    first = s.ending.get("first_error")
    ev = (f"the log ends in a traceback {where}" + (f" of {planned} planned" if planned else "") + f": {error}"
          + (f" (the first error logged after it: {first})" if first else ""))
    return _finding(run_crashed, ev, [], "the run did not finish: fix the error first (a crash in a checkpoint save "
                    "loses the final weights, one in the generator or the reward stops the run); the other findings "
                    "read the steps it logged", 0.95, onset=last, planned_steps=planned)


@rule("cannot_judge", "a stream the diagnosis needs is missing: what it would show cannot be judged")
def cannot_judge(s: Signals):
    missing = []
    if _kl_all_zero(s) and not _kl_measured(s):
        missing.append("drift from the base (kl exactly 0 at every step: TRL and Unsloth log 0 when beta = 0, with no "
                       "reference model; were beta above 0, the policy never moved)")
    keys = {k for d in s.train.values() for k in d}
    if "kl_signed" in keys:
        signed = s.series("kl_signed")[1]
        missing.append(f"drift from the base: the logged kl is negative on {sum(v < 0 for v in signed)} of "
                       f"{len(signed)} records (min {min(signed):.3g}), a signed estimate (a mean log-ratio, k1), not "
                       "a KL to the reference (k3 is never negative): log the k3 estimate")
    if s.series("reward")[1] and not keys & {"kl", "kl_signed", "reward_std", "frac_zero_std", "completion_length",
                                              "completion_clipped_ratio", "entropy"}:
        missing.append("drift, diversity and truncation (the log holds the reward and loss only: no kl, reward "
                       "spread, completion length or entropy)")
    if not s.series("reward")[1] and s.train and keys <= {"loss", "lr", "grad_norm", "epoch", "learning_rate"}:
        missing.append("the RL signals: the log holds a loss and the optimizer's values only, as a supervised (SFT) "
                       "run's does; a GRPO trainer logs its reward")
    if not s.series("reward")[1] and not s.series("eval_reward", "eval")[1] and (s.train or s.eval):
        missing.append("reward (no train or held-out reward stream): learning progress, no_signal, saturation and "
                       "diversity cannot be judged")
    if not s.series("reward")[1] and not s.train and s.eval:
        missing.append("train records (the log holds held-out values only): the training signals cannot be judged")
    if not s.train and not s.eval and not s.ending.get("error"):  # run_crashed names a crash
        reached, planned = s.ending.get("reached_step"), s.ending.get("planned_steps")
        missing.append("every signal: the log holds no metric record (nothing printed a reward, loss or KL)"
                       + (f"; its progress bar stops at step {reached}" + (f" of {planned}" if planned else "")
                          + " with no error printed" if reached is not None else ""))
    if not missing:
        return None
    return _finding(cannot_judge, "; ".join(missing), [],
                    "log the missing stream (TRL logs reward with its default logging; verl critic/score/mean), "
                    "or, where it is missing by design (beta 0: no KL), read the findings without it: mechdiag "
                    "does not call a run healthy when it cannot see it", 0.95,
                    missing=len(missing))


@rule("no_signal", "zero reward or zero correct throughout: every group scores the same, nothing to learn from")
def no_signal(s: Signals):
    _, reward = s.series("reward")
    correct, success = _success(s)
    _, zero_std = s.series("frac_zero_std")
    _, rstd = s.series("reward_std")
    # no signal = no spread within the groups: every group all equal, or the reward constant where no spread is
    # logged; a negative or any other constant level is judged the same (all-negative rewards are not "0")
    if zero_std:
        zero_reward = min(zero_std) >= 1 - NO_SIGNAL_EPS
    elif rstd:
        zero_reward = max(rstd) <= NO_SIGNAL_EPS
    else:  # a constant batch mean, unless a batch maximum above it shows completions that scored differently
        _, top = s.series("reward_max_batch")
        zero_reward = len(reward) >= MIN_POINTS and max(reward) - min(reward) <= NO_SIGNAL_EPS and \
            not (top and max(top) > max(reward) + NO_SIGNAL_EPS)
    zero_correct = _never_right(correct)
    died = None if zero_reward or zero_correct else _signal_died(s)
    # nearly none: groups alike on average over the whole run, the rest a sliver (a reward stuck at a floor)
    near = zero_std and len(zero_std) >= MIN_POINTS and sum(zero_std) / len(zero_std) >= NO_SIGNAL_NEAR
    if not (zero_reward or zero_correct or died or near):
        return None
    since = None  # the step the signal was gone from, where it was judged over part or all of the run
    if died:
        since = died[0]
        what = (f"every group's rewards alike from step {died[0]} to the end ({died[1]} of {s.n_train} records; "
                f"{died[2]})")
    elif near and not (zero_reward or zero_correct):
        since = min(s.train)
        alike = sum(v >= 1 - NO_SIGNAL_EPS for v in zero_std)
        what = (f"{sum(zero_std) / len(zero_std):.0%} of groups alike over the run (every group alike on {alike} of "
                f"{len(zero_std)} records; >= {NO_SIGNAL_NEAR:.0%}): almost nothing to learn from")
    elif zero_reward:
        what = (f"reward constant at {reward[0]:.4g}" if reward and max(reward) - min(reward) <= NO_SIGNAL_EPS
                else "every group's rewards all equal")
    else:
        what = f"no correct answer ({success} {correct[0][0]:.4g} throughout)"
    ev = what if since is not None else f"{what} on all {len(reward) or len(correct[0])} records"
    if reward and max(reward) - min(reward) <= NO_SIGNAL_EPS and reward[0] != 0 and not zero_correct:
        ev += f" (one value, {reward[0]:.4g}, whatever was written: often a reward's fallback for a failed parse)"
    # the cause, from the completions themselves: cut at the budget, never in the rewarded format, or wrong
    pool = [x for x in s.samples if isinstance(x.get("completion"), str)]
    pool = [x for x in pool if x.get("split", "train") == "train"] or pool
    tag = s.cfg.rewards.answer_tag
    fmt = (sum(f"<{tag}>" in x["completion"] and f"</{tag}>" in x["completion"] for x in pool) / len(pool)
           if pool else None)
    opened = [f"<{t}>" for t in (s.cfg.rewards.reasoning_tag, "think", tag)]  # a completion that began the format
    started = sum(any(t in x["completion"] for t in opened) for x in pool) / len(pool) if pool else None
    _, clipped = s.series("completion_clipped_ratio")
    cut = sum(clipped) / len(clipped) if clipped else \
        (sum(bool(x.get("truncated")) for x in pool) / len(pool) if pool and "truncated" in pool[0] else 0.0)
    components = _format_components(s)
    if fmt is None:  # no samples recorded: the format components say whether the tags were ever written
        tags = [v for k in components for v in s.series(k)[1]]
        fmt = max(tags) if tags else None
    never_started = started is not None and started < NO_SIGNAL_FORMAT_MIN  # cut or not, a budget will not help
    budget = s.value("max_completion_tokens")
    too_small = budget is not None and budget < NO_SIGNAL_MIN_BUDGET  # ...unless no format could fit in it at all
    peak = _kl_peak(s)
    before = since if since is not None else min(s.train, default=0)
    if peak is not None and not peak[3] and peak[1] <= before:  # it broke first; what it writes since scores alike
        cause = "the policy blew up"
        ev += (f"; kl peaked at {peak[0]:.3g} at step {peak[1]} ({peak[2]} records above {KL_BLOWUP:g} nats/token) "
               "before the signal was gone")
        factor = _clamp(math.sqrt(peak[0] / KL_WORKING), LR_CUT_MIN, LR_CUT_MAX)
        lr = s.value("learning_rate")
        lr = s.cfg.learning_rate if lr is None else lr
        changes = [Change("learning_rate", lr, _sig(lr / factor))]
        reason = (f"the policy blew up (KL past {KL_BLOWUP:g} nat per token) and what it writes since scores alike "
                  f"(cut at the budget, degenerate or empty): a smaller step, the learning rate / {factor:.3g} sized "
                  "by how far the KL went; a longer budget or a hotter sampler cannot help a broken policy")
    elif cut > CLIPPED_HIGH and (too_small or not never_started):
        cause = "budget too short"
        ev += (f"; {cut:.0%} of completions cut at the completion budget"
               + (f" ({_field(s, 'max_completion_tokens')} {budget})" if budget is not None else "")
               + f" (> {CLIPPED_HIGH:.0%}): the answer never fits")
        if too_small:
            ev += f"; a budget under {NO_SIGNAL_MIN_BUDGET} tokens cannot hold the reasoning and answer blocks"
        change = _raise_budget(s)
        reason = ("budget too short: a longer completion budget lets the answer be written" if change else
                  "budget too short and at its cap: shorten the reasoning (prompt, format warm-up) or the task")
        changes = [change] if change else []
    elif fmt is not None and fmt < NO_SIGNAL_FORMAT_MIN:
        cause = "format never produced"
        ev += (f"; {fmt:.0%} of {len(pool)} sampled completions close an <{tag}> block, {started:.0%} open any "
               "tag" if pool else f"; the format components ({', '.join(k[7:] for k in components)}) are 0 "
               "throughout")
        if cut > CLIPPED_HIGH:
            ev += f" ({cut:.0%} cut at the budget, but none had begun the format)"
        changes = []
        fmt_name = "<reasoning>/<answer> format" if s.provenance is None else "format"
        reason = (f"format never produced: the base does not write the rewarded {fmt_name}, so no sampling setting "
                  "can help; teach it first (a short SFT warm-up on gold completions, a prompt with a worked "
                  "example, or an instruct base with its chat template), or check the format the reward parses"
                  + (" (rewards.reasoning_tag / answer_tag)" if s.provenance is None else ""))
    elif fmt is None and not pool and not correct:
        cause = "not shown by the logs"
        ev += "; the logs hold no completions, no format component and no correctness stream to tell why"
        changes = []
        reason = ("the logs cannot say why no group differs: log completions (TRL log_completions, verl "
                  "rollout_data_dir) and score a few by hand: a format the model never writes, a task it never "
                  "solves, or a reward that cannot pay (mechdiag check-reward)")
    else:
        cause = "task too hard"
        ev += (f"; {fmt:.0%} of sampled completions are well-formed but none is correct" if pool and fmt is not None
               else f"; the format components reach {fmt:.3g} but no completion is correct" if fmt is not None
               else "; no completion is correct")
        change = _easier_data(s.cfg)
        changes = [change] if change else []
        reason = ("task too hard: easier data gives some groups a correct member to learn from" if change else
                  "task too hard: mix easier problems into task.mixture, or start from a stronger base")
        if zero_correct and fmt is not None and fmt > 0 and correct[0][0] < 0:
            reason += ("; or the correctness check cannot pay: it is the same value on every record while the "
                       "format components vary, so test it on a known-right completion (mechdiag check-reward)")
    return _finding(no_signal, ev, changes, reason, 0.95, cause=cause, format_share=fmt, clipped_share=cut)


def _signal_died(s: Signals) -> tuple[int, int, str] | None:
    """(the step from which, the records, how) every group's rewards were alike to the end of the run, when that
    stretch holds at least half the records (and MIN_POINTS): a signal that was there and went, not a start."""
    for key, alike in (("frac_zero_std", lambda v: v >= 1 - NO_SIGNAL_EPS),
                       ("reward_std", lambda v: v <= NO_SIGNAL_EPS)):
        steps, vals = s.series(key)
        if len(vals) < MIN_POINTS:
            continue
        k = len(vals)
        while k > 0 and alike(vals[k - 1]):
            k -= 1
        n = len(vals) - k
        if n >= max(MIN_POINTS, len(vals) / 2):
            how = "frac_zero_std 1" if key == "frac_zero_std" else "reward_std 0"
            return steps[k], n, how
        return None  # the first stream logged decides
    return None


def _kl_peak(s: Signals) -> tuple[float, int, int, bool] | None:
    """(the highest KL, its step, how many records were above KL_BLOWUP, whether each was a lone spike: the next
    record back under KL_HIGH or twice the run's median) when at least two were (one on a short run): a policy past
    a nat per token at some point, whether or not it came back."""
    steps, kl = s.series("kl")
    above = [i for i, v in enumerate(kl) if v > KL_BLOWUP]
    if len(above) < (1 if s.min_points < MIN_POINTS else 2):
        return None
    top = max(range(len(kl)), key=kl.__getitem__)
    usual = max(KL_HIGH, 2 * sorted(kl)[len(kl) // 2])  # back where the run usually sits
    lone = all(i + 1 < len(kl) and kl[i + 1] < usual for i in above)
    return kl[top], steps[top], len(above), lone


def _format_components(s: Signals) -> list[str]:
    """The reward components that pay the format (mechdiag's xml_count / format; a foreign run's functions named
    for it: TRL's format_reward, Unsloth's match_format_exactly, the xmlcount of the R1 recipes)."""
    keys = {k for d in s.train.values() for k in d if k.startswith("reward/")}
    return sorted(k for k in keys if "format" in k[7:].lower() or "xml" in k[7:].lower())


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def _sig(x: float) -> float:
    """Two significant figures: a learning rate of 1.7e-3, not 1.7320508e-3."""
    return float(f"{x:.2g}")


@rule("step_too_large", "held-out accuracy collapses while the policy runs far from its base: the step size "
                        "blows the policy up")
def step_too_large(s: Signals):
    trend, kl = s.accuracy_trend(), s.window("kl", "tail")
    if trend is None or kl is None:
        return None
    best, final, base = trend
    if not (final < COLLAPSE_FRAC * best and best - final > ACC_DROP and kl[0] > KL_COLLAPSE):
        return None
    # KL grows with the square of the step while it is small: the factor that would bring it back to a working
    # run's KL is sqrt(kl / KL_WORKING) (bounded: past a collapse KL saturates, so this is a floor on the cut)
    factor = _clamp(math.sqrt(kl[0] / KL_WORKING), LR_CUT_MIN, LR_CUT_MAX)
    lr = s.cfg.learning_rate
    ev = (f"eval accuracy {final:.3g} < {COLLAPSE_FRAC} x best {best:.3g} (base {base:.3g}); kl {kl[0]:.3g} > "
          f"{KL_COLLAPSE} over {kl[1]}, sqrt(kl / {KL_WORKING}) = {math.sqrt(kl[0] / KL_WORKING):.3g}")
    return _finding(step_too_large, ev, [Change("learning_rate", lr, _sig(lr / factor))],
                    f"a smaller step: the learning rate / {factor:.3g}, sized by how far the KL sits above a "
                    "working run's", confidence(1 - final / max(COLLAPSE_FRAC * best, 1e-9), s.n_train),
                    kl_tail=kl[0], accuracy_best=best, accuracy_final=final, lr_factor=1 / factor)


@rule("correctness_unpaid", "the reward pays correctness too little of its maximum: the format is what pays")
def correctness_unpaid(s: Signals):
    w = reward_weights(s.cfg)
    if "correctness" not in w or s.known("rewards.weights") is None:
        return None
    top = s.max_reward
    share = w["correctness"] / top if top > 0 else 1.0
    if share >= CORRECTNESS_SHARE_MIN:
        return None
    others = sum(v for k, v in w.items() if k != "correctness" and v > 0)
    new = {**w, "correctness": round(max(w["correctness"], others), 6)}  # correctness: half the maximum
    ev = (f"correctness weight {w['correctness']:g} is {share:.0%} of the maximum reward {top:.3g} "
          f"(< {CORRECTNESS_SHARE_MIN:.0%}): a wrong but well-formed answer earns {1 - share:.0%} of a correct one "
          "(`mechdiag check-reward` flags it before training)")
    return _finding(correctness_unpaid, ev, [Change("rewards.weights", w, new)],
                    "pay for the answer: correctness as much as every other component together",
                    confidence(1 - share / CORRECTNESS_SHARE_MIN, s.n_train), correctness_share=share)


def _group_growth(s: Signals) -> tuple[int, float, tuple] | None:
    """(group size, share of groups that differ at it over the share now, frac_zero_std window) when many groups
    score all alike and the group is small. A group is all alike with probability ~ q^G for a per-prompt outcome
    q: the share seen at G predicts the share at G' as zero^(G'/G); the smallest power of two that brings it under
    ZERO_STD_TARGET."""
    g, zero = s.cfg.group_size, s.window("frac_zero_std", "tail")
    if g >= GROUP_SIZE_USUAL or zero is None or zero[0] <= FRAC_ZERO_STD_HIGH or _saturated(s):
        return None
    new_g = g
    while new_g < GROUP_SIZE_MAX and zero[0] ** (new_g / g) > ZERO_STD_TARGET:
        new_g *= 2
    if new_g == g:
        return None
    return new_g, (1 - zero[0] ** (new_g / g)) / (1 - zero[0]), zero


@rule("group_small", "many groups score all alike and the group is small: more completions per prompt, the same "
                     "rollouts per step")
def group_small(s: Signals):
    growth = _group_growth(s)
    if growth is None:
        return None
    new_g, _, zero = growth
    g = s.cfg.group_size
    prompts = s.cfg.prompts_per_step
    rollouts = g * prompts
    budget = max(rollouts, ROLLOUTS_USUAL)  # a run under the usual rollouts per step grows to it
    new_p = min(prompts, max(1, budget // new_g))
    ev = (f"frac_zero_std {zero[0]:.3g} > {FRAC_ZERO_STD_HIGH} over {zero[1]} with group_size {g}; expected at "
          f"{new_g}: {zero[0] ** (new_g / g):.2g} (<= {ZERO_STD_TARGET})")
    changes = [Change("group_size", g, new_g)] + ([Change("prompts_per_step", prompts, new_p)] if new_p != prompts
                                                  else [])
    how = (f"the same {rollouts} rollouts per step" if new_g * new_p == rollouts else
           f"{new_g * new_p} rollouts per step instead of {rollouts} (up to the usual {ROLLOUTS_USUAL})")
    return _finding(group_small, ev, changes, f"larger groups, more groups that differ: {how}",
                    confidence((zero[0] - FRAC_ZERO_STD_HIGH) / (1 - FRAC_ZERO_STD_HIGH), s.n_train),
                    frac_zero_std=zero[0], group_size=new_g)


@rule("clip_tight", "with several updates per rollout, the clip stops most tokens: the update is throttled")
def clip_tight(s: Signals):
    frac = s.window("policy_clip_fraction", "tail")
    eps = s.cfg.epsilon
    if s.cfg.num_iterations <= 1 or frac is None or eps >= EPSILON_WORKING:
        return None
    off_range = eps < EPSILON_WORKING / 10 and frac[0] > CLIP_BINDS
    if frac[0] <= CLIP_FRACTION_HIGH and not off_range:
        return None
    # |ratio - 1| roughly exponential with scale eps / -ln(f) when a share f of tokens lies beyond eps: the epsilon
    # that clips CLIP_FRACTION_TARGET of them, at least twice the current, at most the working 0.2. Off the working
    # range the clip goes to it: most tokens sit at ratio ~1 (confident), so the share clipped says little there
    scale = eps / -math.log(min(frac[0], 0.999))
    new = EPSILON_WORKING if off_range else round(_clamp(scale * -math.log(CLIP_FRACTION_TARGET), 2 * eps,
                                                         EPSILON_WORKING), 3)
    changes = [Change("epsilon", eps, new)]
    if s.cfg.epsilon_high is not None and s.cfg.epsilon_high < new:
        changes.append(Change("epsilon_high", s.cfg.epsilon_high, new))
    ev = (f"policy_clip_fraction {frac[0]:.3g} > {CLIP_BINDS if off_range else CLIP_FRACTION_HIGH} over "
          f"{frac[1]} at epsilon {eps:g}{f' (< {EPSILON_WORKING / 10:g})' if off_range else ''}, num_iterations "
          f"{s.cfg.num_iterations}")
    why = ("the working clip: the epsilon is off the working range (0.1-0.3) and binds" if off_range else
           f"a wider clip: about {CLIP_FRACTION_TARGET:.0%} of tokens clipped")
    return _finding(clip_tight, ev, changes, why,
                    confidence((frac[0] - CLIP_BINDS) / CLIP_BINDS if off_range else
                               (frac[0] - CLIP_FRACTION_HIGH) / (1 - CLIP_FRACTION_HIGH), s.n_train),
                    clip_fraction=frac[0])


@rule("sampling_too_hot", "sampled completions solve far fewer problems than greedy decoding: the temperature is "
                         "too high")
def sampling_too_hot(s: Signals):
    base, temp = s.base.get("accuracy"), s.value("temperature")
    # the rollouts' own success rate (a correctness reward, a solved rate), not a share of groups
    keys = sorted({k for d in s.train.values() for k in d if counts_right(k) and not k.startswith("frac_")},
                  key=lambda k: (not k.startswith("reward/"), k))
    # mechdiag's held-out accuracy is greedy; a foreign run's eval may be sampled, so it is not compared
    if s.provenance is not None or base is None or base < HOT_MIN_BASE or not keys or not _num(temp) or \
            temp <= TEMPERATURE_FLOOR:
        return None
    head, tail = s.window(keys[0], "head"), s.window(keys[0], "tail")
    if head is None or tail is None or max(head[0], tail[0]) >= HOT_RATIO * base:  # a run that learnt past it: fine
        return None
    new = TEMPERATURE_MODEL if temp > TEMPERATURE_MODEL else TEMPERATURE_FLOOR
    ev = (f"{keys[0]} {head[0]:.3g} over {head[1]} = {head[0] / base:.2f} x the greedy base accuracy {base:.3g} "
          f"(< {HOT_RATIO:g}x), still {tail[0]:.3g} over {tail[1]}, at temperature {temp:g}")
    return _finding(sampling_too_hot, ev, [Change("temperature", temp, new)],
                    "a cooler sampler: the groups' answers come from the model's own distribution, not its tail "
                    f"({'the model itself' if new == TEMPERATURE_MODEL else 'the low end of the working range'})",
                    confidence(1 - head[0] / (HOT_RATIO * base), s.n_train),
                    onset=s.onset(keys[0], lambda v: v < HOT_RATIO * base), sampled=head[0], greedy=base)


@rule("early_saturation", "reward saturates early: the data is too easy to teach anything")
def early_saturation(s: Signals):
    steps, reward = s.series("reward")
    if len(reward) < MIN_POINTS or not _saturated(s):
        return None
    scale = s.reward_scale()
    if scale is not None:
        level = scale[0] + SATURATION_FRAC * (scale[1] - scale[0])
        first = next((i for i, r in enumerate(reward) if r >= level), None)
        where = f"{SATURATION_FRAC:.0%} of the reward's scale {scale[0]:.3g}..{scale[1]:.3g} ({scale[2]})"
    else:
        s_steps, solved = s.series("frac_groups_all_correct")
        first = next((steps.index(st) for st, v in zip(s_steps, solved, strict=True)
                      if v >= SATURATED_GROUPS and st in steps), None)
        where = f"{SATURATED_GROUPS:.0%} of groups all correct"
    if first is None or first > SATURATION_EARLY * (len(reward) - 1):
        return None
    ev = (f"reward {reward[first]:.3g} reached {where} already at step {steps[first]} "
          f"({first + 1} of {len(reward)} records; early = first {SATURATION_EARLY:.0%})")
    opts = dict(s.cfg.task.options)
    level_now = _difficulty(s.cfg)
    changes = []
    if level_now is not None and level_now < DIFFICULTY_MAX:
        changes = [Change("task.options", opts, {**opts, "difficulty": level_now + 1})]
    reason = "harder data: saturated groups all score the same and carry no advantage" if changes else \
        "harder data: add harder problems to task.mixture (no difficulty knob to turn here)"
    return _finding(early_saturation, ev, changes, reason,
                    confidence(1 - first / max(1, SATURATION_EARLY * len(reward)), len(reward)),
                    onset=steps[first], saturated_at_step=steps[first])


@rule("low_diversity", "low reward CV or many zero-std groups: the group advantage has little to work with")
def low_diversity(s: Signals):
    cv, zero = s.window("reward_cv", "tail"), s.window("frac_zero_std", "tail")
    hits = []
    if cv and cv[0] < REWARD_CV_LOW:
        hits.append((f"reward_cv {cv[0]:.3g} < {REWARD_CV_LOW} over {cv[1]}", REWARD_CV_LOW / max(cv[0], 1e-9) - 1))
    if zero and zero[0] > FRAC_ZERO_STD_HIGH:
        hits.append((f"frac_zero_std {zero[0]:.3g} > {FRAC_ZERO_STD_HIGH} over {zero[1]}",
                     (zero[0] - FRAC_ZERO_STD_HIGH) / (1 - FRAC_ZERO_STD_HIGH)))
    if not hits or _saturated(s):  # a solved task also gives equal rewards: early_saturation's case, not ours
        return None
    reward = s.window("reward", "tail")
    level = s.reward_level(reward[0]) if reward else None
    frac = level if level is not None else 0.5  # no scale: neither high nor low
    if frac >= REWARD_HIGH_FRAC:
        order = [_raise_epsilon_high, _raise_temperature]
    elif frac < REWARD_LOW_FRAC:
        order = [_raise_temperature, _easier_data, _raise_epsilon_high]
    else:
        order = [_raise_temperature, _raise_epsilon_high]
    change = next((c for c in (f(s.cfg) for f in order) if c is not None), None)
    ev = "; ".join(h[0] for h in hits) + (f"; reward at {frac:.0%} of its scale" if level is not None else
                                          "; the reward's range per completion is not logged (batch means and "
                                          "spreads only)")
    stds = {k: w[0] for k in {k for d in s.train.values() for k in d if k.startswith("reward_std/")}
            if (w := s.window(k, "tail"))}
    if stds:  # which reward function still spreads the group's rewards (none, where every spread is 0)
        top = max(stds, key=stds.get)
        ev += (f"; the signal left is in {top.split('/', 1)[1]} (std {stds[top]:.3g}, tail)"
               if stds[top] > NO_SIGNAL_EPS else "; no reward function spreads the group's rewards (std 0, tail)")
    reason = {"epsilon_high": "more sample diversity: a higher upper clip lets rare good completions gain "
                              "probability (study: 7B on MCQ, eps_high 0.2 -> 0.3)",
              "task.options": "easier data: almost every completion fails, so groups score the same",
              }.get(change.key if change else "", "more sample diversity: a higher temperature spreads the "
                                                  "group's rewards (study's conclusion)")
    if frac >= REWARD_HIGH_FRAC and s.cfg.num_iterations <= 1:
        reason += ("; a higher upper clip (epsilon_high) is not proposed: with num_iterations 1 the ratio is exactly "
                   "1 and no clip binds (it needs num_iterations > 1)")
    return _finding(low_diversity, ev, [change] if change else [], reason,
                    confidence(max(h[1] for h in hits), s.n_train), reward_frac=frac,
                    onset=s.onset("frac_zero_std", lambda v: v > FRAC_ZERO_STD_HIGH) if zero else
                    s.onset("reward_cv", lambda v: v < REWARD_CV_LOW),
                    reward_cv=cv[0] if cv else None, frac_zero_std=zero[0] if zero else None)


@rule("kl_drift", "high or rising KL to the reference while eval accuracy falls (without an eval stream, while the "
                  "train reward gains nothing): the policy drifts")
def kl_drift(s: Signals):
    trend = s.accuracy_trend()
    tail, second = s.window("kl", "tail"), s.window("kl", "second")
    if trend is None:  # no eval stream: a KL that climbs while the train reward gains nothing
        gain = s.window_gain("reward")
        if tail is None or gain is None or s.n_train < REWARD_STILL_MIN or _gained(s) or kl_blowup(s) is not None:
            return None  # (a KL past a nat with no eval is kl_blowup's, with its own sizing)
        best = final = None
        acc_ev = (f"no eval stream: train reward {gain[0]:.3g} -> {gain[1]:.3g} over {gain[3]} (no gain beyond "
                  f"{gain[2]:.3g}, 2 SE)")
    else:
        best, final, base = trend
        if final > best - ACC_DROP:
            return None
        acc_ev = f"eval accuracy {final:.3g} < best {best:.3g} - {ACC_DROP} ({s.start_label} {base:.3g})"
    if tail is None:
        beta = s.value("beta")
        if beta is None or beta > 0 or s.series("kl")[1]:
            return None
        ev, margin, kl = f"kl not recorded with beta = 0 ({_how(s, 'beta')}); {acc_ev}", 0.0, None
    else:
        high = tail[0] > KL_HIGH
        rising = second is not None and tail[0] > KL_RISE_MIN and tail[0] > KL_RISE_RATIO * max(second[0], 1e-12)
        if not (high or rising):
            return None
        kl = tail[0]
        parts = [f"kl {tail[0]:.3g} > {KL_HIGH} over {tail[1]}"] if high else []
        if rising:
            parts.append(f"kl rising {second[0]:.3g} ({second[1]}) -> {tail[0]:.3g} ({tail[1]})")
        ev = "; ".join(parts) + f"; {acc_ev}"
        margin = max(tail[0] / KL_HIGH - 1 if high else 0, tail[0] / (KL_RISE_RATIO * max(second[0], 1e-12)) - 1
                     if rising else 0, (best - final) / max(ACC_DROP, 1e-9) - 1 if best is not None else 0)
    changes = [c for c in [_raise_beta(s.cfg)] if c]
    if kl is not None and (kl > KL_HIGH or not changes):
        # a KL above the working range is a step too large: KL grows with the square of the step (step_too_large's
        # sizing); at least halved, so a rising KL with beta at its cap still gets a smaller step
        cut = _clamp(math.sqrt(kl / KL_WORKING), 1 / LR_FACTOR, LR_CUT_MAX)
        changes.append(Change("learning_rate", s.cfg.learning_rate, _sig(s.cfg.learning_rate / cut)))
        ev += f"; sqrt(kl / {KL_WORKING}) = {math.sqrt(kl / KL_WORKING):.3g}"
    reason = "a stronger KL anchor keeps the policy near the base (study: 4B on MCQ, beta 0.003 -> 0.01)" + (
        ", and a smaller step, sized by how far the KL sits above a working run's" if len(changes) > 1 else "")
    return _finding(kl_drift, ev, changes, reason, confidence(margin, s.n_train), kl_tail=kl,
                    onset=s.onset("kl", lambda v: v > KL_HIGH) if kl is not None else None,
                    accuracy_final=final, accuracy_best=best)


@rule("kl_blowup", "KL to the reference blew up, or rose far with no held-out stream to say what it costs")
def kl_blowup(s: Signals):
    head, tail = s.window("kl", "head"), s.window("kl", "tail")
    if not (head and tail):
        return None
    trend = s.accuracy_trend()
    rise = tail[0] / max(head[0], 1e-12)
    blown = tail[0] > KL_BLOWUP
    # the rise is a trend: not read on a short run (every KL starts near 0, so any ratio to its first record is large)
    unwatched = trend is None and tail[0] > KL_HIGH and rise >= KL_BLOWUP_RISE and s.min_points >= MIN_POINTS
    peak = None if blown or unwatched else _kl_peak(s)  # past a nat at some point, back below it by the tail
    if not (blown or unwatched or peak):
        return None
    if peak and peak[3]:  # lone spikes, each gone at the next record: the estimate blew up, not the policy
        return _finding(kl_blowup, f"kl spiked above {KL_BLOWUP:g} nats/token at {peak[2]} single records (highest "
                        f"{peak[0]:.3g} at step {peak[1]}), each back to the run's usual level at the next; tail kl "
                        f"{tail[0]:.3g}", [], "lone KL spikes that vanish at the next step are not drift: the "
                        "log-probabilities of a few tokens disagree (the generator against the learner: vLLM or "
                        "lower precision, weights synced late) or an importance ratio blew up; check the sampler gap "
                        "(sampler_logp_diff), TRL's vllm_importance_sampling_correction or an off-policy mask, "
                        "before reading them as a step too large", confidence(peak[0] / KL_BLOWUP - 1, s.n_train),
                        onset=peak[1], kl_peak=peak[0], lone_spikes=peak[2])
    if trend is not None and trend[1] > trend[0] - ACC_DROP and not (blown or peak):
        return None
    onset = peak[1] if peak else s.onset("kl", lambda v: v > KL_HIGH)
    ev = (f"kl {head[0]:.3g} ({head[1]}) -> {tail[0]:.3g} ({tail[1]}), x{rise:.3g}"
          + (f"; above {KL_BLOWUP} nats/token" if blown else "")
          + (f"; kl peaked at {peak[0]:.3g} at step {peak[1]} ({peak[2]} records above {KL_BLOWUP:g} nats/token)"
             if peak else "")
          + ("; no held-out stream: nothing says whether the drift costs accuracy" if trend is None else ""))
    g_steps, grads = s.series("grad_norm")
    if len(grads) >= MIN_POINTS:  # a gradient far above the run's own median at the same time: the step blew up
        med = sorted(grads)[len(grads) // 2]
        top = max(range(len(grads)), key=grads.__getitem__)
        if med > 0 and grads[top] >= GRAD_BURST * med:
            ev += f"; grad_norm peaked at {grads[top]:.3g} at step {g_steps[top]}, {grads[top] / med:.3g}x its median"
    blown = blown or peak is not None
    # a value the run does not show still names the direction: own_terms turns it into advice without a value
    beta = s.value("beta")
    beta = s.cfg.beta if beta is None else beta
    changes = []
    if beta > 0:  # sized: the penalty grows with how far KL sits above the working range
        factor = min(BETA_MAX / beta, max(BETA_FACTOR, math.sqrt(tail[0] / KL_HIGH)))
        if factor > 1:
            changes.append(Change("beta", beta, round(beta * factor, 6)))
    elif s.value("beta") is None:
        changes.append(Change("beta", beta, BETA_FROM_ZERO))
    lr = s.value("learning_rate")
    lr = s.cfg.learning_rate if lr is None else lr
    if not changes or blown:
        worst = max(tail[0], peak[0] if peak else 0.0)
        changes.append(Change("learning_rate", lr, lr * max(LR_FACTOR, min(1.0, KL_HIGH / worst) ** 0.5)))
    reason = ("the policy drifts far from its reference: a stronger KL anchor and a smaller step hold it; add a "
              "held-out eval (eval_strategy) to see what the drift costs")
    conf = confidence(max(max(tail[0], peak[0] if peak else 0.0) / KL_BLOWUP - 1, rise / KL_BLOWUP_RISE - 1),
                      s.n_train)
    return _finding(kl_blowup, ev, changes, reason, conf, onset=onset, kl_head=head[0], kl_tail=tail[0])


@rule("entropy_rise", "entropy rises while reward or held-out accuracy does not: the policy diffuses")
def entropy_rise(s: Signals):
    head, tail = s.window("entropy", "head"), s.window("entropy", "tail")
    if not (head and tail) or head[0] <= 0 or tail[0] < ENTROPY_RISE_RATIO * head[0] or \
            tail[0] - head[0] < ENTROPY_RISE_MIN:
        return None
    costs = []
    trend = s.accuracy_trend()
    if trend and trend[1] < trend[0] - ACC_DROP:
        costs.append(f"eval accuracy {trend[0]:.3g} (best) -> {trend[1]:.3g}")
    r_head, r_tail = s.window("reward", "head"), s.window("reward", "tail")
    if r_head and r_tail and r_tail[0] - r_head[0] <= REWARD_STALL * s.reward_span:
        costs.append(f"reward {r_head[0]:.3g} -> {r_tail[0]:.3g} (gain <= {REWARD_STALL:.0%} of its span)")
    if not costs:
        return None
    lr = s.value("learning_rate")
    lr = s.cfg.learning_rate if lr is None else lr  # unshown: own_terms makes it advice without a value
    changes = [Change("learning_rate", lr, lr * LR_FACTOR)]
    ev = f"entropy {head[0]:.3g} ({head[1]}) -> {tail[0]:.3g} ({tail[1]}), x{tail[0] / head[0]:.3g}; " + \
        "; ".join(costs)
    return _finding(entropy_rise, ev, changes, "a smaller step: updates too large spread probability over tokens "
                    "that earn nothing (check the learning rate, and a clip that binds: num_iterations > 1)",
                    confidence(tail[0] / (ENTROPY_RISE_RATIO * head[0]) - 1 + 0.2 * len(costs), s.n_train),
                    onset=s.onset("entropy", lambda v: v >= ENTROPY_RISE_RATIO * head[0]),
                    entropy_head=head[0], entropy_tail=tail[0])


@rule("length_collapse", "completions shrink to almost nothing")
def length_collapse(s: Signals):
    head, tail = s.window("completion_length", "head"), s.window("completion_length", "tail")
    if not (head and tail) or head[0] <= 0:
        return None
    if not (tail[0] < LENGTH_COLLAPSE_RATIO * head[0] and tail[0] < LENGTH_COLLAPSE_TOKENS):
        return None
    ev = f"completion_length {head[0]:.3g} ({head[1]}) -> {tail[0]:.3g} ({tail[1]})"
    return _finding(length_collapse, ev, [], "a reward that pays for ending early (a length penalty, a format "
                    "reward met by an empty answer) or a loss that favours short completions: check the reward "
                    "components on short completions (mechdiag check-reward)", 0.9,
                    onset=s.onset("completion_length", lambda v: v < LENGTH_COLLAPSE_RATIO * head[0]),
                    length_head=head[0], length_tail=tail[0])


def _repeat_share(text: str) -> float:
    words = text.split()
    grams = [tuple(words[i:i + REPEAT_NGRAM]) for i in range(len(words) - REPEAT_NGRAM + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@rule("degenerate_text", "sampled completions are empty or repeat themselves")
def degenerate_text(s: Signals):
    pool = [x for x in s.samples if isinstance(x.get("completion"), str) and x.get("split", "train") == "train"]
    steps = sorted({x["step"] for x in pool if _num(x.get("step"))})
    if not pool or not steps:
        return None
    late = [x for x in pool if _num(x.get("step")) and x["step"] >= steps[len(steps) // 2]]
    def degenerate(x) -> bool:
        words = x["completion"].split()
        return not words or (len(words) >= DEGENERATE_MIN_WORDS and _repeat_share(x["completion"]) > REPEAT_SHARE)

    bad = [x for x in late if degenerate(x)]
    if len(late) < MIN_POINTS or len(bad) < DEGENERATE_SAMPLES * len(late):
        return None
    onset = None  # the first sampled step from which every step's samples are degenerate at the threshold share
    for st in steps:
        at = [x for x in pool if x.get("step") == st]
        ok = sum(map(degenerate, at)) >= DEGENERATE_SAMPLES * len(at)
        onset = (st if onset is None else onset) if ok else None
    empty = sum(not x["completion"].strip() for x in bad)
    ev = (f"{len(bad)} of {len(late)} sampled completions from step {late[0]['step']} on are degenerate ({empty} "
          f"empty, {len(bad) - empty} with > {REPEAT_SHARE:.0%} repeated {REPEAT_NGRAM}-grams); e.g. "
          f"{bad[0]['completion'][:80]!r}")
    return _finding(degenerate_text, ev, [], "the policy found text the reward pays for without an answer: check "
                    "the reward on empty and repetitive completions (mechdiag check-reward), and a repetition or "
                    "length penalty", confidence(len(bad) / len(late) / DEGENERATE_SAMPLES - 1, len(late)),
                    onset=onset, degenerate=len(bad), judged=len(late))


@rule("component_never_pays", "a reward component is the same value (0 or a penalty) on every record: it never "
      "tells completions apart")
def component_never_pays(s: Signals):
    _, total = s.series("reward")
    if not total or max(total) - min(total) <= NO_SIGNAL_EPS:  # nothing varies at all: no_signal's case
        return None
    dead = []
    for key in sorted({k for d in s.train.values() for k in d if k.startswith("reward/")}):
        if counts_right(key):  # a correctness stream that never pays is no_signal's "no correct answer"
            continue
        steps, vals = s.series(key)
        _, stds = s.series("reward_std/" + key[7:])
        flat = max(vals) - min(vals) <= NO_SIGNAL_EPS if vals else False
        # enough records to call it constant, or its within-batch spread logged as 0 at every one
        seen = len(vals) >= MIN_POINTS or (len(vals) >= 2 and stds and max(stds) <= NO_SIGNAL_EPS)
        if flat and seen and vals[0] <= NO_SIGNAL_EPS:
            dead.append((key, vals[0], len(vals), steps[0]))
    if not dead:
        return None
    ev = "; ".join(f"{k} {v:.4g} on all {n} records" for k, v, n, _ in dead)
    return _finding(component_never_pays, ev + f" while the total reward varies ({min(total):.3g}..{max(total):.3g})",
                    [], "a component that never varies adds the same to every completion, so it moves no advantage: "
                    "if it should pay (or penalise) something, test it on completions that should score differently "
                    "(mechdiag check-reward)", 0.9, onset=min(d[3] for d in dead), n_dead=len(dead))


@rule("reward_misalignment", "reward rises while eval accuracy is flat or falling: the reward pays for form")
def reward_misalignment(s: Signals):
    head, tail, trend = s.window("reward", "head"), s.window("reward", "tail"), s.accuracy_trend()
    if not (head and tail and trend):
        return None
    rise = tail[0] - head[0]
    _, final, base = trend
    if rise < REWARD_RISE_FRAC * s.reward_span or final - base > ACC_FLAT:
        return None
    w = reward_weights(s.cfg)
    ev = (f"reward {head[0]:.3g} ({head[1]}) -> {tail[0]:.3g} ({tail[1]}), +{rise / s.reward_span:.0%} of the "
          "reward's span; "
          f"eval accuracy {base:.3g} -> {final:.3g}")
    c_tail, c_head = s.window("reward/correctness", "tail"), s.window("reward/correctness", "head")
    share = None
    if c_tail and c_head:  # the raw correctness rate is recorded: how much of the rise did it pay for?
        share = w.get("correctness", 0.0) * (c_tail[0] - c_head[0]) / rise
        if share >= CORRECT_SHARE_MAX:
            return None  # the reward rose for correct answers: a train/eval gap, not a reward design problem
        ev += f"; reward/correctness {c_head[0]:.3g} -> {c_tail[0]:.3g}, {max(share, 0):.0%} of the rise"
    new = dict(w)
    if "correctness" in w and w["correctness"] < CORRECTNESS_MAX:
        new["correctness"] = min(CORRECTNESS_MAX, w["correctness"] * CORRECTNESS_FACTOR)
    for k in FORMAT_COMPONENTS:
        if k in w and w[k] > FORMAT_MIN:
            new[k] = max(FORMAT_MIN, round(w[k] * FORMAT_FACTOR, 6))
    changes = [Change("rewards.weights", w, new)] if new != w else []
    return _finding(reward_misalignment, ev, changes,
                    "reward reshaping: pay for correct answers, less for tags (study: code correctness 1.0 -> 2.0)",
                    confidence(rise / (REWARD_RISE_FRAC * s.reward_span) - 1, s.n_train), reward_rise=rise,
                    accuracy_base=base, accuracy_final=final, correctness_share=share)


@rule("truncation", "many completions hit the completion budget, or their length presses against it")
def truncation(s: Signals):
    tail, length = s.window("completion_clipped_ratio", "tail"), s.window("completion_length", "tail")
    head, head_len = s.window("completion_clipped_ratio", "head"), s.window("completion_length", "head")
    if not tail:
        return _whole_batches_cut(s)
    cur = s.value("max_completion_tokens")  # a budget the run does not show is not judged against a default
    fill = length[0] / cur if length and cur else 0.0
    shrink = 1 - length[0] / head_len[0] if length and head_len and head_len[0] > 0 else 0.0
    if tail[0] > CLIPPED_HIGH:
        ev = f"completion_clipped_ratio {tail[0]:.3g} > {CLIPPED_HIGH} over {tail[1]}"
        margin = tail[0] / CLIPPED_HIGH - 1
    elif head and head[0] > CLIPPED_HIGH and shrink > LENGTH_SHRINK and not _gained(s):
        # shortened to fit while the run gained: the cut cost nothing the logs show
        ev = (f"completion_clipped_ratio {head[0]:.3g} > {CLIPPED_HIGH} over {head[1]}, then completion_length "
              f"{head_len[0]:.3g} -> {length[0]:.3g} ({-shrink:.0%}) by {length[1]}: the policy shortened its "
              f"completions to fit the budget")
        margin = min(head[0] / CLIPPED_HIGH - 1, shrink / LENGTH_SHRINK - 1)
    elif fill > LENGTH_NEAR_BUDGET and max(head[0], tail[0]) > CLIPPED_SOME:
        cut = max((head, tail), key=lambda w: w[0])
        ev = (f"completion_length {length[0]:.3g} = {fill:.0%} of the {cur}-token budget (> {LENGTH_NEAR_BUDGET:.0%})"
              f" over {length[1]}, and completion_clipped_ratio {cut[0]:.3g} > {CLIPPED_SOME} over {cut[1]}")
        margin = (fill - LENGTH_NEAR_BUDGET) / (1 - LENGTH_NEAR_BUDGET)
    else:
        return None
    change, reason = _raise_budget(s), "longer budget so reasoning and answer fit"
    changes = [change] if change else []
    if not change:
        reason = ("budget at its cap: penalise length or fix the tag format (verbose traces); mask_truncated_"
                  "completions keeps cut completions out of the loss, so they teach neither way")
    return _finding(truncation, ev, changes, reason, confidence(margin, s.n_train), clipped_tail=tail[0],
                    onset=s.onset("completion_clipped_ratio", lambda v: v > CLIPPED_SOME),
                    length_fill=fill, length_shrink=shrink)


def _gained(s: Signals) -> bool:
    """Whether the run measurably improved: held-out accuracy beyond its noise, else its train success stream (or,
    without one, its reward) whose tail beats its head by more than two standard errors of their spread."""
    trend = s.accuracy_trend()
    if trend is not None:
        return trend[1] - trend[2] > max(ACC_FLAT, s.gain_noise(trend[2], trend[1]))
    keys = sorted({k for d in s.train.values() for k in d if counts_right(k)}) or ["reward"]
    gain = s.window_gain(keys[0])
    return gain is not None and gain[1] - gain[0] > max(gain[2], EVAL_REWARD_FLAT * s.reward_span)


def _whole_batches_cut(s: Signals):
    """truncation where no clipped share is logged (TRL before completions/clipped_ratio): batches whose mean
    completion length sits exactly at the run's maximum ran every completion to the cap, so at least that share of
    the batches was cut whole (partly cut batches add to it)."""
    cap = whole_batches_at_cap([{"step": st, **d} for st, d in s.train.items()])
    if cap is None or len(cap[1]) < WHOLE_CUT_SHARE * s.n_train:
        return None
    share = len(cap[1]) / s.n_train
    ev = (f"completion_length exactly {cap[0]} (its maximum) at {len(cap[1])} of {s.n_train} records (steps "
          f"{', '.join(map(str, cap[1][:6]))}{', ...' if len(cap[1]) > 6 else ''}): every completion of those "
          f"batches ran to the same length, a completion cap of {cap[0]}; the run logs no clipped share")
    known = s.value("max_completion_tokens")
    change = _raise_budget(s) if known == cap[0] or s.provenance is None else None
    reason = "longer budget so reasoning and answer fit" if change else \
        f"a completion budget above {cap[0]} tokens so reasoning and answer fit, or a penalty on length"
    return _finding(truncation, ev, [change] if change else [], reason,
                    confidence(share / WHOLE_CUT_SHARE - 1, s.n_train), onset=cap[1][0], whole_batches_cut=share,
                    cap=cap[0])


def _end_ratio(per_layer: dict[int, float], n_layers: int) -> float | None:
    ends = set(range(END_LAYERS)) | set(range(n_layers - END_LAYERS, n_layers))
    e = [v for k, v in per_layer.items() if k in ends]
    m = [v for k, v in per_layer.items() if k not in ends]
    if not e or not m:
        return None
    return (sum(e) / len(e)) / max(sum(m) / len(m), 1e-12)


DISPLACEMENT_ONLY = " (evidence: displacement only; no attribution recorded, run `mechdiag attribute RUN --save`)"


def _fewest_covering(shares: dict, cover: float, at_least: int = 1) -> tuple[list, float]:
    """The fewest keys, largest share first, that carry `cover` of the total (and at least `at_least` of them)."""
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])
    total = sum(v for _, v in ranked) or 1.0
    k, got = 0, 0.0
    while k < len(ranked) and (got < cover * total or k < at_least or
                               (k and ranked[k][1] >= ranked[k - 1][1] * (1 - 1e-9))):  # ties go together
        got += ranked[k][1]
        k += 1
    return [key for key, _ in ranked[:k]], got / total


@rule("reduced_layers", "the causal share (or, without attribution, displacement or shift) concentrated in a few "
                        "layers")
def reduced_layers(s: Signals):
    n = s.n_layers
    if not s.cfg.lora.enabled or n is None or n < MIN_LAYERS_FOR_ENDS:
        return None
    spec = f"first{END_LAYERS}+last{END_LAYERS}"  # the study's fixed treatment, where only correlates are recorded
    current = set(parse_layers(s.cfg.lora.layers, n))
    causal = {int(k): v for k, v in s.causal.get("layer", {}).items() if int(k) in current}
    trend = s.accuracy_trend()
    regressed = trend is not None and trend[1] < trend[0] - ACC_DROP
    if causal:  # measured importance decides which layers, wherever they sit (Is One Layer Enough?: the middle)
        keep, cover = _fewest_covering(causal, MODULE_MASS_COVER, at_least=LAYERS_KEPT_MIN)
        if len(keep) > len(causal) // 2:
            return None
        # per-layer share of the kept layers over the rest's, as the end ratio compares ends and middle
        concentration = (cover / len(keep)) / max((1 - cover) / (len(causal) - len(keep)), 1e-12)
        if concentration < END_RATIO or (concentration < END_RATIO_STRONG and not regressed):
            return None
        layers = sorted(keep)
        ev = (f"causal share: layers {', '.join(map(str, layers))} hold {cover:.0%} of the output KL lost when a "
              f"layer is removed (attribution), {concentration:.3g}x the other layers' per-layer share (> {END_RATIO}"
              + (f", with accuracy {trend[1]:.3g} < best {trend[0]:.3g})" if regressed else
                 f"; strong: > {END_RATIO_STRONG})"))
        return _finding(reduced_layers, ev, [Change("lora.layers", s.cfg.lora.layers, layers)],
                        f"reduced layers where the effect is (attribution), at least {LAYERS_KEPT_MIN}: a cost and "
                        "stability change, not a promised gain (at equal trainable parameters no selection beat "
                        "all-linear rank 1, and one layer learnt nothing: docs/benchmarks.md, Selection); the "
                        f"study's fixed treatment, {spec}, is the alternative when only displacement is recorded",
                        confidence(concentration / END_RATIO - 1, s.n_train), end_ratio=concentration,
                        source="causal share")
    if current <= set(parse_layers(spec, n)):
        return None
    ratios = {}
    if s.layer_mass:
        ratios["displacement"] = _end_ratio(s.layer_mass, n)
    key = "increment" if any("increment" in d for d in s.shift.values()) else "shift"
    if s.shift:
        ratios[f"shift.{key}"] = _end_ratio({k: d[key] for k, d in s.shift.items() if key in d}, n)
    ratios = {k: v for k, v in ratios.items() if v is not None}
    if not ratios:
        return None
    what, ratio = max(ratios.items(), key=lambda kv: kv[1])
    if ratio < END_RATIO or (ratio < END_RATIO_STRONG and not regressed):
        return None
    ev = (f"{what}: first/last {END_LAYERS} layers carry {ratio:.3g}x the middle's per-layer share "
          f"(> {END_RATIO}" + (f", with accuracy {trend[1]:.3g} < best {trend[0]:.3g})" if regressed else
                               f"; strong: > {END_RATIO_STRONG})")) + DISPLACEMENT_ONLY
    return _finding(reduced_layers, ev, [Change("lora.layers", s.cfg.lora.layers, spec)],
                    f"reduced layers, the study's fixed treatment ({spec}: recovered most MBPP/APPS regressions); "
                    "against it: Is One Layer Enough? finds the middle layers carry most of the RL gain; record "
                    "attribution to choose by effect",
                    confidence(ratio / END_RATIO - 1, s.n_train), end_ratio=ratio, source=what)


def _study_note(modules) -> str:
    """The study's best module set in this family's own names (Phi-3: qkv_proj.v + o_proj), when it has both."""
    v, o = family_name("v_proj", modules), family_name("o_proj", modules)
    return f" (study: {v} + {o}, best pass@1)" if v and o else ""


@rule("reduced_modules", "update mass concentrated in a few module types")
def reduced_modules(s: Signals):
    causal = s.causal.get("module", {})
    mass, current = causal or s.module_mass, list(s.cfg.lora.target_modules)
    m = len(mass)
    if not s.cfg.lora.enabled or m <= MIN_MODULES:
        return None
    ranked = sorted(mass.items(), key=lambda kv: -kv[1])
    k, cover = 0, 0.0
    while cover < MODULE_MASS_COVER or k < MIN_MODULES:
        cover += ranked[k][1]
        k += 1
    concentration = cover / (k / m)
    if k > m // 2 or concentration < MODULE_CONCENTRATION:
        return None
    keep = [str(mod) for mod, _ in ranked[:k]]  # the family's own names; peft matches "attn.c_proj" as a suffix
    new = [mod for mod in current if mod in keep] or keep  # a default that did not fit: the family's own modules
    what = "of the causal share (output KL lost without the module; attribution)" if causal else \
        "of the size-normalised update mass"
    ev = (f"{', '.join(f'{mod} {v:.0%}' for mod, v in ranked[:k])} {what} ({k} of {m} modules, "
          f"{concentration:.3g}x their uniform share > {MODULE_CONCENTRATION})" + ("" if causal else DISPLACEMENT_ONLY))
    return _finding(reduced_modules, ev, [Change("lora.target_modules", current, new)],
                    f"reduced modules: adapt the modules carrying the update ({', '.join(new)})"
                    + _study_note(s.modules or list(mass)),
                    confidence(concentration / MODULE_CONCENTRATION - 1, s.n_train), cover=cover,
                    modules=",".join(new), source="causal share" if causal else "displacement")


@rule("narrow_lora", "LoRA on attention only and held-out accuracy flat: too little of the model can move")
def narrow_lora(s: Signals):
    if not s.cfg.lora.enabled or s.known("lora.target_modules") is None:
        return None
    current = list(s.cfg.lora.target_modules)
    mlp = [m for m in configlib.ALL_MODULES if m not in configlib.ATTN_MODULES]
    if any(m.rsplit(".", 1)[-1] in mlp for m in current):
        return None
    trend = s.accuracy_trend()
    if trend is None or trend[1] - trend[2] > ACC_FLAT:
        return None
    wide = list(dict.fromkeys(current + [family_name(m, s.modules) or m for m in mlp]))  # the family's own names
    if wide == current:
        return None
    ev = (f"LoRA targets {', '.join(current)} (attention only); eval accuracy {s.start_label} {trend[2]:.3g} -> "
          f"{trend[1]:.3g} (gain <= {ACC_FLAT})")
    changes = [Change("lora.target_modules", current, wide)]
    if s.cfg.lora.r > LORA_RANK_LOW:
        changes.append(Change("lora.r", s.cfg.lora.r, LORA_RANK_LOW))
    return _finding(narrow_lora, ev, changes,
                    "widen LoRA to every linear layer at low rank (LoRA Without Regret: rank 1-32 on all weight "
                    "matrices matches full fine-tuning for RL, attention-only loses even at matched parameters; "
                    "a LoRA learning rate about 10x full fine-tuning's; our bench: uniform LoRA 0.545 beat v+o 0.520)",
                    confidence((ACC_FLAT - (trend[1] - trend[2])) / max(ACC_FLAT, 1e-9), s.n_train),
                    accuracy_gain=trend[1] - trend[2])


def _still(s: Signals) -> tuple[str, float, float | None, float | None] | None:
    """(evidence, kl tail, base, final) when the policy stayed where it began: tail KL under KL_STILL, held-out
    accuracy and reward flat, the groups still differing; or, with beta above BETA_MAX (an anchor beyond any
    working range), the KL held under KL_STILL whatever the accuracy did. Without an eval stream, a measured KL
    under KL_STILL and a train reward whose tail is no higher than its head beyond their noise (_reward_still)."""
    kl, zero = s.window("kl", "tail"), s.window("frac_zero_std", "tail")
    if kl is None or kl[0] >= KL_STILL:
        return None
    if zero is not None and zero[0] >= HELD_ZERO_STD_MAX:
        return None  # equal rewards everywhere hold it still: no_signal / low_diversity's case, not a penalty's
    trend = s.accuracy_trend()
    if trend is None:
        return _reward_still(s, kl, zero)
    _, final, base = trend
    ev_reward = (s.final.get("eval_reward"), s.base.get("eval_reward"))
    gain_max = max(ACC_FLAT, s.gain_noise(base, final))  # a gain the eval's own noise could make is no gain
    flat = final - base <= gain_max and (None in ev_reward or ev_reward[0] - ev_reward[1] <=
                                          EVAL_REWARD_FLAT * s.reward_span)
    anchored = s.cfg.beta > BETA_MAX
    if not (flat or anchored):
        return None
    ev = (f"kl {kl[0]:.3g} < {KL_STILL} over {kl[1]}; eval accuracy {base:.3g} -> {final:.3g}"
          + (f" (gain <= {gain_max:.3g}" + (", 2 SE of the eval's noise" if gain_max > ACC_FLAT else "") + ")"
             if flat else f"; beta {s.cfg.beta:g} > {BETA_MAX}: the anchor holds it")
          + (f"; frac_zero_std {zero[0]:.3g} < {HELD_ZERO_STD_MAX}: the groups still differ" if zero else ""))
    return ev, kl[0], base, final


def _reward_flat(s: Signals) -> tuple[float, float, float, str] | None:
    """window_gain of the train reward where it is flat over at least REWARD_STILL_MIN records: its tail no higher
    than its head beyond two standard errors (or EVAL_REWARD_FLAT of its span), that noise under REWARD_STILL_NOISE
    of the span (a noisier reward cannot show a rise), and under SATURATION_FRAC of a known ceiling."""
    gain = s.window_gain("reward")
    if gain is None or s.n_train < REWARD_STILL_MIN:
        return None
    head, tail, noise, _ = gain
    level = s.reward_level(tail)
    if tail - head > max(noise, EVAL_REWARD_FLAT * s.reward_span) or noise > REWARD_STILL_NOISE * s.reward_span \
            or (level is not None and level >= SATURATION_FRAC):
        return None  # it rose, its noise could hide a real rise, or it sits at its ceiling
    return gain


def _reward_still(s: Signals, kl: tuple[float, str], zero) -> tuple[str, float, None, None] | None:
    """_still without an eval stream: the KL measured (not a beta-0 zero) and under KL_STILL, the train reward's
    tail no higher than its head by more than two standard errors of their step-to-step spread (or
    EVAL_REWARD_FLAT of its span), over at least REWARD_STILL_MIN records. A flat reward at its ceiling is
    early_saturation's; none at all, no_signal's."""
    gain = _reward_flat(s)
    measured = _kl_measured(s) or max(s.series("kl")[1], default=0) > 0  # a KL that moved was computed
    if not measured or gain is None or _never_right(_success(s)[0]):
        return None
    head, tail, noise, where = gain
    ev = (f"kl {kl[0]:.3g} < {KL_STILL} over {kl[1]}; no eval stream: train reward {head:.3g} -> {tail:.3g} over "
          f"{where} (a rise <= {noise:.3g}, 2 SE of its step-to-step spread)"
          + (f"; frac_zero_std {zero[0]:.3g} < {HELD_ZERO_STD_MAX}: the groups still differ" if zero else ""))
    return ev, kl[0], None, None


def _lora_sites(s: Signals) -> tuple[int, int] | None:
    """(sites LoRA adapts, sites it could adapt): (layer, module type) pairs of the model's linear modules."""
    from mechdiag.models import layers_of  # noqa: PLC0415 - transformers' config reader, only for a LoRA run

    lora = s.cfg.lora
    if not lora.enabled or not s.known("model.name_or_path") or not set(lora.target_modules) <= set(ALL_MODULES):
        return None
    n = layers_of(s.cfg.model.name_or_path, local_only=True)  # a diagnosis never waits on the network
    if n is None:
        return None
    return len(parse_layers(lora.layers, n)) * len(lora.target_modules), n * len(ALL_MODULES)


@rule("lora_narrow", "the policy held still with LoRA on a small share of the model: widen it to every linear "
                     "module of every layer (a low rank is enough)")
def lora_narrow(s: Signals):
    still = _still(s)
    sites = _lora_sites(s) if still is not None else None
    if still is None or sites is None or sites[0] >= LORA_NARROW_FRAC * sites[1] or s.cfg.beta > BETA_MAX:
        return None
    lora = s.cfg.lora
    ev = f"{still[0]}; LoRA on {sites[0]} of {sites[1]} (layer, module) sites (< {LORA_NARROW_FRAC:.0%})"
    changes = [c for c in (Change("lora.layers", lora.layers, "all") if lora.layers != "all" else None,
                           Change("lora.target_modules", list(lora.target_modules), list(ALL_MODULES))
                           if list(lora.target_modules) != ALL_MODULES else None) if c]
    return _finding(lora_narrow, ev, changes,
                    "widen the adapter: all linear modules of every layer, rank kept (LoRA Without Regret: rank 1-32 "
                    "on all weight matrices matches full fine-tuning for RL; attention-only loses)",
                    confidence(1 - sites[0] / (LORA_NARROW_FRAC * sites[1]), s.n_train), sites=sites[0],
                    sites_total=sites[1])


def _kl_working(s: Signals) -> float:
    """A working run's per-token KL at this run's length: KL_WORKING at WORKING_STEPS, growing with the square of
    the steps (a steady drift of ~lr a step), between KL_WORKING and KL_WORKING_MAX."""
    steps = max(s.train, default=WORKING_STEPS)
    return _clamp(KL_WORKING * (steps / WORKING_STEPS) ** 2, KL_WORKING, KL_WORKING_MAX)


@rule("held_still", "KL near zero and eval (without one, the train reward) flat while the groups still differ (or "
                    "beta beyond its range): the KL penalty or a tiny step size holds the policy where it began")
def held_still(s: Signals):
    still = _still(s)
    if still is None:
        return None
    ev, kl, base, final = still
    growth, working = _group_growth(s), _kl_working(s)
    if growth is not None and s.cfg.beta <= BETA_MAX and growth[1] ** 2 * kl >= working:
        # KL grows with the square of the step, the step with the share of groups that differ: larger groups
        # alone bring the KL to a working run's, so group_small's change is the cure and this one waits for it
        ev += (f"; group_size {s.cfg.group_size} -> {growth[0]} gives {growth[1]:.3g}x the groups that differ, "
               f"kl x {growth[1] ** 2:.3g} >= {working:.3g}")
        changes, reason = [], "larger groups explain it (group_small): re-check after them"
    elif s.cfg.beta > 0:
        changes = [Change("beta", s.cfg.beta, round(min(s.cfg.beta / BETA_FREE_DIV, BETA_FREE_MAX), 6))]
        reason = "a weaker KL anchor lets the advantage move the policy (beta holds it at the reference)"
    else:
        # KL grows with the square of the step while small: sqrt(working / kl) brings it to a working run's
        factor = _clamp(math.sqrt(working / max(kl, 1e-12)), LR_FREE_MIN, LR_FREE_MAX)
        changes = [Change("learning_rate", s.cfg.learning_rate, _sig(min(1.0, s.cfg.learning_rate * factor)))]
        ev += f"; sqrt({working:.3g} / kl) = {math.sqrt(working / max(kl, 1e-12)):.3g}"
        reason = (f"a larger step: the learning rate x {factor:.3g}, sized by how far the KL sits under a working "
                  "run's")
    return _finding(held_still, ev, changes, reason, confidence(1 - kl / KL_STILL, s.n_train), kl_tail=kl,
                    accuracy_base=base, accuracy_final=final)


@rule("entropy_collapse", "policy entropy collapses and it costs something: diversity, pass@k or accuracy")
def entropy_collapse(s: Signals):
    head, tail = s.window("entropy", "head"), s.window("entropy", "tail")
    if head and tail:
        start, end, where = head[0], tail[0], f"{head[1]} -> {tail[1]}"
    else:
        steps, ent = s.series("entropy", "eval")
        if len(ent) < 2:
            return None
        start, end, where = ent[0], ent[-1], f"eval steps {steps[0]} -> {steps[-1]}"
    if tail and 0 < tail[0] < ENTROPY_FLOOR and not (start > 0 and end < ENTROPY_COLLAPSE_RATIO * start):
        return _entropy_at_floor(s, tail)  # (exactly 0: no token was scored, a logger's 0, not a policy's)
    if not (start > 0 and end < ENTROPY_COLLAPSE_RATIO * start):  # relative to the run's own start
        return None
    costs = []  # a sharper policy is the point of RL; it is a problem only where it costs something
    cv_head, cv_tail = s.window("reward_cv", "head"), s.window("reward_cv", "tail")
    if cv_head and cv_tail and cv_tail[0] < CV_FALL_RATIO * cv_head[0]:
        costs.append(f"reward_cv {cv_head[0]:.3g} -> {cv_tail[0]:.3g} (< {CV_FALL_RATIO} x start)")
    pk = s.sampled_pass_k()
    if pk and len(pk[2]) >= 2 and pk[2][-1] < max(pk[2]) - ACC_DROP:
        costs.append(f"{pk[0]} {max(pk[2]):.3g} (best) -> {pk[2][-1]:.3g} at step {pk[1][-1]}")
    trend = s.accuracy_trend()
    if trend and trend[1] - trend[2] <= ACC_FLAT:
        costs.append(f"eval accuracy stalled {trend[2]:.3g} -> {trend[1]:.3g} (gain <= {ACC_FLAT})")
    if not costs:
        return None
    change = _raise_temperature(s.cfg) or _raise_beta(s.cfg)
    ev = (f"entropy {start:.3g} -> {end:.3g} ({where}; < {ENTROPY_COLLAPSE_RATIO} x the run's start), with "
          + "; ".join(costs))
    reason = "keep exploring: " + ("a higher temperature" if change and change.key == "temperature" else
                                   "a stronger KL anchor to the base's entropy")
    # the objectives papers use against collapse (docs/training.md); advice only: the clinic has no collapse start
    reason += ("; or an objective that keeps entropy (advice, not measured in the clinic): epsilon_high 0.28 "
               "(clip-higher, DAPO; it binds only with num_iterations > 1), top_entropy_quantile 0.2 (the loss on "
               "the high-entropy tokens), or an entropy bonus (entropy_coef)")
    return _finding(entropy_collapse, ev, [change] if change else [], reason,
                    confidence(ENTROPY_COLLAPSE_RATIO * start / max(end, 1e-9) - 1, s.n_train),
                    entropy_start=start, entropy_end=end, costs=len(costs),
                    onset=s.onset("entropy", lambda v: v < ENTROPY_COLLAPSE_RATIO * start))


def _entropy_at_floor(s: Signals, tail: tuple[float, str]):
    """entropy_collapse where the log does not show the fall (an excerpt, a resumed run, a collapse before the
    first record): a tail entropy under ENTROPY_FLOOR while its reward sits under its ceiling (the reward's scale,
    else the best completion the batches logged), or, where neither is shown, while it does not gain. At a
    hundredth of a nat per token the policy samples one answer: its groups cannot differ much."""
    gain = s.window_gain("reward")
    if gain is None:
        return None
    level = s.reward_level(gain[1])
    _, best = s.series("reward_max_batch")
    if level is None and best and max(best) > 0:
        level = gain[1] / max(best)  # the best completion seen as the ceiling, 0 as the floor
    if (level is not None and level >= SATURATION_FRAC) or (level is None and _gained(s)):
        return None
    change = _raise_temperature(s.cfg) or _raise_beta(s.cfg)
    ev = (f"entropy {tail[0]:.3g} over {tail[1]} (< {ENTROPY_FLOOR} nats/token: the policy samples one answer), "
          f"reward {gain[0]:.3g} -> {gain[1]:.3g} over {gain[3]}"
          + (f", {level:.0%} of its ceiling" if level is not None else f" (no gain beyond {gain[2]:.3g}, 2 SE)"))
    return _finding(entropy_collapse, ev, [change] if change else [],
                    "keep exploring: the fall came before this log shows it; restart from a checkpoint whose "
                    "entropy was higher, with a higher temperature or a stronger KL anchor, or an objective that "
                    "keeps entropy (clip-higher epsilon_high 0.28, top_entropy_quantile, an entropy bonus)",
                    confidence(ENTROPY_FLOOR / max(tail[0], 1e-9) - 1, s.n_train), entropy_end=tail[0],
                    onset=s.onset("entropy", lambda v: v < ENTROPY_FLOOR))


@rule("reward_declined", "the train reward fell from its best and stayed down, with no held-out gain: the run "
                         "unlearns what it had")
def reward_declined(s: Signals):
    gain = s.window_gain("reward")
    trend = s.accuracy_trend()
    if gain is None or s.n_train < MIN_RECORDS or (trend is not None and trend[1] - trend[2] > ACC_FLAT):
        return None  # a held-out gain says the reward's fall is not a loss (a harder curriculum, a new component)
    head, tail, noise, _ = gain
    steps, vals = s.series("reward")
    k = max(2, round(len(vals) * WINDOW_FRAC))
    at = max(range(len(vals) - k + 1), key=lambda i: sum(vals[i:i + k]))  # the best window of the same width
    best = sum(vals[at:at + k]) / k
    # the best of many windows is biased up: twice the noise of two windows, and a tenth of the reward's span
    bar = max(2 * noise, DECLINE_SHARE * s.reward_span)
    if best - tail <= bar or at + k > len(vals) - k:
        return None
    ev = (f"reward {best:.3g} over steps {steps[at]}-{steps[at + k - 1]} (its best) -> {tail:.3g} over steps "
          f"{steps[-k]}-{steps[-1]} (start {head:.3g}); the fall {best - tail:.3g} > {bar:.3g} (4 SE of its "
          f"step-to-step spread, or {DECLINE_SHARE:.0%} of its span)")
    lr = s.cfg.learning_rate
    return _finding(reward_declined, ev, [Change("learning_rate", lr, _sig(lr * LR_FACTOR))],
                    "a smaller step (the learning rate x 0.5): the reward rose and fell back with nothing else named "
                    "to explain it, the mark of a step that overshoots once the warm-up ends; keep the checkpoint "
                    "from its best steps", confidence((best - tail) / max(2 * noise, 1e-9) - 1, s.n_train),
                    onset=steps[at + k - 1], reward_best=best, reward_tail=tail)


@rule("no_progress", "the train reward did not rise over a long run and no other rule names a cause: the run is "
                     "not learning")
def no_progress(s: Signals):
    gain = _reward_flat(s)
    if gain is None or s.accuracy_trend() is not None:
        return None  # with an eval stream, held_still and the accuracy rules judge the run
    head, tail, noise, where = gain
    keys = {k for d in s.train.values() for k in d}
    unseen = [name for name, ks in (("kl", {"kl"}), ("the groups' spread", {"frac_zero_std", "reward_std"}))
              if not keys & ks]
    ev = (f"train reward {head:.3g} -> {tail:.3g} over {where} ({s.n_train} records; no rise beyond {noise:.3g}, 2 SE "
          "of its step-to-step spread)")
    reason = "the run is not learning"
    if unseen:
        reason += (f"; the log does not show {' or '.join(unseen)}, which would tell a policy held still (raise the "
                   "learning rate) from a signal lost in groups that score alike (larger groups, easier data): log it")
    return _finding(no_progress, ev, [], reason, confidence(1 - max(tail - head, 0) / max(noise, 1e-9), s.n_train),
                    onset=min(s.train), reward_head=head, reward_tail=tail)


OFF_POLICY_MASK_TARGET = 0.5  # sampler_mismatch: the off-policy sequence mask's threshold (TRL's example value)


@rule("sampler_mismatch", "the sampler and the trainer disagree on the policy: the rollouts are off-policy")
def sampler_mismatch(s: Signals):
    key, gap = sampler_gap_series({"step": k, **v} for k, v in s.train.items())
    if len(gap) < MIN_POINTS:
        return None
    k = max(1, round(len(gap) * WINDOW_FRAC))
    head, tail = sum(v for _, v in gap[:k]) / k, sum(v for _, v in gap[-k:]) / k
    where = f"steps {gap[-k][0]}-{gap[-1][0]}"
    if tail > SAMPLER_GAP_HIGH:
        ev, margin = f"{key} {tail:.3g} > {SAMPLER_GAP_HIGH:g} over {where}", tail / SAMPLER_GAP_HIGH - 1
    elif tail > SAMPLER_GAP_HIGH / 10 and tail > SAMPLER_GAP_GROWTH * head:
        ev = f"{key} {head:.3g} -> {tail:.3g} (> {SAMPLER_GAP_GROWTH:g}x the start) by {where}"
        margin = tail / (SAMPLER_GAP_GROWTH * head) - 1
    else:
        return None
    cfg = s.cfg
    if cfg.sampler_dtype not in (None, cfg.model.dtype):  # the gap is the lower-precision sampler's rounding
        change = Change("sampler_dtype", cfg.sampler_dtype, None)
        reason = "sample at the update's precision"
    elif cfg.off_policy_mask_threshold is None:
        change = Change("off_policy_mask_threshold", None, OFF_POLICY_MASK_TARGET)
        reason = ("mask the negative-advantage sequences the sampler moved off-policy (DeepSeek-V3.2); with vLLM, "
                  "also sample in the trainer's dtype and keep vllm_importance_sampling_correction on")
    else:
        change, reason = None, "the off-policy mask is on: sample in the trainer's dtype (vLLM's dtype)"
    return _finding(sampler_mismatch, ev, [change] if change else [], reason, confidence(margin, s.n_train),
                    sampler_gap_head=head, sampler_gap_tail=tail)


# ---- applying ------------------------------------------------------------------------------------------------
def _set(data: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        data = data.setdefault(p, {})
    data[parts[-1]] = value


# A rule whose treatment changes the config explains away the symptoms of the rules it confounds: a completion
# cut at the budget scores as wrong, so falling accuracy (kl_drift) and reward rising on format alone
# (reward_misalignment) follow from truncation. Those findings are kept as evidence; their changes wait a round.
# no_signal confounds every other rule, with or without a change of its own: with no learning signal, equal
# rewards, flat entropy or a still policy say nothing about temperature, clip or layers.
CONFOUNDS = {"truncation": ("kl_drift", "reward_misalignment", "low_diversity", "entropy_collapse"),
             # a blown-up policy cuts, repeats and equalises its completions: every other symptom follows from it
             "step_too_large": tuple(name for name, _, _ in RULES if name not in ("no_signal", "too_few_records",
                                                                                  "no_update", "cannot_judge",
                                                                                  "step_too_large")),
             # groups too small to rank their completions: their equal rewards say nothing of diversity (held_still
             # weighs itself whether larger groups explain a still policy)
             "group_small": ("low_diversity", "entropy_collapse"),
             # answers drawn from the distribution's tail: their equal or spread rewards say nothing of diversity
             "sampling_too_hot": ("low_diversity", "entropy_rise", "entropy_collapse"),
             # a reward that pays the format saturates on the format: neither harder data nor a bigger step helps
             "correctness_unpaid": ("early_saturation", "low_diversity", "reward_misalignment", "held_still"),
             # the wider, sited treatment of the same idea (LoRA Without Regret): narrow_lora's change waits for it
             "lora_narrow": ("held_still", "narrow_lora"),
             "no_signal": tuple(name for name, _, _ in RULES if name not in ("no_signal", "too_few_records",
                                                                             "no_update", "cannot_judge")),
             "no_update": tuple(name for name, _, _ in RULES if name not in ("no_update", "too_few_records",
                                                                             "cannot_judge"))}


FALLBACK_QUIET = ("no_progress", "cannot_judge", "run_crashed")  # findings that name no cause of a flat reward


def diagnose(signals: Signals) -> list[Finding]:
    """Run every rule in order; a key already changed by an earlier rule is not changed again (its later
    finding keeps the evidence and says which rule covered it), and a confounded rule's changes wait. With too
    few records only the rules that read a level run (LEVEL_RULES), never a trend."""
    few = too_few_records(signals)
    if not signals.train and not signals.eval:  # a log with no record: how it ended is all there is to say
        return [f for f in (run_crashed(signals), cannot_judge(signals)) if f is not None]
    if few is not None:  # levels that hold at any point can still be read; trends cannot
        with signals.few_points(FEW_MIN_POINTS):
            found = [(name, f) for name, _, fn in RULES if name in LEVEL_RULES and (f := fn(signals)) is not None]
        if found:
            few.reason = ("the findings below rest on these few records (trends are not judged); train longer "
                          "before judging the rest")
        found = [("too_few_records", few), *found]
    else:
        found = [(name, f) for name, _, fn in RULES if name != "too_few_records" and (f := fn(signals)) is not None]
        if any(name not in FALLBACK_QUIET for name, _ in found):  # no_progress speaks only where nothing else does
            found = [(name, f) for name, f in found if name != "no_progress"]
    deferred = {r: name for name, f in found if f.changes or name in ("no_signal", "no_update")
                for r in CONFOUNDS.get(name, ())}
    findings, taken = [], {}
    for name, f in found:
        if name in deferred and f.changes:
            f.reason += f" (deferred: {deferred[name]} explains this symptom; fix it first and re-check)"
            f.changes = []
        kept = []
        for c in f.changes:
            if c.key in taken:
                f.reason += f" ({c.key} already changed by {taken[c.key]})"
            else:
                taken[c.key] = name
                c.rule = name
                kept.append(c)
        f.changes = kept
        f.cost = signals.cost(f.onset) if f.onset is not None or f.changes else {}
        findings.append(f)
    return findings


def _field(s: Signals, key: str) -> str:
    return ((s.provenance or {}).get("fields") or {}).get(key, key)


def own_terms(s: Signals, findings: list[Finding]) -> None:
    """No change starts from a value the run did not have: a change to a key the run only shows in its logs, or
    not at all, becomes advice phrased from what the logs show, in the trainer's own field names."""
    for f in findings:
        kept = []
        for c in f.changes:
            held = s.known(c.key)
            if held is not None and held.get("how") == "read":
                kept.append(c)
                continue
            name = _field(s, c.key)
            if c.key.startswith("task."):  # the data, not a trainer setting: no GRPOConfig / verl key to name
                harder = f.rule == "early_saturation"  # the one rule that asks for harder data
                f.reason += (f"; advice: train on {'harder' if harder else 'easier'} problems (a change to the data "
                             "set; the run's trainer has no setting for it)")
                continue
            up = isinstance(c.new, (int, float)) and isinstance(c.old, (int, float)) and c.new > c.old
            down = isinstance(c.new, (int, float)) and isinstance(c.old, (int, float)) and c.new < c.old
            verb = "raise" if up else "lower" if down else "change"
            if held is not None:  # inferred from the logs
                value = held.get("value")
                where = "above" if up else "below" if down else "from"
                f.reason += (f"; advice: {verb} {name} {where} the observed {_show(value)} ({held.get('evidence')})"
                             "; the run does not hold its configured value, so no value is changed")
            else:
                f.reason += (f"; advice: {verb} {name} (the run does not show its value, so mechdiag does not "
                             "start from one)")
        f.changes = kept


def apply(cfg: Config, findings: list[Finding]) -> Config:
    data = cfg.model_dump(mode="json")
    for f in findings:
        for c in f.changes:
            _set(data, c.key, c.new)
    return configlib.from_dict(data)


def header(findings: list[Finding], runs: list[str]) -> str:
    lines = [f"Refined by mechdiag recommend from {', '.join(runs)}"]
    changes = [(c, f) for f in findings for c in f.changes]
    if not findings:
        lines.append("No rule fired: the config is unchanged.")
    elif not changes:
        lines.append("No change to the config; advice only.")
    for c, f in changes:
        lines.append(f"- {c}  [{f.rule}, confidence {f.confidence}] {f.evidence}")
    for f in findings:
        if not f.changes:
            lines.append(f"- advice [{f.rule}, confidence {f.confidence}] {f.reason}: {f.evidence}")
    return "\n".join(lines)


@dataclass
class Recommendation:
    cfg: Config  # the refined config
    base_cfg: Config
    findings: list[Finding]
    runs: list[str]
    comparison: list[dict]
    provenance: dict | None = None  # a foreign run's account of its config (Signals.provenance)
    notes: list[str] = field(default_factory=list)  # advice that is no finding (a control run for a gain)
    course: list[str] = field(default_factory=list)  # what the run did, beside its findings (course_lines)

    @property
    def changes(self) -> list[Change]:
        return [c for f in self.findings for c in f.changes]

    @property
    def header(self) -> str:
        return header(self.findings, self.runs)

    def text(self) -> str:
        """The refined config as YAML. A foreign run's holds only the keys its files show (read or inferred, as
        refined): mechdiag's placeholders for the rest are never written as the run's settings."""
        if self.provenance is None:
            return configlib.to_yaml(self.cfg, self.header)
        flat = flatten_config(self.cfg.model_dump(mode="json"))
        shown = {k for k, e in (self.provenance.get("keys") or {}).items() if e.get("how") in ("read", "inferred")}
        data: dict = {}
        for key in sorted(k for k in flat if k in shown or k.split(".", 1)[0] in shown):
            _set(data, key, flat[key])
        note = ("Only the settings the run's files show are written (read or inferred from its logs); the rest "
                "are left out, so mechdiag's defaults are never presented as the run's.")
        return configlib.to_yaml_dict(data, self.header + "\n" + note)


def recommend(runs: list[Run]) -> Recommendation:
    """Diagnose loaded runs and refine their config. With several configs among the runs, the rules read the group
    with the best mean final accuracy (the comparison of all groups comes with it)."""
    if not runs:
        raise UserError("give at least one run directory")
    for r in runs:
        r.cfg  # noqa: B018 - validates config.yaml (UserError when missing or invalid) before any rule reads it
        if not r.metrics and not r.eval and not (r.summary.get("read") or {}).get("ended"):
            raise UserError(f"{r.path} has neither metrics.jsonl nor eval.jsonl records: nothing to diagnose")
    groups = group_runs(runs)
    comparison = side_by_side(runs) if len(runs) > 1 else []
    best = max(groups, key=lambda g: sum(final_eval(r).get("accuracy", -1.0) for r in g.runs) / len(g.runs))
    signals = Signals.from_runs(best.runs)
    findings = diagnose(signals)
    own_terms(signals, findings)
    return Recommendation(apply(signals.cfg, findings), signals.cfg, findings, signals.runs, comparison,
                          signals.provenance, control_note(signals), course_lines(signals))


def course_lines(s: Signals) -> list[str]:
    """What the run did, beside its findings (a healthy run is told it learned, not only that nothing fired): the
    train reward's head and tail quarters (rose, fell, or held within two standard errors), the held-out accuracy
    from its start to its end, and where a printed log stopped short of its planned total with no error."""
    out = []
    gain = s.window_gain("reward")
    if gain is not None:
        d = gain[1] - gain[0]
        how = "rose" if d > gain[2] else "fell" if -d > gain[2] else "held (within 2 SE)"
        out.append(f"train reward {how}: {gain[0]:.3g} -> {gain[1]:.3g} over {gain[3]} (2 SE {gain[2]:.3g})")
    trend = s.accuracy_trend()
    steps, ev_reward = s.series("eval_reward", "eval")
    if trend is not None:
        out.append(f"held-out accuracy {s.start_label} {trend[2]:.3g} -> {trend[1]:.3g} (best {trend[0]:.3g})")
    elif len(ev_reward) >= 2:
        out.append(f"held-out reward {ev_reward[0]:.3g} (step {steps[0]}) -> {ev_reward[-1]:.3g} (step {steps[-1]})")
    planned, last = s.ending.get("planned_steps"), max(s.train, default=None)
    if planned and last is not None and last < planned and not s.ending.get("error"):
        out.append(f"the log stops at step {last} of {planned} planned, with no error printed (still running, "
                   "stopped, or cut short)")
    return out


def control_note(s: Signals) -> list[str]:
    """A held-out gain is trusted beside a control: the same budget with a random reward (Spurious rewards,
    arXiv 2506.10947: a Qwen base gains from random rewards alone)."""
    trend = s.accuracy_trend()
    if trend is None or trend[1] - trend[2] <= CONTROL_GAIN:
        return []
    if s.known("rewards.control") and s.cfg.rewards.control == "random":
        return [f"held-out accuracy {s.start_label} {trend[2]:.3g} -> {trend[1]:.3g} under a random reward: this "
                "much of a run's gain needs no reward signal (Spurious rewards, arXiv 2506.10947)"]
    how = "`--set rewards.control=random`; " if s.provenance is None else ""  # a mechdiag run: our own switch
    return [f"held-out accuracy {s.start_label} {trend[2]:.3g} -> {trend[1]:.3g}: to trust this gain, train a "
            f"control run with a random reward at the same budget and seed ({how}Spurious rewards, arXiv "
            "2506.10947: a Qwen base gains from random rewards alone)"]
