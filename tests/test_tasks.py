"""Every benchmark on its real file in shared/data: gold answers in the expected format get full marks, answers
shuffled from other problems get none; schemas, splits, prompts, errors and the code reward components."""

from __future__ import annotations

import json
import re

import pytest

from mechdiag.errors import UserError
from mechdiag.tasks import REGISTRY, get_task
from mechdiag.tasks.code import complexity, extract_code
from mechdiag.tasks.mathnorm import equivalent, normalize
from mechdiag.tasks.mcq import pick_option
from mechdiag.tasks.rewards import REWARD_WEIGHTS

NUMERIC = ["gsm8k", "gsm_plus", "gsm_hard", "svamp"]
MCQ = ["arc", "openbookqa", "mmlu_stem"]
CODE_N = 30  # sandbox runs per benchmark and kind (gold / shuffled)
DOMAINS = {"arith": "math", "gsm8k": "math", "gsm_plus": "math", "gsm_hard": "math", "svamp": "math",
           "math500": "math", "jsonl": "math", "arc": "mcq", "openbookqa": "mcq", "mmlu_stem": "mcq",
           "mbpp": "code", "humaneval": "code"}


@pytest.fixture(scope="module")
def tasks(data_dir):
    return {name: get_task(name) for name in REGISTRY if name not in ("jsonl", "arith")}


def _shuffled(examples):
    """(example, another example with a different gold answer) pairs: a rotation by one."""
    n = len(examples)
    return [(e, examples[(i + 1) % n]) for i, e in enumerate(examples)
            if examples[(i + 1) % n].answer != e.answer]


def test_registry_names_and_domains(tasks):
    assert set(REGISTRY) == set(DOMAINS)
    for name, task in tasks.items():
        assert task.name == name and task.domain == DOMAINS[name], name
        assert set(task.reward(task.examples(task.splits[0], 1)[0].meta["gold_completion"],
                               task.examples(task.splits[0], 1)[0], REWARD_WEIGHTS[task.domain])[1]) \
            == set(REWARD_WEIGHTS[task.domain]) | ({"code_blocked"} if task.domain == "code" else set()), name


@pytest.mark.parametrize("name", NUMERIC)
def test_numeric_gold_full_shuffled_zero(tasks, name):
    task = tasks[name]
    for split in task.splits:
        exs = task.examples(split)
        for e in exs:
            gold = e.meta["gold_completion"]
            assert task.correct(gold, e), (name, e.id, gold[-60:])
            assert task.components(gold, e)["correctness"] == 1.0
        pairs = _shuffled(exs)
        assert len(pairs) > 0.7 * len(exs)
        assert not any(task.correct(o.meta["gold_completion"], e) for e, o in pairs), name
        assert all(task.components(o.meta["gold_completion"], e)["correctness"] == 0.0 for e, o in pairs[:300])


def test_gsm8k_counts_and_full_reward(tasks):
    task = tasks["gsm8k"]
    assert (len(task.examples("train")), len(task.examples("test"))) == (7473, 1319)
    total = sum(REWARD_WEIGHTS["math"].values())
    for e in task.examples("test", 50):
        reward, comps = task.reward(e.meta["gold_completion"], e, REWARD_WEIGHTS["math"])
        assert comps == {k: 1.0 for k in REWARD_WEIGHTS["math"]} and reward == pytest.approx(total)
        assert "<<" not in e.meta["gold_completion"]


def test_gsm8k_number_normalisation(tasks):
    task = tasks["gsm8k"]
    raw = [json.loads(ln)["answer"].split("####")[-1].strip() for ln in open(task.source("test"))]
    exs = task.examples("test")
    i = next(i for i, a in enumerate(raw) if "," in a)
    e = exs[i]
    assert "," not in e.answer and e.answer == raw[i].replace(",", "")
    for written in (raw[i], f"${raw[i]}", f"{e.answer}.0", f"{e.answer}.", f"The total is {raw[i]} dollars"):
        assert task.correct(f"<reasoning>r</reasoning><answer>{written}</answer>", e), written
    assert not task.correct(f"<reasoning>r</reasoning><answer>{int(e.answer) + 1}</answer>", e)
    assert task.correct(f"<think>r</think><answer>{e.answer}</answer>", e)


