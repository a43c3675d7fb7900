"""Math word-problem benchmarks: GSM8K, GSM-Plus, GSM-Hard, SVAMP (numeric answers) and MATH-500 (LaTeX answers).

All score with the Table 6 math components; the gold answer is a canonical number string ("1,000" -> "1000",
"18.0" -> "18", 3/4 stays "3/4"). MATH-500 replaces the numeric comparison with mathnorm.equivalent.
"""

from __future__ import annotations

import re

from mechdiag.tasks.base import Example, format_prompt
from mechdiag.tasks.data import FileTask
from mechdiag.tasks.mathnorm import equivalent, last_boxed, normalize, to_number
from mechdiag.tasks.rewards import (
    answer_number,
    extract_answer,
    extract_reasoning,
    format_ok,
    math_components,
    nonempty,
    numbers_equal,
    parse_number,
    xml_count,
)


def canonical_number(value) -> str:
    """'1,000' -> '1000', 18.0 -> '18', '$18' -> '18', 2.50 -> '2.5', '3/4' -> '3/4'."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    num = parse_number(str(value))
    if num is None:
        raise ValueError(f"not a number: {value!r}")
    if num.denominator == 1:
        return str(num.numerator)
    if "/" in str(value):
        return f"{num.numerator}/{num.denominator}"
    return str(value).strip().replace(",", "").replace("$", "").rstrip("0").rstrip(".")


def gold_completion(reasoning: str, answer: str) -> str:
    return f"<reasoning>{reasoning.strip() or 'Compute.'}</reasoning><answer>{answer}</answer>"


def _clean_rationale(text: str) -> str:
    return re.sub(r"<<[^>]*>>", "", text.split("####")[0]).strip()


class NumericScoring:
    """Prompt, reward components and correctness of a task whose gold answer is one number (mixed into tasks)."""

    domain = "math"

    def prompt(self, example: Example, tokenizer=None) -> str:
        return format_prompt(example.question, tokenizer)

    def components(self, completion: str, example: Example) -> dict[str, float]:
        return math_components(completion, example.answer)

    def correct(self, completion: str, example: Example) -> bool:
        return numbers_equal(answer_number(completion), parse_number(example.answer))


class NumericTask(NumericScoring, FileTask):
    """A word problem with a numeric gold answer."""

    def numeric_example(self, id_: str, question: str, answer, reasoning: str = "", **meta) -> Example:
        ans = canonical_number(answer)
        return Example(id=id_, question=question.strip(), answer=ans,
                       meta={"gold_completion": gold_completion(reasoning, ans), **meta})


class GSM8K(NumericTask):
    """openai/grade-school-math; gold = the number after '####' in the answer."""

    name = "gsm8k"
    files = {"train": ("gsm8k", "train.jsonl"), "test": ("gsm8k", "test.jsonl"),
             "test_socratic": ("gsm8k", "test_socratic.jsonl")}
    schemas = [("question", "answer")]
    hub = "openai/gsm8k:main"

    def make_example(self, rec, index, split):
        text = str(rec["answer"])
        final = text.rsplit("####", 1)[-1].strip() if "####" in text else text.strip()
        if parse_number(final) is None:
            raise ValueError(f"answer has no '#### <number>' (got {final[:40]!r})")
        return self.numeric_example(f"{split}-{index}", rec["question"], final, _clean_rationale(text))


NONE_ANSWERS = {"none", "no answer", "cannot be determined", "can not be determined", "not enough information",
                "insufficient information", "unanswerable", "cannot be answered", "not determinable"}


def _is_none_answer(block: str | None) -> bool:
    return block is not None and re.sub(r"[^a-z ]", "", block.lower()).strip() in NONE_ANSWERS


class GSMPlus(NumericTask):
    """GSM-Plus testmini (8 perturbations of 200 GSM8K test questions). 'critical thinking' items have gold
    'None' (the question lacks information): correct is an answer block saying none / cannot be determined."""

    name = "gsm_plus"
    files = {"test": ("gsm_plus", "gsmplus_testmini.jsonl")}
    schemas = [("question", "answer", "perturbation_type")]
    hub = "qintongli/GSM-Plus"
    hub_splits = {"test": "testmini"}

    def option_names(self):
        return ("perturbation", "include_critical")

    def make_example(self, rec, index, split):
        want = self.options.get("perturbation")
        kind = rec["perturbation_type"]
        if want is not None and kind not in ([want] if isinstance(want, str) else want):
            return None
        meta = {"perturbation": kind}
        reasoning = _clean_rationale(str(rec.get("solution", "")))
        if str(rec["answer"]).strip() == "None":
            if not self.options.get("include_critical", True):
                return None
            return Example(id=f"{split}-{index}", question=rec["question"].strip(), answer="None",
                           meta={"gold_completion": gold_completion(reasoning, "None"), **meta})
        return self.numeric_example(f"{split}-{index}", rec["question"], rec["answer"], reasoning, **meta)

    def components(self, completion, example):
        comps = math_components(completion, example.answer)
        if example.answer == "None":
            hit = _is_none_answer(extract_answer(completion))
            comps["correctness"] = comps["numeric"] = 1.0 if hit else 0.0
        return comps

    def correct(self, completion, example):
        if example.answer == "None":
            return _is_none_answer(extract_answer(completion))
        return super().correct(completion, example)


class GSMHard(NumericTask):
    """PAL GSM-Hard v2: GSM8K test questions with larger numbers; gold = float `target`."""

    name = "gsm_hard"
    files = {"test": ("gsm_hard", "gsmhardv2.jsonl")}
    schemas = [("input", "target")]
    hub = "reasoning-machines/gsm-hard"
    hub_splits = {"test": "train"}

    def make_example(self, rec, index, split):
        return self.numeric_example(f"{split}-{index}", rec["input"], float(rec["target"]), "Compute.",
                                    program=rec.get("code"))


class SVAMP(NumericTask):
    """SVAMP: question = Body + ' ' + Question; gold = Answer; the Equation is the gold reasoning."""

    name = "svamp"
    files = {"test": ("svamp", "SVAMP.json")}
    schemas = [("Body", "Question", "Answer")]
    hub = "ChilleD/SVAMP"

    def make_example(self, rec, index, split):
        q = f"{rec['Body'].strip()} {rec['Question'].strip()}"
        eq = str(rec.get("Equation", "")).strip()
        return self.numeric_example(str(rec.get("ID", f"{split}-{index}")), q, float(rec["Answer"]),
                                    f"{eq} = {canonical_number(float(rec['Answer']))}" if eq else "",
                                    type=rec.get("Type"))


def latex_answer(completion: str, answer_tag: str = "answer") -> str | None:
    """The answer block (its \\boxed{} if any); without an answer tag, the last \\boxed{} of the completion."""
    block = extract_answer(completion, answer_tag)
    if block is None:
        return last_boxed(completion)
    return block


class MATH500(FileTask):
    """MATH-500 (Lightman et al. test subset); answers are LaTeX, compared with mathnorm.equivalent."""

    name = "math500"
    domain = "math"

    def answer_key(self, completion: str, example: Example):
        got = latex_answer(completion)
        return normalize(got) if got else None
    files = {"test": ("math500", "test.jsonl")}
    schemas = [("problem", "answer")]
    hub = "HuggingFaceH4/MATH-500"

    def option_names(self):
        return ("level", "subject")

    def make_example(self, rec, index, split):
        level, subject = self.options.get("level"), self.options.get("subject")
        if level is not None and int(rec.get("level", -1)) not in ([level] if isinstance(level, int) else level):
            return None
        if subject is not None and rec.get("subject") != subject:
            return None
        ans = str(rec["answer"]).strip()
        if not ans:
            raise ValueError("empty answer")
        return Example(id=str(rec.get("unique_id", f"{split}-{index}")), question=rec["problem"].strip(),
                       answer=ans, meta={"gold_completion": gold_completion("Solve.", ans),
                                         "level": rec.get("level"), "subject": rec.get("subject")})

    def prompt(self, example, tokenizer=None):
        return format_prompt(example.question, tokenizer)

    def correct(self, completion, example):
        got = latex_answer(completion)
        return got is not None and equivalent(got, example.answer)

    def components(self, completion, example):
        block = extract_answer(completion)
        got = latex_answer(completion)
        return {
            "correctness": 1.0 if got is not None and equivalent(got, example.answer) else 0.0,
            "xml_count": xml_count(completion),
            "numeric": 1.0 if got is not None and to_number(normalize(got)) is not None else 0.0,
            "format": format_ok(completion),
            "reasoning_nonempty": nonempty(extract_reasoning(completion)),
            "answer_nonempty": nonempty(block),
        }


__all__ = ["GSM8K", "GSMPlus", "GSMHard", "SVAMP", "MATH500", "canonical_number"]
