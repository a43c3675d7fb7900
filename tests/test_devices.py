"""Devices and precision of the native trainer: device resolution (one function, mechdiag.models.resolve_device),
a device that is not here refused before any heavy work, bfloat16 end to end with float32 log-probs and loss,
and gradient checkpointing (the same loss and gradient)."""

from __future__ import annotations

import pytest
import torch

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.models import resolve_device
from mechdiag.train.trainer import Trainer
from tests.helpers import assert_bad_input

torch.set_num_threads(1)


def small(model_dir, *extra) -> list[str]:
    return [f"model.name_or_path={model_dir}", "task.name=tests.toy:Toy", "group_size=4", "prompts_per_step=2",
            "max_completion_tokens=12", "max_prompt_tokens=32", "eval_n=8", "threads=1", "learning_rate=0.01",
            "record.shift_at_eval=false", "save_every=0", *extra]


def test_resolve_device_here():
    auto = torch.device("cuda", 0) if torch.cuda.is_available() else resolve_device("cpu")
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        auto = torch.device("mps")
    assert resolve_device("auto") == auto and resolve_device(None) == auto
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device(" CPU ") == torch.device("cpu")
    for bad in ("tpu", "cuda:x", "gpu0", ""):
        with pytest.raises(UserError, match="not a device|not supported"):
            resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("args", [
    ["train", "--device", "cuda", "--max-steps", "1"],
    ["train", "--device", "cuda:1", "--backend", "trl", "--max-steps", "1"],
    ["train", "--set", "device=mps", "--dry-run"],
    ["train", "--device", "tpu"],
])
def test_train_refuses_a_missing_device_before_work(args, cli, tmp_path):
    p = cli(*args, "--out", str(tmp_path / "run"))
    assert_bad_input(p)
    assert "device" in p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_shift_and_eval_refuse_a_missing_device(stories260k, cli, tmp_path):
    p = cli("shift", stories260k, stories260k, "--task", "arith", "--n", "2", "--device", "cuda:0")
    assert_bad_input(p)
    assert "CUDA" in p.stderr
    p = cli("eval", stories260k, "--task", "arith", "--n", "2", "--device", "cuda",
            "--out", str(tmp_path / "ev"))
    assert_bad_input(p)
    assert "CUDA" in p.stderr and not (tmp_path / "ev").exists()


def test_trainer_places_model_on_the_resolved_device(stories260k, tmp_path):
    tr = Trainer(C.load(None, small(stories260k, "max_steps=1", "device=cpu")), tmp_path / "run")
    assert tr.device == torch.device("cpu")
    assert {p.device for p in tr.model.parameters()} == {torch.device("cpu")}
