"""Shared fixtures: the ../shared data and models (override with $MECHDIAG_SHARED), and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from mechdiag.paths import shared_dir
from tests.helpers import run_cli

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
    return run_cli
