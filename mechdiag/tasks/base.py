"""What a task is: data + prompt + reward components + eval metric.

A task yields Examples, formats each as a prompt (the model's chat template where it has one, else a plain
template), scores a completion into named reward components in [0, 1] (weighted by config.rewards.weights)
and says whether it is correct (the eval metric).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mechdiag.tasks.rewards import REWARD_WEIGHTS, answer_number, extract_answer, weighted_total


@dataclass
class Example:
    id: str
    question: str
    answer: Any  # gold: a number string, an option letter, or test code
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    name: str = "task"
    domain: str = "math"  # math | mcq | code: picks the default reward weights (paper-notes §6)
    votable: bool = True  # answers compare equal across samples (maj@k is reported)

    @classmethod
    def reward_weights(cls) -> dict[str, float]:
        """The study's components and weights for this task (Table 6 by domain); keys are the components it
        scores. Used unless the config sets rewards.weights. Override for a task with other components."""
        return dict(REWARD_WEIGHTS[cls.domain])

    def examples(self, split: str, n: int | None = None, seed: int = 0) -> list[Example]:
        raise NotImplementedError

    def prompt(self, example: Example, tokenizer=None) -> str:
        raise NotImplementedError

    def components(self, completion: str, example: Example) -> dict[str, float]:
        """Named reward components, each in [0, 1] before weighting."""
        raise NotImplementedError

    def correct(self, completion: str, example: Example) -> bool:
        raise NotImplementedError

    def components_many(self, completions: list[str], examples: list[Example]) -> list[dict[str, float]]:
        """Components of many completions; code tasks override it to run their sandboxes in parallel."""
        return [self.components(c, e) for c, e in zip(completions, examples, strict=True)]

    def correct_many(self, completions: list[str], examples: list[Example]) -> list[bool]:
        return [self.correct(c, e) for c, e in zip(completions, examples, strict=True)]

    def answer_key(self, completion: str, example: Example):
        """The answer a completion gives, in a form where equal answers compare equal (maj@k); None if none.
        Here: its number, else its answer block's text."""
        num = answer_number(completion)
        if num is not None:
            return num
        text = " ".join((extract_answer(completion) or "").lower().split()).rstrip(".")
        return text or None

    def reward(self, completion: str, example: Example, weights: dict[str, float]) -> tuple[float, dict]:
        comps = self.components(completion, example)
        return weighted_total(comps, weights), comps


SYSTEM_PROMPT = ("Think step by step inside <reasoning>...</reasoning>, then give only the final answer "
                 "inside <answer>...</answer>.")


def format_prompt(question: str, tokenizer=None, system: str = SYSTEM_PROMPT,
                  shots: list[tuple[str, str]] = (), prefill: str = "") -> str:
    """The training prompt: the model's chat template where it has one, else the plain 'Q: ...\\nA: ' form.
    shots: worked (question, completion) pairs shown first (as earlier chat turns); prefill: text the answer
    starts with (the completion, and so its reward, is what the model writes after it)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}]
        for q, a in shots:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill
    return "".join(f"Q: {q}\nA: {a}\n" for q, a in shots) + f"Q: {question}\nA: {prefill}"