def test_gsm_plus_critical_thinking(tasks):
    task = tasks["gsm_plus"]
    crit = [e for e in task.examples("test") if e.answer == "None"]
    assert len(crit) == 300 and all(e.meta["perturbation"] == "critical thinking" for e in crit)
    e = crit[0]
    assert task.correct("<reasoning>x</reasoning><answer>Cannot be determined.</answer>", e)
    assert not task.correct("<reasoning>x</reasoning><answer>12</answer>", e)
    only = get_task("gsm_plus", perturbation="digit expansion").examples("test")
    assert len(only) == 300 and {e.meta["perturbation"] for e in only} == {"digit expansion"}
    assert len(get_task("gsm_plus", include_critical=False).examples("test")) == 2100


# answers as they are written in MATH-500's own file, with equivalent forms a model may write
MATH_PAIRS = [("\\frac{14}{3}", "14/3"), ("\\dfrac{17}{50}", "0.34"), ("90^\\circ", "90"),
              ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("10,\\!080", "10080"),
              ("\\text{Evelyn}", "Evelyn"), ("\\frac43", "\\frac{4}{3}"), ("\\frac{1}{2}", "0.5"),
              ("\\frac{1}{2}", "\\frac12"), ("\\$32,\\!348", "32348"), ("864 \\mbox{ inches}^2", "864"),
              ("\\text{(C)}", "C"), ("x=5", "5"), ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
              ("5.4 \\text{ cents}", "5.4"), ("\\frac 59", "5/9"), ("11\\sqrt2", "11\\sqrt{2}"),
              ("1\\frac{4}{5}", "9/5"), (".0000672", "0.0000672"), ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),
              ("11,\\! 111,\\! 111,\\! 100", "11111111100"), ("\\$18.90", "18.9"), ("6 - 5i", "6-5i"),
              ("3, 5, 7", "7,5,3"), ("1 \\pm \\sqrt{19}", "1\\pm\\sqrt{19}")]


def test_math500_normaliser_on_file_answers(tasks):
    answers = {e.answer for e in tasks["math500"].examples("test")}
    for written_in_file, other in MATH_PAIRS:
        assert written_in_file in answers, written_in_file  # the pair is about the file's real answers
        assert equivalent(written_in_file, other) and equivalent(other, written_in_file), (written_in_file, other)
        assert equivalent(f"\\boxed{{{written_in_file}}}", other) and equivalent(f"${written_in_file}$", other)
    for a, b in [("\\frac{14}{3}", "\\frac{3}{14}"), ("90^\\circ", "45"), ("(3,4]", "[3,4]"), ("3, 5, 7", "3, 5"),
                 ("\\text{east}", "\\text{west}"), ("2k+2", "2k"), ("6 - 5i", "6+5i")]:
        assert not equivalent(a, b), (a, b)
    assert normalize("\\boxed{\\dfrac{1}{2}}") == normalize("$0.5$") == "1/2"
    assert equivalent("2^{10}", "1024") and equivalent("x^2+2x+1", "(x+1)^2")
    # answers whose symbolic check would never finish are refused, not evaluated
    for a, b in [("9^9^9^9", "1"), ("9^{9^{9}}", "3"), ("(a+b+c+d+e+f+g+h)^{99}", "x"), ("2^{999}", "1")]:
        assert not equivalent(a, b)


def test_math500_gold_full_shuffled_zero(tasks):
    task = tasks["math500"]
    exs = task.examples("test")
    assert len(exs) == 500
    for e in exs:
        for written in (e.answer, f"${e.answer}$", f"\\boxed{{{e.answer}}}"):
            assert task.correct(f"<reasoning>s</reasoning><answer>{written}</answer>", e), written
        assert task.correct(f"So the answer is $\\boxed{{{e.answer}}}$.", e)  # no tags: the last \boxed{}
    pairs = [(e, o) for e, o in _shuffled(exs)
             if re.sub(r"^[a-z]=|\s", "", o.answer) != re.sub(r"^[a-z]=|\s", "", e.answer)]
    assert len(pairs) > 480
    assert not [(e.answer, o.answer) for e, o in pairs if task.correct(o.meta["gold_completion"], e)]


