"""Property-based tests of the answer extractors, the number parser and the scorers: they never crash on arbitrary
text, formatted numbers round-trip, and tag extraction keeps its invariants."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechdiag.tasks.code import complexity, extract_code, parses
from mechdiag.tasks.math_tasks import canonical_number
from mechdiag.tasks.mathnorm import equivalent, normalize, to_number
from mechdiag.tasks.mcq import pick_option
from mechdiag.tasks.rewards import (
    answer_number,
    extract_answer,
    extract_reasoning,
    extract_tag,
    format_ok,
    last_number,
    math_components,
    numbers_equal,
    parse_number,
    xml_count,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PIECES = list("ab 1-,.$/\n<>{}") + ["<answer>", "</answer>", "<reasoning>", "</reasoning>", "<think>", "</think>",
                                    "```", "```python\n", "\\boxed{", "\\frac", "\\text{", "^\\circ", "1e999999"]
TAGGY = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)  # text made of the pieces parsers look for
MATHY = st.lists(st.sampled_from(list("0123456789xab+-*/^(){} ,.") + ["\\frac", "\\sqrt", "\\pi", "\\cdot"]),
                 max_size=40).map("".join)  # reaches the sympy fallback: powers, fractions, variables
ANY_TEXT = st.one_of(st.text(max_size=200), TAGGY, MATHY)
CONTENT = st.text(alphabet=st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=80)


@FAST
@given(ANY_TEXT)
def test_extractors_never_crash(text):
    for tag in ("answer", "reasoning", "think"):
        got = extract_tag(text, tag)
        assert got is None or isinstance(got, str)
    assert extract_reasoning(text) is None or isinstance(extract_reasoning(text), str)
    assert 0.0 <= xml_count(text) <= 1.0 and format_ok(text) in (0.0, 1.0)
    for f in (parse_number, last_number, answer_number):
        v = f(text)
        assert v is None or isinstance(v, Fraction)
    comps = math_components(text, "12")
    assert all(0.0 <= v <= 1.0 for v in comps.values())
    code = extract_code(text)
    assert code is None or isinstance(code, str)
    assert complexity(code, "assert f(1) == 3\n") in (0.0, 1.0) and parses(code) in (True, False)
    assert pick_option(text, ["A", "B", "C"], ["x", "y", "z"]) in (None, "A", "B", "C")


@FAST
@given(ANY_TEXT, ANY_TEXT)
def test_latex_normaliser_never_crashes(a, b):
    na = normalize(a)
    assert isinstance(na, str) and " " not in na
    assert equivalent(a, b) in (True, False)
    if na:
        assert equivalent(a, a)
    assert to_number(na) is None or isinstance(to_number(na), Fraction)


@FAST
@given(st.integers(min_value=-10**12, max_value=10**12))
def test_integers_round_trip_through_formats(n):
    for written in (str(n), f"{n:,}", f"{n}.0", f"{n}.", f"${n}" if n >= 0 else f"-${-n}".replace("-$", "-")):
        assert parse_number(written) == n, written
    assert parse_number(canonical_number(f"{n:,}")) == n
    assert answer_number(f"<reasoning>so</reasoning><answer>{n:,}</answer>") == n
    assert last_number(f"the result is {n} apples") == n


@FAST
@given(st.decimals(min_value=-10**6, max_value=10**6, places=4, allow_nan=False, allow_infinity=False))
def test_decimals_round_trip(d):
    text = format(d, "f")
    assert parse_number(text) == Fraction(Decimal(text))
    assert parse_number(canonical_number(text)) == Fraction(Decimal(text))
    assert numbers_equal(parse_number(text), Fraction(float(d)))


@FAST
@given(st.integers(-999, 999), st.integers(1, 999))
def test_fractions_round_trip(a, b):
    assert parse_number(f"{a}/{b}") == Fraction(a, b)
    assert to_number(normalize(f"\\frac{{{a}}}{{{b}}}")) == Fraction(a, b)
    assert equivalent(f"\\dfrac{{{a}}}{{{b}}}", f"{a}/{b}")


@FAST
@given(CONTENT, CONTENT, CONTENT, st.sampled_from(["reasoning", "think"]))
def test_tag_extraction_invariants(reasoning, answer, noise, rtag):
    text = f"{noise}<{rtag}>{reasoning}</{rtag}><answer>{answer}</answer>"
    assert extract_answer(text) == answer.strip()
    assert extract_reasoning(text) == reasoning.strip()
    assert xml_count(text) == 1.0
    assert format_ok(text) == (1.0 if not noise.strip() else 0.0)
    # an unclosed final answer tag runs to the end of the text
    assert extract_answer(f"<{rtag}>{reasoning}</{rtag}><answer>{answer}") == answer.strip()
    # a second answer tag lowers xml_count but the first answer is still the one extracted
    doubled = text + f"<answer>{noise}</answer>"
    assert xml_count(doubled) == 0.5 and extract_answer(doubled) == answer.strip()


@FAST
@given(st.integers(-10**6, 10**6), CONTENT)
def test_math_gold_always_full(n, reasoning):
    reasoning = reasoning.strip() or "r"
    comps = math_components(f"<reasoning>{reasoning}</reasoning><answer>{n}</answer>", str(n))
    assert comps == {k: 1.0 for k in comps}
    assert math_components(f"<reasoning>{reasoning}</reasoning><answer>{n + 1}</answer>", str(n))["correctness"] == 0


@FAST
@given(st.lists(st.sampled_from("ABCDEFG"), min_size=2, max_size=7, unique=True), st.data())
def test_mcq_label_round_trip(labels, data):
    options = [f"option number {i}" for i in range(len(labels))]
    lab = data.draw(st.sampled_from(labels))
    for written in (lab, f"({lab})", f"{lab}.", f"The answer is {lab}", options[labels.index(lab)]):
        assert pick_option(written, labels, options) == lab, written


@FAST
@given(st.text(alphabet=st.characters(blacklist_characters="`<>", blacklist_categories=("Cs",)), max_size=80))
def test_fenced_code_round_trip(code):
    code = code.strip("\n")
    assert extract_code(f"<answer>```python\n{code}\n```</answer>") == code
    assert extract_code(f"<think>t</think>\n```python\n{code}\n```\ntrailing") == code
