from fractions import Fraction

import pytest

from mechdiag.errors import UserError
from mechdiag.tasks import get_task
from mechdiag.tasks.rewards import math_components, parse_number


def test_splits_deterministic_and_disjoint():
    task = get_task("arith")
    train = task.examples("train", 3000)
    test = task.examples("test", 500)
    assert [e.question for e in test] == [e.question for e in get_task("arith").examples("test", 500)]
    assert not {e.question for e in train} & {e.question for e in test}
    assert len({e.question for e in test}) == 500


def test_gold_completion_full_reward_and_wrong_none():
    task = get_task("arith", difficulty=3)
    for split in ("train", "test", "ood_steps", "ood_numbers"):
        for ex in task.examples(split, 50):
            gold = ex.meta["gold_completion"]
            comps = task.components(gold, ex)
            assert comps == {k: 1.0 for k in comps}, (gold, comps)
            assert task.correct(gold, ex)
            wrong = gold.replace(f"<answer>{ex.answer}</answer>", f"<answer>{int(ex.answer) + 1}</answer>")
            assert not task.correct(wrong, ex) and task.components(wrong, ex)["correctness"] == 0.0
            # the reasoning chain is arithmetically true
            for step in ex.meta["reasoning"].split(";"):
                lhs, rhs = step.split("=")
                assert eval(lhs) == int(rhs)  # noqa: S307 - our own generated arithmetic


def test_ood_splits_are_harder():
    task = get_task("arith")
    steps = lambda exs: max(e.meta["reasoning"].count(";") + 1 for e in exs)  # noqa: E731
    assert steps(task.examples("ood_steps", 100)) > steps(task.examples("test", 100))
    big = max(int(e.question.split(" has ")[1].split()[0]) for e in task.examples("ood_numbers", 200))
    assert big > task.max_number


def test_bad_options():
    with pytest.raises(UserError):
        get_task("arith", difficulty=9)
    with pytest.raises(UserError, match="splits"):
        get_task("arith").examples("validation", 3)
    with pytest.raises(UserError, match="did you mean arith"):
        get_task("arth")


@pytest.mark.parametrize("text,want", [("1,000", 1000), ("$18", 18), ("18.0", 18), ("18.", 18), ("-3", -3),
                                       ("3/4", Fraction(3, 4)), ("50%", 50), ("abc", None), ("", None)])
def test_parse_number(text, want):
    assert parse_number(text) == want


def test_think_tags_and_partial_format():
    comps = math_components("<think>2+2=4</think><answer>4</answer>", "4")
    assert comps["correctness"] == 1.0 and comps["format"] == 1.0 and comps["reasoning_nonempty"] == 1.0
    comps = math_components("The answer is 4", "4")
    assert comps["correctness"] == 0.0 and comps["xml_count"] == 0.0
    comps = math_components("<reasoning>x</reasoning><answer>four 4</answer> trailing", "4")
    assert comps["correctness"] == 1.0 and comps["numeric"] == 0.0 and comps["format"] == 0.0
