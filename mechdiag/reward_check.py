"""`mechdiag check-reward`: a pre-flight check of a config's reward before any training.

Degenerate completions (empty, the prompt echoed back, the tags alone, a completion cut before its answer, the
right answer without any reasoning) are scored by the task's own reward components under the config's weights,
beside two genuine completions (reasoning, then the right or a wrong answer). A component is flagged when it pays
a completion with no answer at all (empty, the prompt echoed) anything (its default value is credit) or pays a
failure more than a genuine wrong answer, a degenerate
completion is flagged when its total reward reaches a genuine wrong answer's, and the reward as a whole when a
correct answer earns less than CORRECT_MARGIN_MIN of the maximum more than a wrong one (the format pays, not the
answer). Thresholds: docs/recommendations.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from mechdiag.config import Config
from mechdiag.errors import UserError
from mechdiag.metrics import max_reward
from mechdiag.tasks import Example, get_task, reward_weights
from mechdiag.tasks.rewards import parse_number, weighted_total

CORRECT_MARGIN_MIN = 0.25  # a correct answer must earn at least this share of the maximum more than a wrong one
N_EXAMPLES = 8  # train examples scored (the mean over them is reported)
FAILURES = ("empty", "prompt_echo", "format_only", "truncated")  # must score below a genuine wrong answer
NO_ANSWER = ("empty", "prompt_echo")  # completions with no answer at all: any credit is a default value
FORMS = (*FAILURES, "answer_only", "genuine_wrong", "genuine_correct")
REASONING = "Work through the problem one step at a time, then check the result."


@dataclass
class Flag:
    what: str  # a component name, a completion form, or "correctness"
    message: str

    def record(self) -> dict:
        return {"kind": "flag", "what": self.what, "message": self.message}


@dataclass
class Check:
    weights: dict[str, float]
    scores: dict[str, dict[str, float]]  # form -> component -> weighted score (mean over examples), "total" too
    flags: list[Flag] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    n: int = 0


def _wrong_answer(task, example: Example) -> str:
    """A well-formed but wrong answer in the task's own answer space."""
    labels = example.meta.get("labels")
    if task.domain == "mcq" and labels:
        return next(lab for lab in labels if lab != example.answer)
    gold = parse_number(str(example.answer))
    if gold is not None:
        wrong = gold + 1
        return str(wrong.numerator) if wrong.denominator == 1 else str(float(wrong))
    return f"not {example.answer}"


def _gold_answer(example: Example) -> str:
    gold = example.answer
    if isinstance(gold, Fraction):
        return str(gold.numerator) if gold.denominator == 1 else str(float(gold))
    return str(gold)


def forms(cfg: Config, task, example: Example) -> dict[str, str]:
    r, a = cfg.rewards.reasoning_tag, cfg.rewards.answer_tag
    gold = _gold_answer(example)
    return {"empty": "", "prompt_echo": task.prompt(example), "format_only": f"<{r}></{r}>\n<{a}></{a}>",
            "truncated": f"<{r}>{REASONING[: len(REASONING) // 2]}", "answer_only": f"<{a}>{gold}</{a}>",
            "genuine_wrong": f"<{r}>{REASONING}</{r}>\n<{a}>{_wrong_answer(task, example)}</{a}>",
            "genuine_correct": f"<{r}>{REASONING}</{r}>\n<{a}>{gold}</{a}>"}


def check_reward(cfg: Config, n: int = N_EXAMPLES) -> Check:
    """Score the degenerate and genuine completions of n train examples; flag what pays a failure."""
    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    task = get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
    if task.domain == "code":
        raise UserError(f"check-reward scores numeric and multiple-choice answers; {cfg.task.name} is a code task "
                        "(its correctness runs tests in the sandbox)")
    weights = reward_weights(cfg)
    examples = task.examples(cfg.task.train_split, n=n, seed=cfg.seed)
    if not examples:
        raise UserError(f"task {cfg.task.name} has no {cfg.task.train_split} examples to score")
    sums: dict[str, dict[str, float]] = {f: {} for f in FORMS}
    for ex in examples:
        for form, text in forms(cfg, task, ex).items():
            comps = task.components(text, ex)
            row = {k: float(weighted_total({k: v}, weights)) for k, v in comps.items()}
            row["total"] = float(weighted_total(comps, weights))
            for k, v in row.items():
                sums[form][k] = sums[form].get(k, 0.0) + v
    scores = {f: {k: v / len(examples) for k, v in row.items()} for f, row in sums.items()}
    out = Check(weights, scores, n=len(examples))
    wrong = scores["genuine_wrong"]
    for form in FAILURES:
        for comp, v in scores[form].items():
            if comp == "total":
                continue
            if form in NO_ANSWER and v > 1e-9:  # nothing to score: a value here is the component's default
                out.flags.append(Flag(comp, f"{comp} pays {form.replace('_', ' ')} {v:.3g}: its default when there "
                                            "is no answer is credit"))
            elif v > wrong.get(comp, 0.0) + 1e-9:
                out.flags.append(Flag(comp, f"{comp} pays {form.replace('_', ' ')} {v:.3g}, more than a genuine wrong "
                                            f"answer ({wrong.get(comp, 0.0):.3g})"))
        if scores[form]["total"] >= wrong["total"] - 1e-9:
            out.flags.append(Flag(form, f"{form.replace('_', ' ')} scores {scores[form]['total']:.3g}, as much as a "
                                        f"genuine wrong answer ({wrong['total']:.3g})"))
    top = max_reward(weights)
    margin = scores["genuine_correct"]["total"] - wrong["total"]
    if top > 0 and margin < CORRECT_MARGIN_MIN * top:
        out.flags.append(Flag("correctness", f"a correct answer earns {margin:.3g} more than a wrong one, "
                                             f"{margin / top:.0%} of the maximum {top:.3g} "
                                             f"(< {CORRECT_MARGIN_MIN:.0%}): the reward pays the format, not the "
                                             "answer"))
    if scores["answer_only"]["total"] >= scores["genuine_correct"]["total"] - 1e-9:
        out.notes.append("the right answer without reasoning scores as much as with it: reasoning is not paid")
    return out


def table(check: Check) -> str:
    comps = [k for k in check.weights if any(k in row for row in check.scores.values())]
    head = ["completion", "total", *comps]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for form, row in check.scores.items():
        lines.append(" | ".join([form, f"{row['total']:.3g}", *(f"{row.get(c, 0.0):.3g}" for c in comps)]))
    weights = ", ".join(f"{k} {v:g}" for k, v in check.weights.items())
    lines.append(f"(mean over {check.n} train examples; weights {weights})")
    lines += [f"FLAG {f.what}: {f.message}" for f in check.flags] or ["ok: no failure beats a genuine wrong answer"]
    lines += [f"note: {m}" for m in check.notes]
    return "\n".join(lines)


def records(check: Check) -> list[dict]:
    rows = [{"kind": "score", "completion": form, **row} for form, row in check.scores.items()]
    return rows + [f.record() for f in check.flags] + [{"kind": "note", "message": m} for m in check.notes]
