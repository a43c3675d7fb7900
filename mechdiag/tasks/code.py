"""Code benchmarks: MBPP and HumanEval, rewarded by running the tests in mechdiag.sandbox.

The completion's code is the <answer> block (a fenced ```python block inside it is unwrapped); without an answer
tag, the last fenced block of the completion. Components (Table 6, code), each in [0, 1]:
- correctness: every test passes: the verdict of the sandbox's judge (see mechdiag/sandbox.py);
- complexity: 1 unless the code is degenerate (see `complexity`);
- xml_count: a quarter per reasoning/answer tag present exactly once;
- syntax: the code is non-empty and ast.parse accepts it;
- reasoning_nonempty: the reasoning (or <think>) block has text.
Not paid (no weight), recorded so hacking attempts show on the curves (metrics: reward/code_blocked):
- code_blocked: 1 when the sandbox refused an operation of the program or it returned non-plain data.
"""

from __future__ import annotations

import ast
import hashlib
import re
import warnings
from collections import OrderedDict

from mechdiag.sandbox import SandboxResult, run_many, run_tests
from mechdiag.tasks.base import Example, format_prompt
from mechdiag.tasks.data import FileTask
from mechdiag.tasks.rewards import capped, extract_answer, extract_reasoning, nonempty, xml_count

