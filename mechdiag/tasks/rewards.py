"""Reward components of the study's Table 6 and the extractors they share.

Every component returns a value in [0, 1]; config.rewards.weights scales them. Extraction is tolerant of
<think>...</think> in place of <reasoning>, of a missing closing tag at the very end, and of fenced code.
"""

from __future__ import annotations

import hashlib
import re
from fractions import Fraction

REASONING_ALIASES = ("reasoning", "think")

# Table 6 (paper-notes §6): the study's reward components and their weights per domain. A task's default
# weights are its domain's (Task.reward_weights); config rewards.weights replaces them.
REWARD_WEIGHTS = {
    "math": {"correctness": 2.0, "xml_count": 0.5, "numeric": 0.5, "format": 0.5,
             "reasoning_nonempty": 0.1, "answer_nonempty": 0.1},
    "mcq": {"correctness": 2.0, "valid_option": 0.5, "xml_count": 0.5, "format": 0.5},
    "code": {"correctness": 1.0, "complexity": 1.0, "xml_count": 0.5, "syntax": 0.5, "reasoning_nonempty": 0.1},
}


RANDOM = "random"  # the control run's one paid component (rewards.control: random)


def coin(seed: int, example_id: str, completion: str) -> float:
    """The control's reward: 0 or 1 with even odds, a fixed function of the run's seed, the example and the
    completion (the same text earns the same coin, as from any reward function), blind to what it says."""
    digest = hashlib.sha256(f"{seed}\0{example_id}\0{completion}".encode("utf-8", "replace")).digest()
    return float(digest[0] & 1)


def weighted_total(components: dict, weights: dict[str, float], missing: float = 0.0):
    """The reward: sum of weight * component. A component with no weight counts `missing` (0 for a task's own
    weights; TRL weighs an unnamed reward function 1). Components may be numbers or pandas columns."""
    return sum(float(weights.get(k, missing)) * v for k, v in components.items())

# Completions are parsed only up to this many characters (longer text is cut first): every parse below is
# linear in the text, and the cap bounds it (a 64 KB run of `<answer>` costs milliseconds, not seconds).
MAX_COMPLETION_CHARS = 1 << 18


def capped(text: str) -> str:
    """The part of a completion that is parsed: its first MAX_COMPLETION_CHARS characters."""
    return text if len(text) <= MAX_COMPLETION_CHARS else text[:MAX_COMPLETION_CHARS]


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the first <tag>...</tag>; an unclosed last tag runs to the end of the text. Linear (two
    substring searches; the first opening tag is the regex `<tag>(.*?)</tag>`'s leftmost match)."""
    text = capped(text)
    opening, closing = f"<{tag}>", f"</{tag}>"
    i = text.find(opening)
    if i < 0:
        return None
    i += len(opening)
    j = text.find(closing, i)
    return (text[i:] if j < 0 else text[i:j]).strip()


def extract_reasoning(text: str, tag: str = "reasoning") -> str | None:
    for t in (tag, *REASONING_ALIASES):
        got = extract_tag(text, t)
        if got is not None:
            return got
    return None


def extract_answer(text: str, tag: str = "answer") -> str | None:
    return extract_tag(text, tag)


def xml_count(text: str, reasoning_tag: str = "reasoning", answer_tag: str = "answer") -> float:
    """A quarter for each of the four tags present exactly once (<think> counts as the reasoning tag)."""
    text = capped(text)
    r = next((t for t in (reasoning_tag, *REASONING_ALIASES) if f"<{t}>" in text), reasoning_tag)
    tags = [f"<{r}>", f"</{r}>", f"<{answer_tag}>", f"</{answer_tag}>"]
    return sum(0.25 for t in tags if text.count(t) == 1)


def format_ok(text: str, reasoning_tag: str = "reasoning", answer_tag: str = "answer") -> float:
    """1 when the whole completion is exactly one reasoning block followed by one answer block: surrounding
    whitespace, `<r>` (r the reasoning tag or an alias), anything, `</r>`, whitespace, `<answer>`, anything,
    `</answer>`. Linear: each `</r>` is looked at once."""
    s = capped(text).strip()
    a_open, a_close = f"<{answer_tag}>", f"</{answer_tag}>"
    if not s.endswith(a_close):
        return 0.0
    for r in dict.fromkeys((reasoning_tag, *REASONING_ALIASES)):
        r_open, r_close = f"<{r}>", f"</{r}>"
        if not s.startswith(r_open):
            continue
        end = len(s) - len(a_close)  # the answer's opening tag must end by here
        at = s.find(r_close, len(r_open))
        while 0 <= at:
            q = at + len(r_close)
            while q < end and s[q].isspace():
                q += 1
            if q + len(a_open) <= end and s.startswith(a_open, q):
                return 1.0
            at = s.find(r_close, at + 1)
    return 0.0


def nonempty(block: str | None) -> float:
    return 1.0 if block and block.strip() else 0.0


# ---- numbers -----------------------------------------------------------------------------------------------
_NUMBER_TEXT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE]([+-]?\d+))?|[+-]?\d+/\d+")
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def parse_number(text: str | None) -> Fraction | None:
    """Parse '1,000', '$18', '18.0', '18.', '-3', '3/4', '50%' (as 50) into an exact Fraction; None if absent."""
    if text is None:
        return None
    s = text.strip().replace("$", "").replace("\u2212", "-").rstrip(".").rstrip("%").strip()
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    m = _NUMBER_TEXT.fullmatch(s)
    if not m or (m.group(1) and abs(int(m.group(1))) > 400):  # "1e999999999" would build a huge integer
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str | None) -> Fraction | None:
    """The last number written in free text (the fallback when a completion has no answer tag)."""
    if not text:
        return None
    found = _NUM.findall(text)
    return parse_number(found[-1]) if found else None


def answer_number(completion: str, answer_tag: str = "answer") -> Fraction | None:
    """The number in the answer block: the block itself, else the last number inside it."""
    block = extract_answer(completion, answer_tag)
    if block is None:
        return None
    return parse_number(block) if parse_number(block) is not None else last_number(block)


def numbers_equal(a: Fraction | None, b: Fraction | None, rel_tol: float = 1e-9) -> bool:
    """Exact for two integers (1000001 is not 1000000); else within rel_tol (float noise: 1806106.8000000003)."""
    if a is None or b is None:
        return False
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False
    return abs(float(a) - float(b)) <= rel_tol * max(1.0, abs(float(b)))


def math_components(completion: str, gold, reasoning_tag: str = "reasoning", answer_tag: str = "answer") -> dict:
    """Table 6, math: correctness, xml_count, numeric, format, reasoning_nonempty, answer_nonempty."""
    gold_num = gold if isinstance(gold, Fraction) else parse_number(str(gold))
    got = answer_number(completion, answer_tag)
    block = extract_answer(completion, answer_tag)
    return {
        "correctness": 1.0 if numbers_equal(got, gold_num) else 0.0,
        "xml_count": xml_count(completion, reasoning_tag, answer_tag),
        "numeric": 1.0 if block is not None and parse_number(block) is not None else 0.0,
        "format": format_ok(completion, reasoning_tag, answer_tag),
        "reasoning_nonempty": nonempty(extract_reasoning(completion, reasoning_tag)),
        "answer_nonempty": nonempty(block),
    }
