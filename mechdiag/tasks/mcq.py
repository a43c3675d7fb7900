"""Multiple-choice benchmarks: ARC-Challenge, OpenBookQA, MMLU-STEM.

The prompt lists the options as "A. text" lines and asks for the letter inside <answer>. Accepted schemas:
AI2 JSONL {"question": {"stem", "choices": [{"text", "label"}]}, "answerKey"}, llm-foundry {"query", "choices",
"gold": int}, the hub layout {"question" | "question_stem", "choices": {"text": [...], "label": [...]},
"answerKey"}, and MMLU {"question", "choices", "answer": int}.
"""

from __future__ import annotations

import re
import string

from mechdiag.tasks.base import Example, format_prompt
from mechdiag.tasks.data import FileTask
from mechdiag.tasks.rewards import extract_answer, format_ok, xml_count

MCQ_INSTRUCTION = "Answer with the letter of the correct option."
_LEAD = re.compile(r"^\W*(?:(?:the\s+)?(?:correct\s+|final\s+)?(?:answer|option|choice)\s*(?:is|:)?\s*[:\-]?\s*)?",
                   re.I)


def pick_option(block: str | None, labels: list[str], options: list[str]) -> str | None:
    """The label an answer block names: 'B', '(B)', 'B.', 'B) text', 'Answer: B', or an option's exact text.
    A block naming further labels after the first ('A B C D', 'B or C') names none."""
    if block is None:
        return None
    s = block.strip()
    if not s:
        return None
    rest = _LEAD.sub("", s, count=1)
    m = re.match(r"^\(?([A-Za-z0-9])\)?(?:[.:)\s]|$)", rest)
    if m:
        lab = m.group(1)
        for cand in (lab, lab.upper()):
            if cand in labels and (len(rest) <= 3 or cand == lab):
                after = rest[m.end():].strip(" .:)-\n").lower()
                if after and not options[labels.index(cand)].lower().startswith(after[:40]):
                    others = set(re.findall(r"\b([A-Z0-9])\b", rest[m.end():])) & (set(labels) - {cand})
                    if others:  # "A B C D", "B, or maybe C": hedging over options names no single one
                        return None
                return cand
    flat = s.lower().rstrip(".").strip()
    for lab, opt in zip(labels, options, strict=True):
        if flat == opt.lower().rstrip(".").strip():
            return lab
    return None


def mcq_components(completion: str, example: Example) -> dict[str, float]:
    """Table 6, MCQ: correctness, valid_option, xml_count, format."""
    labels, options = example.meta["labels"], example.meta["options"]
    got = pick_option(extract_answer(completion), labels, options)
    return {
        "correctness": 1.0 if got is not None and got == example.answer else 0.0,
        "valid_option": 1.0 if got is not None else 0.0,
        "xml_count": xml_count(completion),
        "format": format_ok(completion),
    }


def mcq_example(id_: str, question: str, options: list[str], labels: list[str] | None, gold) -> Example:
    options = [str(o).strip() for o in options]
    labels = [str(lab).strip() for lab in labels] if labels else list(string.ascii_uppercase[:len(options)])
    if len(options) < 2 or len(labels) != len(options):
        raise ValueError(f"need >= 2 options with one label each, got {len(options)} options")
    key = labels[gold] if isinstance(gold, int) and not isinstance(gold, bool) else str(gold).strip()
    if key not in labels:
        raise ValueError(f"answer key {gold!r} is not one of the labels {labels}")
    return Example(id=id_, question=question.strip(), answer=key,
                   meta={"labels": labels, "options": options,
                         "gold_completion": f"<reasoning>The correct option is {key}.</reasoning>"
                                            f"<answer>{key}</answer>"})


class MCQTask(FileTask):
    domain = "mcq"

    def answer_key(self, completion: str, example: Example):
        return pick_option(extract_answer(completion), example.meta["labels"], example.meta["options"])
    schemas = [("question", "answerKey"), ("question_stem", "choices", "answerKey"), ("query", "choices", "gold"),
               ("question", "choices", "answer")]

    def make_example(self, rec, index, split):
        rid = str(rec.get("id", f"{split}-{index}"))
        if "query" in rec and "gold" in rec:  # llm-foundry
            q = re.sub(r"^Question:\s*", "", str(rec["query"]))
            return mcq_example(rid, q, list(rec["choices"]), None, int(rec["gold"]))
        if "answerKey" in rec:
            q = rec.get("question", rec.get("question_stem"))
            choices = rec.get("choices")
            if isinstance(q, dict):  # AI2 JSONL: choices live inside question
                choices, q = q["choices"], q["stem"]
            if isinstance(choices, dict):  # hub: {"text": [...], "label": [...]}
                texts, labels = list(choices["text"]), list(choices["label"])
            else:
                texts, labels = [c["text"] for c in choices], [c["label"] for c in choices]
            return mcq_example(rid, str(q), texts, labels, rec["answerKey"])
        return mcq_example(rid, str(rec["question"]), list(rec["choices"]), None, int(rec["answer"]))

    def prompt(self, example: Example, tokenizer=None) -> str:
        lines = [f"{lab}. {opt}" for lab, opt in zip(example.meta["labels"], example.meta["options"], strict=True)]
        return format_prompt(f"{example.question}\n" + "\n".join(lines) + f"\n{MCQ_INSTRUCTION}", tokenizer)

    def components(self, completion: str, example: Example) -> dict[str, float]:
        return mcq_components(completion, example)

    def correct(self, completion: str, example: Example) -> bool:
        got = pick_option(extract_answer(completion), example.meta["labels"], example.meta["options"])
        return got is not None and got == example.answer


class ARC(MCQTask):
    """ARC-Challenge. test: the llm-foundry copy (all 1172, padded to 4 options); test_ai2 / validation: the AI2
    schema partial copies (1150 / 294 items with their original options and ids)."""

    name = "arc"
    files = {"test": ("arc_challenge", "arc_challenge_test.llmfoundry.jsonl"),
             "test_ai2": ("arc_challenge", "ARC-Challenge-Test.ai2format.partial.jsonl"),
             "validation": ("arc_challenge", "ARC-Challenge-Dev.ai2format.partial.jsonl")}
    hub = "allenai/ai2_arc:ARC-Challenge"
    hub_splits = {"test_ai2": "test"}


class OpenBookQA(MCQTask):
    name = "openbookqa"
    files = {"test": ("openbookqa", "openbook_qa_test.llmfoundry.jsonl")}
    hub = "allenai/openbookqa:main"


STEM_SUBJECTS = frozenset(
    "abstract_algebra astronomy college_biology college_chemistry college_computer_science college_mathematics "
    "college_physics computer_security conceptual_physics electrical_engineering elementary_mathematics "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_mathematics "
    "high_school_physics high_school_statistics machine_learning".split())


class MMLUStem(MCQTask):
    """MMLU, the 18 STEM subjects (other subjects, e.g. from the hub's "all", are left out; option `subject`
    keeps one)."""

    name = "mmlu_stem"
    files = {"test": ("mmlu_stem", "test.jsonl")}
    hub = "cais/mmlu:all"

    def option_names(self):
        return ("subject",)

    def make_example(self, rec, index, split):
        subject = rec.get("type", rec.get("subject"))
        if self.options.get("subject") not in (None, subject) or (subject and subject not in STEM_SUBJECTS):
            return None
        ex = super().make_example(rec, index, split)
        ex.meta["subject"] = subject
        return ex
