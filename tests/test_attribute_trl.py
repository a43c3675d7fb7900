"""mechdiag attribute on TRL-trained LoRA runs: `mechdiag train --backend trl`, and a user's own TRL script that
recorded with MechdiagCallback. The reference rows reproduce the run's own held-out numbers exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mechdiag.metrics import last_step, update_mass
from mechdiag.run import RunDir
from tests.helpers import REPO_ROOT, assert_bad_input, invoke_cli, run_cli
from tests.test_attribute import TRAIN, assert_exact_ends


@pytest.fixture(scope="module")
def backend_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("attr_trl") / "run"
    proc = run_cli("train", "--backend", "trl", *[x for s in TRAIN for x in ("--set", s)], "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def callback_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("attr_cb") / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "tests.trl_script", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_backend_trl_run_reference_rows_are_exact(backend_run):
    proc = invoke_cli("attribute", str(backend_run), "--by", "module", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert_exact_ends(rows, RunDir(backend_run).summary())
    assert [r["module"] for r in rows if r["by"] == "module"] == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"]


def test_callback_output_dir_is_attributed_and_saved(callback_out, tmp_path):
    run = RunDir(callback_out / "mechdiag")
    assert run.summary()["config_derived"] is False and (callback_out / "checkpoint-4").is_dir()
    proc = invoke_cli("attribute", str(callback_out), "--by", "both", "--format", "json", "--save")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert_exact_ends(rows, run.summary())
    # the parts are the script's LoRA layout (its adapter_config), not mechdiag's default
    assert [r["module"] for r in rows if r["by"] == "module"] == ["q_proj", "v_proj", "down_proj"]
    recorded = update_mass(last_step(run.read("displacement")), "layer")  # the callback's last-step rows
    for r in rows:
        if r["by"] == "layer":
            assert r["disp_share"] == pytest.approx(recorded[r["layer"]], rel=1e-9)
    assert run.read("attribution") == rows  # --save went into OUT/mechdiag/
    html = tmp_path / "r.html"
    proc = invoke_cli("report", str(callback_out), "--out", str(html))
    assert proc.returncode == 0, proc.stderr
    assert "Attribution: causal vs displacement share" in html.read_text()


def test_callback_adapter_saved_after_the_run(callback_out, tmp_path):
    """Without a checkpoint at the last step, the adapter trainer.save_model(OUT) wrote after train() is the final
    one; an adapter older than the run's end is not."""
    out = tmp_path / "out"
    shutil.copytree(callback_out, out, ignore=shutil.ignore_patterns("attribution.jsonl"))
    ckpt = out / "checkpoint-4"
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(ckpt / f, out / f)
    shutil.rmtree(ckpt)
    proc = invoke_cli("attribute", str(out), "--by", "layer", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert_exact_ends(json.loads(proc.stdout), RunDir(out / "mechdiag").summary())
    old = (out / "mechdiag" / "summary.json").stat().st_mtime - 60
    os.utime(out / "adapter_model.safetensors", (old, old))
    proc = invoke_cli("attribute", str(out))
    assert_bad_input(proc)
    assert "save_model" in proc.stderr
