"""Tasks: registry by name. `get_task(name, path=None, **options)` returns a Task."""

from __future__ import annotations

import difflib

from mechdiag.config import Config, load_object
from mechdiag.errors import UserError
from mechdiag.tasks.base import Example, Task
from mechdiag.tasks.rewards import RANDOM

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


def task_class(name: str) -> type[Task]:
    """The class of a registered task, or of a user task given as "package.module:Class" (not instantiated)."""

    target = REGISTRY.get(name) or (name if ":" in name else None)  # a user task class "package.module:Class"
    if target is None:
        near = difflib.get_close_matches(name, REGISTRY, n=1)
        raise UserError(f"unknown task {name!r}" + (f" (did you mean {near[0]}?)" if near else "")
                        + f"; known: {', '.join(sorted(REGISTRY))}")
    return load_object(target, "task", "Class")


def get_task(name: str, path: str | None = None, **options) -> Task:
    return task_class(name)(path=path, **options)


# ---- reward weights (Table 6) ------------------------------------------------------------------------------
def _task_classes(cfg: Config) -> list[type[Task]]:
    return [task_class(cfg.task.name)] + [task_class(s.name) for s in cfg.task.mixture]


def reward_weights(cfg: Config) -> dict[str, float]:
    """The weights a run of cfg uses: rewards.weights when set, else the study's weights of its task; components
    of mixed-in tasks of another domain come along (the main task's weight wins where both score one)."""
    if cfg.rewards.weights is not None:
        out = dict(cfg.rewards.weights)
    else:
        out = {}
        for cls in reversed(_task_classes(cfg)):
            out.update(cls.reward_weights())
    if cfg.rewards.control == "random":  # the control pays the coin alone; the task's components are logged
        out = {k: 0.0 for k in out if k != RANDOM} | {RANDOM: 1.0}
    return out


def check_reward_weights(cfg: Config) -> None:
    """Every name in rewards.weights must be a component the task (or a mixed-in task) scores: a misspelt name
    would silently weigh nothing. Raises UserError with the nearest name."""
    known: dict[str, None] = {}
    for cls in _task_classes(cfg):
        known.update(dict.fromkeys(cls.reward_weights()))
    if cfg.rewards.control == "random":
        known[RANDOM] = None
    for name in cfg.rewards.weights or {}:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            raise UserError(f"unknown reward component {name!r} in rewards.weights for task {cfg.task.name}"
                            + (f" (did you mean {near[0]}?)" if near else "") + f"; known: {', '.join(known)}")


def resolve_rewards(cfg: Config) -> Config:
    """cfg, checked, with rewards.weights filled in (in place) so the config a run saves shows what ran."""
    check_reward_weights(cfg)
    cfg.rewards.weights = reward_weights(cfg)
    return cfg


__all__ = ["Example", "Task", "check_reward_weights", "get_task", "register", "resolve_rewards", "reward_weights",
           "task_class", "REGISTRY"]
