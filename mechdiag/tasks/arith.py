"""arith: synthetic multi-step integer arithmetic word problems, the embedded default's task.

Splits are deterministic and disjoint: a problem belongs to `test` iff a hash of its text falls in one bucket
of ten, and `train` rejects that bucket. The out-of-distribution splits are the analogue of the study's OOD
benchmarks: `ood_steps` needs two more steps, `ood_numbers` uses numbers five times larger.

A gold completion reads `<reasoning>12+7=19;19-5=14</reasoning><answer>14</answer>`.
"""

from __future__ import annotations

import hashlib
import random

from mechdiag.errors import UserError
from mechdiag.tasks.base import Example, Task, format_prompt
from mechdiag.tasks.math_tasks import NumericScoring

NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Kim", "Lu", "Max", "Ned", "Ola", "Pam"]
ITEMS = ["apples", "pens", "coins", "cards", "books", "eggs", "toys", "shells", "stamps", "beads"]
# (difficulty) -> (min steps, max steps, max number)
LEVELS = {1: (1, 2, 9), 2: (2, 3, 20), 3: (2, 4, 50), 4: (3, 5, 99)}
SPLITS = ("train", "test", "ood_steps", "ood_numbers")


def _bucket(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest(), 16) % 10


def make_problem(rng: random.Random, steps: int, max_number: int) -> tuple[str, str, int]:
    """One word problem: (question, gold reasoning, answer). Intermediate values stay non-negative."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(1, max_number)
    sentences = [f"{name} has {value} {item}."]
    work = []
    for _ in range(steps):
        op = rng.choice("+-+-*") if value <= max_number else "-"
        if op == "*" and value * 2 > 4 * max_number:
            op = "-"
        if op == "-" and value == 0:
            op = "+"
        if op == "+":
            n = rng.randint(1, max_number)
            sentences.append(rng.choice([f"{name} gets {n} more.", f"{name} finds {n} more."]))
            new = value + n
        elif op == "-":
            n = rng.randint(1, value)
            sentences.append(rng.choice([f"{name} gives away {n}.", f"{name} loses {n}."]))
            new = value - n
        else:
            n = rng.randint(2, 3)
            sentences.append(f"{name} ends up with {'twice' if n == 2 else 'three times'} as many.")
        new = value * n if op == "*" else new
        work.append(f"{value}{op}{n}={new}")
        value = new
    sentences.append(f"How many {item} does {name} have?")
    return " ".join(sentences), ";".join(work), value


def gold_completion(reasoning: str, answer) -> str:
    return f"<reasoning>{reasoning}</reasoning><answer>{answer}</answer>"


class Arith(NumericScoring, Task):
    name = "arith"

    def __init__(self, path: str | None = None, difficulty: int = 2, steps: list[int] | None = None,
                 max_number: int | None = None, seed: int = 0, shots: int = 0, prefill: str = ""):
        if path is not None:
            raise UserError("task arith is generated; it takes no path")
        if difficulty not in LEVELS:
            raise UserError(f"arith difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}")
        lo, hi, mx = LEVELS[difficulty]
        if steps is not None:
            lo, hi = int(steps[0]), int(steps[-1])
        self.steps = (lo, hi)
        self.max_number = int(max_number or mx)
        self.seed = seed
        if not (1 <= lo <= hi) or self.max_number < 2:
            raise UserError("arith needs 1 <= steps and max_number >= 2")
        if not (isinstance(shots, int) and 0 <= shots <= 8):
            raise UserError(f"arith shots must be an integer from 0 to 8, got {shots!r}")
        # worked examples shown before each question (a small model that ignores the system prompt's format copies
        # them), from the train split (never a test problem); prefill: the text the answer starts with
        self.shots = [(e.question, e.meta["gold_completion"]) for e in self.examples("train", shots, seed=1)]
        self.prefill = str(prefill)

    def prompt(self, example: Example, tokenizer=None) -> str:
        return format_prompt(example.question, tokenizer, shots=self.shots, prefill=self.prefill)

    def examples(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Example]:
        if split not in SPLITS:
            raise UserError(f"arith has splits {', '.join(SPLITS)}; got {split!r}")
        n = 1000 if n is None else n
        lo, hi, mx = *self.steps, self.max_number
        if split == "ood_steps":
            lo, hi = hi + 1, hi + 2
        elif split == "ood_numbers":
            mx = mx * 5
        rng = random.Random(f"arith/{split}/{self.seed}/{seed}/{lo}-{hi}/{mx}")
        out, seen = [], set()
        while len(out) < n:
            q, work, ans = make_problem(rng, rng.randint(lo, hi), mx)
            in_test = _bucket(q) == 0
            if q in seen or (split == "train" and in_test) or (split == "test" and not in_test):
                continue
            seen.add(q)
            out.append(Example(id=f"{split}-{len(out)}", question=q, answer=str(ans),
                               meta={"reasoning": work, "gold_completion": gold_completion(work, ans)}))
        return out


# ---- the bundled base's tokenizer (scripts/make_base.py): the arith vocabulary as whole-word tokens -------------
TAGS = ["<reasoning>", "</reasoning>", "<answer>", "</answer>"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = ("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
         " \n.,:;?!+-*/=()$%'\"<>")
# Whole-word tokens for the arith vocabulary (bare and with a leading space): prompts shrink ~3x, which makes
# pre-training and GRPO rollouts faster. Everything else, digits included, stays one token per character.
TEMPLATE_WORDS = ["has", "gets", "finds", "more", "gives", "away", "loses", "ends", "up", "with", "twice", "three",
                  "times", "as", "many", "How", "does", "have"]


def word_list() -> list[str]:
    return list(dict.fromkeys(TEMPLATE_WORDS + NAMES + ITEMS))


def build_char_tokenizer():
    """The bundled tokenizer: one token per character, the four tags and the arith words as single tokens.

    BOS is added in front of every encoded text (training and inference alike); EOS ends a completion.

    Built with the `tokenizers` library and wrapped in PreTrainedTokenizerFast, which reloads with identical ids
    (AutoTokenizer for some model types swaps the pre-tokenizer on reload).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415 - only scripts/make_base.py builds this tokenizer
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - only scripts/make_base.py builds this tokenizer

    words = sorted(word_list(), key=len, reverse=True)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for t in [*CHARS, *words, *(" " + w for w in words)]:
        vocab.setdefault(t, len(vocab))
    # Pre-tokens: a known whole word (with its leading space), else a single character; unknown -> <unk>.
    pattern = r" ?(?<![A-Za-z])(?:" + "|".join(words) + r")(?![A-Za-z])|[\s\S]"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False) for t in TAGS])
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", padding_side="left", clean_up_tokenization_spaces=False,
                                   model_max_length=512)