@pytest.mark.parametrize("name", MCQ)
def test_mcq_gold_full_shuffled_zero(tasks, name):
    task = tasks[name]
    total = sum(REWARD_WEIGHTS["mcq"].values())
    for split in task.splits:
        exs = task.examples(split)
        for e in exs:
            reward, comps = task.reward(e.meta["gold_completion"], e, REWARD_WEIGHTS["mcq"])
            assert comps == {k: 1.0 for k in REWARD_WEIGHTS["mcq"]} and reward == pytest.approx(total), e.id
        pairs = _shuffled(exs)
        assert len(pairs) > 0.6 * len(exs)
        for e, o in pairs:
            comps = task.components(o.meta["gold_completion"], e)
            assert comps["correctness"] == 0.0 and not task.correct(o.meta["gold_completion"], e)
            assert comps["valid_option"] == (1.0 if o.answer in e.meta["labels"] else 0.0)


def test_mcq_counts_schemas_and_prompt(tasks):
    arc = tasks["arc"]
    assert [len(arc.examples(s)) for s in ("test", "test_ai2", "validation")] == [1172, 1150, 294]
    assert len(tasks["openbookqa"].examples("test")) == 500 and len(tasks["mmlu_stem"].examples("test")) == 3018
    ai2 = arc.examples("test_ai2")
    assert any(len(e.meta["labels"]) == 5 for e in ai2) and ai2[0].id.startswith(("Mercury", "MCAS", "NYSEDREGENTS",
                                                                                   "MDSA", "AKDE", "TIMSS", "ACTAAP",
                                                                                   "VASoL", "NCEOGA", "OHAT", "LEAP"))
    e = arc.examples("test")[0]
    assert not e.question.startswith("Question:")
    prompt = arc.prompt(e)
    for lab, opt in zip(e.meta["labels"], e.meta["options"], strict=True):
        assert f"\n{lab}. {opt}\n" in prompt
    assert "letter" in prompt
    assert len(get_task("mmlu_stem", subject="astronomy").examples("test")) == 152


def test_mcq_answer_forms():
    labels, options = ["A", "B", "C", "D"], ["red", "blue", "green", "a cat"]
    for written in ["B", "b", "(B)", "B.", "B) blue", "Answer: B", "The answer is B", "blue", " B "]:
        assert pick_option(written, labels, options) == "B", written
    for written in ["Z", "", "a cat sat", "maybe", None, "A B C D", "B or C", "(B), (C)"]:
        assert pick_option(written, labels, options) is None, written
    assert pick_option("a cat", labels, options) == "D"
    assert pick_option("D) a cat", labels, options) == "D"
    assert pick_option("B because it is blue", labels, options) == "B"


def test_mcq_hub_schema(tmp_path):
    rec = {"id": "x1", "question": "Which is blue?", "choices": {"text": ["sky", "grass"], "label": ["A", "B"]},
           "answerKey": "A"}
    f = tmp_path / "arc.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    e = get_task("arc", path=str(f)).examples("test")[0]
    assert (e.id, e.answer, e.meta["options"]) == ("x1", "A", ["sky", "grass"])


@pytest.fixture(scope="module")
def code_cases(tasks):
    out = {}
    for name, split in (("mbpp", "test"), ("humaneval", "test")):
        task = tasks[name]
        exs = task.examples(split, CODE_N)
        shuffled = [exs[(i + 1) % len(exs)].meta["gold_completion"] for i in range(len(exs))]
        gold = [e.meta["gold_completion"] for e in exs]
        comps = task.components_many(gold + shuffled, exs + exs)
        out[name] = (exs, comps[:len(exs)], comps[len(exs):])
    return out


@pytest.mark.parametrize("name", ["mbpp", "humaneval"])
def test_code_gold_passes_shuffled_fails(code_cases, name):
    exs, gold, shuffled = code_cases[name]
    assert len(exs) == CODE_N
    for e, c in zip(exs, gold, strict=True):
        assert c == {**{k: 1.0 for k in REWARD_WEIGHTS["code"]}, "code_blocked": 0.0}, (e.id, c)
    for e, c in zip(exs, shuffled, strict=True):
        assert c["correctness"] == 0.0, e.id


