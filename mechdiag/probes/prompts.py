"""Probe sets: prompts from a file or a task, tokenised once so both models see identical token ids."""

from __future__ import annotations

import json
from pathlib import Path

from mechdiag.errors import UserError
from mechdiag.models import context_length
from mechdiag.tasks import get_task

NO_LIMIT = 1_000_000  # tokenizers without a limit report model_max_length ~1e30


def read_prompts(path: str | Path, n: int | None = None) -> list[str]:
    """A .jsonl file with a "prompt" field per line, or plain text with one prompt per line (blank lines skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"probe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read probe file {path}: {e}") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise UserError(f"probe file {path} has no prompts")
    if path.suffix == ".jsonl" or lines[0].lstrip().startswith("{"):
        prompts = []
        for i, ln in enumerate(lines, 1):
            try:
                rec = json.loads(ln)
            except ValueError:
                raise UserError(f"{path}: line {i} is not JSON (use a \"prompt\" field per line)") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise UserError(f"{path}: line {i} has no string \"prompt\" field")
            prompts.append(rec["prompt"])
    else:
        prompts = lines
    return prompts[:n] if n else prompts


def task_prompts(name: str, tokenizer, split: str = "test", n: int | None = None) -> list[str]:
    """Prompts of a registered task, formatted exactly as in training (task.prompt, chat template included)."""

    task = get_task(name)
    examples = task.examples(split, n)
    if not examples:
        raise UserError(f"task {name!r} split {split!r} has no examples")
    return [task.prompt(ex, tokenizer) for ex in examples]


def max_length_of(tokenizer, config) -> int:
    """The longest prompt shift reads: the model's context (models.context_length) or the tokenizer's limit."""
    limits = [context_length(config), getattr(tokenizer, "model_max_length", None)]
    limits = [int(x) for x in limits if isinstance(x, (int, float)) and 0 < x < NO_LIMIT]
    return min(limits) if limits else 2048


def encode(tokenizer, prompts: list[str], max_length: int) -> tuple[list[list[int]], int]:
    """Token ids per prompt, cut to max_length; returns (ids, number truncated).

    A prompt that already starts with the BOS text (a chat template wrote it) gets no second BOS.
    """
    bos = tokenizer.bos_token
    seqs, truncated = [], 0
    for p in prompts:
        ids = tokenizer(p, add_special_tokens=not (bos and p.startswith(bos)))["input_ids"]
        if len(ids) > max_length:
            ids, truncated = ids[:max_length], truncated + 1
        seqs.append(list(ids))
    return seqs, truncated
