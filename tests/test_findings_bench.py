"""bench/findings.py reads the study's findings off a run's own records: the numbers it prints are the shares of
mechdiag.metrics' update mass, and an end-heavy run reads as end-heavy."""

from __future__ import annotations

import sys

import pytest

from bench import findings
from mechdiag import config as configlib
from tests.synth import ends_heavy, write_run


def _run(monkeypatch, capsys, path) -> str:
    monkeypatch.setattr(sys, "argv", ["findings.py", str(path)])
    findings.main()
    return capsys.readouterr().out


def test_findings_of_an_end_heavy_run(tmp_path, monkeypatch, capsys):
    cfg = configlib.load(None, ["lora.target_modules=[q_proj, v_proj, up_proj]"])
    write_run(tmp_path / "run", cfg, n_layers=8, layer_mass=ends_heavy(8, 6.0), module_mass={"up_proj": 8.0},
              shift=lambda layer: 0.01 * (layer + 1), noise=0.0)
    out = _run(monkeypatch, capsys, tmp_path / "run")
    # up_proj carries 8 of 10 units of squared displacement per layer (ref_fro 1 everywhere: raw = size-normalised)
    assert "raw update mass: up_proj 80.0%, q_proj 10.0%, v_proj 10.0%" in out
    assert "attention's share: raw 20.0%" in out
    assert "first2+last2 per layer / middle per layer = 6.00" in out
    assert "(largest at layer 7)" in out  # the shift rises with depth


def test_findings_refuses_a_run_without_displacement(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no displacement records"):
        _run(monkeypatch, capsys, tmp_path / "empty")
