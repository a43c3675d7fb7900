"""Where the shared benchmark data and models live (../shared beside the repo, or $MECHDIAG_SHARED)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"


def shared_dir() -> Path:
    env = os.environ.get("MECHDIAG_SHARED")
    return Path(env) if env else REPO_ROOT.parent / "shared"


def shared_path(*parts: str) -> Path:
    return shared_dir().joinpath(*parts)


def cache_dir() -> Path:
    """Where converted models are kept: $MECHDIAG_CACHE, else $XDG_CACHE_HOME/mechdiag, else ~/.cache/mechdiag."""
    env = os.environ.get("MECHDIAG_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mechdiag"
