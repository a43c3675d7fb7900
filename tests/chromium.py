"""Headless Debian chromium for page tests, standard library only: --dump-dom after a virtual-time budget
(the page writes its render state on <html>), console messages read from chromium's stderr log."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--mute-audio"]
_CONSOLE = re.compile(r":CONSOLE(?:\(\d+\))?:?\d*\] (.*)")


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium not found: install Debian chromium (.ci/run does: apt-get install -y chromium)",
                    pytrace=False)
    return exe


@dataclass
class Page:
    dom: str
    console: list[str]  # every console message the page produced (errors, warnings, CSP violations, logs)

    def html_attr(self, name: str) -> str | None:
        m = re.search(r"<html\b[^>]*>", self.dom)
        a = re.search(rf'\b{re.escape(name)}="([^"]*)"', m.group(0)) if m else None
        return a.group(1) if a else None

    @property
    def title(self) -> str:
        m = re.search(r"<head>.*?<title>(.*?)</title>", self.dom, re.S)
        return m.group(1) if m else ""


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="mechdiag-chromium-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout)


def load(path: Path, screenshot: Path | None = None, size: tuple[int, int] = (1400, 3000), budget_ms: int = 20000,
         timeout: float = 120) -> Page:
    """Open a local page in a size[0] x size[1] window, let it run for budget_ms of virtual time, and return the
    DOM and the console log; with `screenshot`, also write a PNG of the window there (same browser run)."""
    args = ["--enable-logging=stderr", "--v=0", f"--virtual-time-budget={budget_ms}",
            f"--window-size={size[0]},{size[1]}", "--dump-dom"]
    if screenshot is not None:
        args.append(f"--screenshot={screenshot}")
    proc = _run([*args, Path(path).resolve().as_uri()], timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [m.group(1) for m in map(_CONSOLE.search, proc.stderr.splitlines()) if m]
    return Page(dom=proc.stdout, console=console)


def png_size(png: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header; fails if the file is not a PNG."""
    head = Path(png).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])
