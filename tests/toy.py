"""Test helpers for the trainer: a toy task with a dense reward, and hooks that crash or count."""

from __future__ import annotations

import os
import signal

from mechdiag.tasks.base import Example, Task


class Toy(Task):
    """Reward = share of the letter 'a' in the completion: dense, so every group has a gradient."""

    name = "toy"

    def __init__(self, path=None):
        pass

    def examples(self, split="train", n=None, seed=0):
        n = 64 if n is None else n
        return [Example(id=f"{split}-{i}", question=f"Tell a story number {i}.", answer="a") for i in range(n)]

    def prompt(self, example, tokenizer=None):
        return f"Once upon a time, {example.question}"

    def components(self, completion, example):
        letters = [c for c in completion.lower() if c.isalpha()]
        return {"correctness": (letters.count("a") / len(letters)) if letters else 0.0}

    def correct(self, completion, example):
        return self.components(completion, example)["correctness"] > 0.1


class KillAt:
    """kill -9 this process right after step N has been recorded (simulates a crash)."""

    def __init__(self, step):
        self.step = step

    def on_weights(self, rec, step, model, last):  # step N's records written, before its checkpoint
        if step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_at_3(trainer):
    return KillAt(3)


class Half(Toy):
    """Every other prompt gets a constant reward: its group has zero advantage."""

    def components(self, completion, example):
        if int(example.id.split("-")[1]) % 2:
            return {"correctness": 0.5}
        return super().components(completion, example)


class Flat(Toy):
    """Every completion scores 0: every group has zero std, advantages are 0, and LoRA B never leaves zero."""

    def components(self, completion, example):
        return {"correctness": 0.0}

    def correct(self, completion, example):
        return False


class Shaped(Toy):
    """Correctness is always 0 and a format term pays for the letter 'a': every group with spread is shaping only."""

    def components(self, completion, example):
        return {"correctness": 0.0, "format": super().components(completion, example)["correctness"]}

    def correct(self, completion, example):
        return False
