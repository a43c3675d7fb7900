"""Tasks: registry by name. `get_task(name, path=None, **options)` returns a Task."""

from __future__ import annotations

import difflib
import importlib

from mechdiag.errors import UserError
from mechdiag.tasks.base import Example, Task

REGISTRY: dict[str, str] = {  # name -> "module:Class"
    "arith": "mechdiag.tasks.arith:Arith",
    "gsm8k": "mechdiag.tasks.math_tasks:GSM8K",
    "gsm_plus": "mechdiag.tasks.math_tasks:GSMPlus",
    "gsm_hard": "mechdiag.tasks.math_tasks:GSMHard",
    "svamp": "mechdiag.tasks.math_tasks:SVAMP",
    "math500": "mechdiag.tasks.math_tasks:MATH500",
    "arc": "mechdiag.tasks.mcq:ARC",
    "openbookqa": "mechdiag.tasks.mcq:OpenBookQA",
    "mmlu_stem": "mechdiag.tasks.mcq:MMLUStem",
    "mbpp": "mechdiag.tasks.code:MBPP",
    "humaneval": "mechdiag.tasks.code:HumanEval",
    "jsonl": "mechdiag.tasks.jsonl:Jsonl",
}


def register(name: str, target: str) -> None:
    REGISTRY[name] = target


def get_task(name: str, path: str | None = None, **options) -> Task:

    target = REGISTRY.get(name) or (name if ":" in name else None)  # a user task class "package.module:Class"
    if target is None:
        near = difflib.get_close_matches(name, REGISTRY, n=1)
        raise UserError(f"unknown task {name!r}" + (f" (did you mean {near[0]}?)" if near else "")
                        + f"; known: {', '.join(sorted(REGISTRY))}")
    mod, cls = target.split(":", 1)
    try:
        task_cls = getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise UserError(f"task {name!r}: cannot load it ({e})") from None
    return task_cls(path=path, **options)


__all__ = ["Example", "Task", "get_task", "register", "REGISTRY"]