def test_code_blocked_marks_hacks_not_mistakes(tasks):
    # recorded unweighted (metrics: reward/code_blocked): a refused operation or non-plain data, not a wrong answer
    task = tasks["mbpp"]
    e = task.examples("test", 1)[0]  # remove_Occ
    wrap = "<reasoning>r</reasoning><answer>\n{}</answer>".format
    hacks = [wrap("class A:\n    def __eq__(self, o):\n        return True\ndef remove_Occ(s, ch):\n    return A()\n"),
             wrap("import os\ndef remove_Occ(s, ch):\n    os.kill(1, 9)\n    return s\n")]
    wrong = wrap("def remove_Occ(s, ch):\n    return s[::-1]\n")
    comps = task.components_many(hacks + [wrong, e.meta["gold_completion"]], [e] * 4)
    assert [c["code_blocked"] for c in comps] == [1.0, 1.0, 0.0, 0.0]
    assert [c["correctness"] for c in comps] == [0.0, 0.0, 0.0, 1.0]
    assert task.reward(hacks[0], e, REWARD_WEIGHTS["code"])[0] == task.reward(wrong, e, REWARD_WEIGHTS["code"])[0]


def test_mbpp_entry_points_include_builtin_names(tasks):
    e = next(x for x in tasks["mbpp"].examples("train") if x.id == "mbpp/601")
    assert e.meta["entry_points"] == ("Pair", "max_chain_length")
    e = next(x for x in tasks["mbpp"].examples("test") if x.id == "mbpp/126")
    assert e.meta["entry_points"] == ("sum",) and tasks["mbpp"].correct(e.meta["gold_completion"], e)


def test_mbpp_splits_by_task_id(tasks):
    task = tasks["mbpp"]
    sizes = {s: len(task.examples(s)) for s in ("prompt", "test", "validation", "train")}
    assert sizes == {"prompt": 10, "test": 500, "validation": 90, "train": 374}
    ids = [int(e.id.split("/")[1]) for e in task.examples("test")]
    assert min(ids) == 11 and max(ids) == 510
    e = task.examples("test")[0]
    prompt = task.prompt(e)
    assert e.question in prompt and e.meta["example_test"] in prompt and "<answer>" in prompt


def test_code_extraction_variants(tasks):
    task = tasks["mbpp"]
    e = task.examples("test", 1)[0]
    code = e.meta["gold_code"]
    forms = [f"<think>plan</think><answer>{code}</answer>",  # bare code in the answer tag
             f"<reasoning>plan</reasoning>\n```python\n{code}\n```",  # fenced, no answer tag
             f"<reasoning>plan</reasoning><answer>```py\n{code}```</answer>"]
    assert all(extract_code(f).strip() == code.strip() for f in forms)
    assert task.correct_many(forms, [e] * 3) == [True, True, True]
    assert extract_code("no code here") is None
    he = tasks["humaneval"].examples("test", 1)[0]
    body = he.meta["gold_code"][len(he.question):]
    assert tasks["humaneval"].correct(f"<answer>```python\n{body}```</answer>", he)  # a body alone is completed


def test_complexity_rule(tasks):
    e = tasks["mbpp"].examples("test", 1)[0]  # remove_Occ("hello","l") == "heo"
    assert complexity(e.meta["gold_code"], e.answer) == 1.0
    degenerate = ["", "def remove_Occ(s, ch):\n    pass\n", "def remove_Occ(s, ch):\n    '''doc'''\n    ...\n",
                  "def remove_Occ(s, ch):\n    return 'heo'\n", "def remove_Occ(s, ch):\n    return s\n",
                  "def remove_Occ(s, ch):\n    raise NotImplementedError\n", "x = 1\n", "def f(:\n",
                  "def remove_Occ(s, ch):\n    if s == 'hello':\n        return 'heo'\n"
                  "    if s == 'abcda':\n        return 'bcd'\n    return ''\n",
                  "def remove_Occ(s, ch):\n" + "    s = s.replace(ch, '')\n" * 12 + "    return s\n"]
    for code in degenerate:
        assert complexity(code, e.answer) == 0.0, code
    comps = tasks["mbpp"].components("<reasoning>r</reasoning><answer>def remove_Occ(s, ch):\n    pass\n</answer>", e)
    assert comps["syntax"] == 1.0 and comps["complexity"] == 0.0 and comps["correctness"] == 0.0