CODE_SYSTEM = ("Think step by step inside <reasoning>...</reasoning>, then give only the Python code inside "
               "<answer>...</answer>.")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n?(.*?)(?:```|\Z)", re.S | re.I)


def extract_code(completion: str, answer_tag: str = "answer") -> str | None:
    """Code from the answer block (fences unwrapped), else from the last fenced block; None if neither. Linear in
    the completion, which is cut to MAX_COMPLETION_CHARS first."""
    completion = capped(completion)
    block = extract_answer(completion, answer_tag)
    if block is not None:
        fenced = _FENCE.search(block)
        return (fenced.group(1) if fenced else block).strip("\n")
    fences = _FENCE.findall(completion)
    return fences[-1].strip("\n") if fences else None


def _parse(code: str) -> ast.Module:
    with warnings.catch_warnings():  # model code is full of "invalid escape sequence" SyntaxWarnings
        warnings.simplefilter("ignore")
        return ast.parse(code)


def parses(code: str | None) -> bool:
    if not code or not code.strip():
        return False
    try:
        _parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO


_NO = object()


def expected_cases(tests: str) -> list[tuple[list, object]]:
    """(literal call arguments, literal expected value) of each `assert f(args) == value` in the tests."""
    try:
        tree = _parse(tests)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
                and isinstance(node.test.ops[0], ast.Eq):
            left, right = node.test.left, node.test.comparators[0]
            if not isinstance(left, ast.Call):
                left, right = right, left
            value = _literal(right)
            if value is _NO:
                continue
            args = [_literal(a) for a in left.args] if isinstance(left, ast.Call) else []
            out.append(([a for a in args if a is not _NO], value))
    return out


def _distinctive(v) -> bool:
    """Values a real solution is unlikely to write literally: not bools/None/small ints/short strings/empties."""
    if v is None or isinstance(v, bool):
        return False
    if isinstance(v, int):
        return abs(v) > 2
    if isinstance(v, float):
        return v not in (0.0, 1.0, -1.0)
    if isinstance(v, str):
        return len(v) > 1
    if isinstance(v, (list, tuple, set, frozenset, dict)):
        return len(v) > 0
    return True


def _trivial_body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # docstring
    if not body:
        return True
    if all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body):
        return True
    if len(body) == 1:
        s = body[0]
        if isinstance(s, ast.Raise):
            return True
        if isinstance(s, ast.Return):
            args = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
            v = s.value
            return v is None or _literal(v) is not _NO or (isinstance(v, ast.Name) and v.id in args)
    return False


def complexity(code: str | None, tests: str = "") -> float:
    """1.0 unless the code is degenerate, then 0.0. Degenerate means any of:
    (a) empty or not parseable; (b) no function defined, or every function is trivial: only a docstring,
    `pass`, `...`, a `raise`, or a single `return` of a constant / literal / one of its own arguments;
    (c) hard-coding: for at least half (and at least one) of the tests `assert f(A..) == V` with a distinctive V
    (not a bool/None/|int|<=2/one-char string/empty container), both V and a distinctive argument A appear as
    literals in the code (an input -> output table); (d) repetition: 8+ non-blank lines, under 40% distinct."""
    if not parses(code):
        return 0.0
    tree = _parse(code)
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not funcs or all(_trivial_body(f) for f in funcs):
        return 0.0
    cases = [(args, v) for args, v in expected_cases(tests) if _distinctive(v)]
    if cases:
        literals = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict)):
                v = _literal(node)
                if v is not _NO:
                    literals.append(v)

        def present(w) -> bool:
            return any(type(lit) is type(w) and lit == w for lit in literals)

        hits = sum(1 for args, v in cases if present(v) and any(_distinctive(a) and present(a) for a in args))
        if hits and hits * 2 >= len(cases):
            return 0.0
    lines = [ln.strip() for ln in code.splitlines() if ln.strip()]
    if len(lines) >= 8 and len(set(lines)) < 0.4 * len(lines):
        return 0.0
    return 1.0


def code_components(completion: str, result: SandboxResult | None, tests: str,
                    code: str | None = None) -> dict[str, float]:
    """Table 6, code. `result` is the sandbox run of the program (None when there was none to run); `code` is
    the program run (default: the code extracted from the completion). Syntax is judged on the program,
    complexity on the written code (on the program when the written code is a bare body)."""
    written = extract_code(completion)
    program = written if code is None else code
    return {
        "correctness": 1.0 if result is not None and result.passed else 0.0,
        "complexity": complexity(written if parses(written) else program, tests),
        "xml_count": xml_count(completion),
        "syntax": 1.0 if parses(program) else 0.0,
        "reasoning_nonempty": nonempty(extract_reasoning(completion)),
        "code_blocked": 1.0 if result is not None and result.blocked else 0.0,
    }


class CodeTask(FileTask):
    """Shared by MBPP and HumanEval: a program is `program(code, example)`, run against example.answer (tests)."""

    domain = "code"
    votable = False  # programs have no answer to vote on

    def answer_key(self, completion: str, example: Example):
        return None
    # CPU seconds per program: MBPP 123's gold needs 4.5-5.7 s of CPU on the machines seen (docs/reliability.md)
    timeout_s = 10.0
    memory_mb = 512
    workers = 0  # sandboxes side by side; 0: one per core

    def option_names(self):
        return ("timeout_s", "memory_mb", "workers")

    def __init__(self, path=None, **options):
        super().__init__(path, **options)
        self.timeout_s = float(options.get("timeout_s", self.timeout_s))
        self.memory_mb = int(options.get("memory_mb", self.memory_mb))
        self.workers = int(options.get("workers", self.workers))  # 0: run_many's one per core
        self._results: OrderedDict[str, SandboxResult] = OrderedDict()  # a group often repeats a completion

    def program(self, code: str, example: Example) -> str:
        return code

    def _run(self, jobs: list[tuple[str, str, tuple[str, ...]]]) -> list[SandboxResult]:
        keys = [hashlib.sha1("\0".join((c, t, *names)).encode()).hexdigest() for c, t, names in jobs]
        todo = {k: j for k, j in zip(keys, jobs, strict=True) if k not in self._results}
        if todo:
            got = run_many(list(todo.values()), workers=self.workers, timeout_s=self.timeout_s,
                           memory_mb=self.memory_mb)
            for k, r in zip(todo, got, strict=True):
                self._results[k] = r
                if len(self._results) > 4096:
                    self._results.popitem(last=False)
        return [self._results[k] for k in keys]

    def programs(self, completions: list[str], examples: list[Example]) -> list[str | None]:
        codes = [extract_code(c) for c in completions]
        return [None if c is None else self.program(c, e) for c, e in zip(codes, examples, strict=True)]

    def run_completions(self, completions: list[str], examples: list[Example]) -> list[SandboxResult | None]:
        """Sandbox runs for many completions at once (None where there is no parseable code)."""
        progs = self.programs(completions, examples)
        idx = [i for i, p in enumerate(progs) if parses(p)]
        results: list[SandboxResult | None] = [None] * len(completions)
        jobs = [(progs[i], examples[i].answer, tuple(examples[i].meta.get("entry_points", ()))) for i in idx]
        for i, r in zip(idx, self._run(jobs), strict=True):
            results[i] = r
        return results

    def components_many(self, completions: list[str], examples: list[Example]) -> list[dict[str, float]]:
        progs = self.programs(completions, examples)
        results = self.run_completions(completions, examples)
        return [code_components(c, r, e.answer, p)
                for c, r, e, p in zip(completions, results, examples, progs, strict=True)]

    def components(self, completion: str, example: Example) -> dict[str, float]:
        return self.components_many([completion], [example])[0]

    def correct(self, completion: str, example: Example) -> bool:
        r = self.run_completions([completion], [example])[0]
        return r is not None and r.passed

    def correct_many(self, completions: list[str], examples: list[Example]) -> list[bool]:
        return [r is not None and r.passed for r in self.run_completions(completions, examples)]


def entry_points(gold_code: str, tests: str) -> tuple[str, ...]:
    """The functions and classes the gold code defines that the tests use: the names the sandbox's judge takes
    from the solution even where they shadow a builtin (MBPP 126 defines `sum`)."""
    try:
        defined = {n.name for n in _parse(gold_code).body if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                                             ast.AsyncFunctionDef))}
        used = {n.id for n in ast.walk(_parse(tests)) if isinstance(n, ast.Name)}
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return ()
    return tuple(sorted(defined & used))


def task_helpers(prompt: str, entry: str) -> str:
    """The prompt without the definition of `entry` (the function the model writes): its imports and helper
    functions, run by the judge before the tests (trusted text from the data set); "" if it does not parse."""
    try:
        tree = _parse(prompt)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return ""
    lines = prompt.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines[first - 1:node.end_lineno] = [""] * (node.end_lineno - first + 1)
    text = "".join(lines)
    return text if text.endswith("\n") or not text else text + "\n"


def gold_code_completion(code: str) -> str:
    return f"<reasoning>Write the function.</reasoning><answer>\n```python\n{code}\n```\n</answer>"


class MBPP(CodeTask):
    """MBPP full set; splits by task_id: prompt 1-10, test 11-510, validation 511-600, train 601-974."""

    name = "mbpp"
    RANGES = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}
    files = {s: ("mbpp", "mbpp.jsonl") for s in RANGES}
    schemas = [("text", "code", "task_id", "test_list")]
    hub = "google-research-datasets/mbpp:full"

    def make_example(self, rec, index, split):
        tid = int(rec["task_id"])
        lo, hi = self.RANGES[split]
        if not lo <= tid <= hi:
            return None
        tests = [str(t) for t in rec["test_list"]]
        setup = str(rec.get("test_setup_code") or "")
        answer = (setup + "\n" if setup else "") + "\n".join(tests) + "\n"
        return Example(id=f"mbpp/{tid}", question=str(rec["text"]).strip(), answer=answer,
                       meta={"example_test": tests[0], "gold_code": rec["code"],
                             "gold_completion": gold_code_completion(rec["code"]),
                             "entry_points": entry_points(rec["code"], answer)})

    def prompt(self, example, tokenizer=None):
        text = (f"{example.question}\nYour code should pass this test:\n{example.meta['example_test']}\n"
                "Write the Python function inside <answer>...</answer>.")
        return format_prompt(text, tokenizer, system=CODE_SYSTEM)


class HumanEval(CodeTask):
    """OpenAI HumanEval. The model writes the whole function (run after the prompt, so the prompt's imports and
    helper functions exist); a bare body is appended to the prompt instead."""

    name = "humaneval"
    files = {"test": ("humaneval", "HumanEval.jsonl.gz")}
    schemas = [("task_id", "prompt", "entry_point", "test")]
    hub = "openai/openai_humaneval"

    def make_example(self, rec, index, split):
        entry = str(rec["entry_point"])
        gold = rec["prompt"] + rec.get("canonical_solution", "")
        # the tests run after the prompt's own helpers (HumanEval/32's poly, /38's encode_cyclic): the names the
        # tests call that the task defines are the task's, never a completion's redefinition of them
        return Example(id=str(rec["task_id"]), question=rec["prompt"],
                       answer=f"{task_helpers(rec['prompt'], entry)}{rec['test']}\n\ncheck({entry})\n",
                       meta={"entry_point": entry, "gold_code": gold, "gold_completion": gold_code_completion(gold),
                             "entry_points": (entry,)})

    def program(self, code, example):
        entry = example.meta["entry_point"]
        # [ \t], not \s: `^\s*` under re.M spans lines, quadratic in a run of blank lines
        if re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry)}[ \t]*\(", code, re.M):
            # the prompt (imports, helpers, the docstring-only stub) first; the model's definition replaces the stub
            return example.question + "\n" + code
        return example.question + code  # a completion of the body

    def prompt(self, example, tokenizer=None):
        text = (f"Complete this Python function:\n```python\n{example.question}```\n"
                "Write the whole function inside <answer>...</answer>.")
        return format_prompt(text, tokenizer, system=CODE_SYSTEM)


__all__ = ["MBPP", "HumanEval", "extract_code", "complexity", "code_components", "run_tests"]
