"""jsonl: the user's own prompt/answer file (fields configurable, default "prompt"/"answer").

`--path FILE` serves whichever split is asked; `--path DIR` reads DIR/<split>.jsonl. Numeric answers score with
the Table 6 math components; a non-numeric gold is matched as text (case, spacing and a final period ignored).
"""

from __future__ import annotations

import re
from pathlib import Path

from mechdiag.errors import UserError
from mechdiag.tasks.base import Example, format_prompt
from mechdiag.tasks.data import FileTask
from mechdiag.tasks.rewards import answer_number, extract_answer, math_components, numbers_equal, parse_number


def _text(s: str | None) -> str:
    return re.sub(r"\s+", " ", (s or "").strip().rstrip(".").casefold())


class Jsonl(FileTask):
    name = "jsonl"
    domain = "math"

    def option_names(self):
        return ("prompt_field", "answer_field")

    def __init__(self, path=None, **options):
        super().__init__(path, **options)
        if path is None:
            raise UserError("task jsonl needs --path FILE.jsonl (one JSON object per line with prompt/answer fields)")
        self.prompt_field = str(options.get("prompt_field", "prompt"))
        self.answer_field = str(options.get("answer_field", "answer"))
        self.schemas = [(self.prompt_field, self.answer_field)]

    @property
    def splits(self):
        return ("train", "test", "validation")

    def source(self, split):
        if self.path.startswith("hf:"):
            return self.path
        p = Path(self.path).expanduser()
        if p.is_dir():
            p = p / f"{split}.jsonl"
        if not p.is_file():
            raise UserError(f"task jsonl: data file not found: {p}")
        return str(p)

    def make_example(self, rec, index, split):
        answer = rec[self.answer_field]
        if answer is None or not str(rec[self.prompt_field]).strip():
            raise ValueError("empty prompt or answer")
        ans = str(answer).strip()
        return Example(id=str(rec.get("id", f"{split}-{index}")), question=str(rec[self.prompt_field]).strip(),
                       answer=ans, meta={"gold_completion": f"<reasoning>Answer.</reasoning><answer>{ans}</answer>"})

    def prompt(self, example: Example, tokenizer=None) -> str:
        return format_prompt(example.question, tokenizer)

    def _numeric(self, example: Example) -> bool:
        return parse_number(example.answer) is not None

    def correct(self, completion, example):
        if self._numeric(example):
            return numbers_equal(answer_number(completion), parse_number(example.answer))
        block = extract_answer(completion)
        return block is not None and _text(block) == _text(example.answer)

    def components(self, completion, example):
        comps = math_components(completion, example.answer)
        if not self._numeric(example):
            hit = self.correct(completion, example)
            comps["correctness"] = comps["numeric"] = 1.0 if hit else 0.0
        return comps