def test_jsonl_task(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"q": "2+2?", "a": "4"}, {"q": "Capital of France?", "a": "Paris"}]))
    task = get_task("jsonl", path=str(f), prompt_field="q", answer_field="a")
    exs = task.examples("train")
    assert [e.answer for e in exs] == ["4", "Paris"] and task.prompt(exs[0]).endswith("A: ")
    assert task.correct("<reasoning>r</reasoning><answer>4.0</answer>", exs[0])
    assert task.correct("<reasoning>r</reasoning><answer> paris. </answer>", exs[1])
    assert not task.correct("<reasoning>r</reasoning><answer>Lyon</answer>", exs[1])
    assert all(task.components(e.meta["gold_completion"], e)["correctness"] == 1.0 for e in exs)
    with pytest.raises(UserError, match="needs --path"):
        get_task("jsonl")
    with pytest.raises(UserError, match="expected fields"):
        get_task("jsonl", path=str(f)).examples("train")  # default fields prompt/answer are absent


def test_errors_are_one_line(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("MECHDIAG_SHARED", str(tmp_path))
    with pytest.raises(UserError, match=r"no data file at .*gsm8k.*--path") as err:
        get_task("gsm8k").examples("test")
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)
    monkeypatch.setenv("MECHDIAG_SHARED", str(data_dir.parent))
    with pytest.raises(UserError, match="not the gsm8k schema") as err:
        get_task("gsm8k", path=str(data_dir / "mbpp" / "mbpp.jsonl")).examples("test")
    assert "\n" not in str(err.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 3"}\n{oops\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not valid JSON"):
        get_task("gsm8k", path=str(bad)).examples("test")
    with pytest.raises(UserError, match="splits"):
        get_task("svamp").examples("train")
    with pytest.raises(UserError, match="no option"):
        get_task("gsm8k", difficulty=3)
    with pytest.raises(UserError, match="not found"):
        get_task("mbpp", path=str(tmp_path / "missing.jsonl")).examples("test")
    noans = tmp_path / "noans.jsonl"
    noans.write_text('{"question": "q", "answer": "no final number"}\n')
    with pytest.raises(UserError, match="record 1"):
        get_task("gsm8k", path=str(noans)).examples("test")


def test_prompt_uses_chat_template(tasks):
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(m["role"] + ":" + m["content"] for m in messages) + "|assistant:"

    for name in ("gsm8k", "arc", "mbpp"):
        task = tasks[name]
        e = task.examples(task.splits[0], 1)[0]
        p = task.prompt(e, Tok())
        assert p.startswith("system:") and p.endswith("|assistant:") and e.question in p
        assert task.prompt(e).startswith("Q: ")


def test_sampling_is_deterministic(tasks):
    task = tasks["gsm8k"]
    assert [e.id for e in task.examples("test", 5)] == [f"test-{i}" for i in range(5)]
    a, b = task.examples("train", 20, seed=7), task.examples("train", 20, seed=7)
    assert [e.id for e in a] == [e.id for e in b] != [e.id for e in task.examples("train", 20, seed=8)]


def test_dataset_names_go_through_datasets(monkeypatch):
    """hf:NAME[:CONFIG] (or a bare owner/name) is read with datasets.load_dataset; faked here (no network)."""
    import sys
    import types

    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "cais/mmlu":
            return [{"question": "2+2?", "subject": "college_mathematics", "choices": ["3", "4"], "answer": 1},
                    {"question": "Capital?", "subject": "world_religions", "choices": ["a", "b"], "answer": 0}]
        return [{"question": "Tom has 2 apples and gets 3. How many?", "answer": "2+3=5\n#### 5"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    exs = get_task("gsm8k", path="hf:openai/gsm8k:main").examples("train")
    assert calls[-1] == ("openai/gsm8k", "main", "train") and exs[0].answer == "5"
    get_task("gsm8k", path="openai/gsm8k:main").examples("test")
    assert calls[-1] == ("openai/gsm8k", "main", "test")
    mm = get_task("mmlu_stem", path="hf:cais/mmlu:all").examples("test")
    assert [e.answer for e in mm] == ["B"]  # the non-STEM subject is left out
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(UserError, match="needs the `datasets` package"):
        get_task("gsm8k", path="hf:openai/gsm8k").examples("test")
