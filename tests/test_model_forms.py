"""Every command that takes a model accepts the same forms (mechdiag.models): `bundled`, a Hugging Face model
folder, a PEFT adapter folder, a run directory (its final/, or a checkpoint with --checkpoint N); and report,
recommend and `displacement --by module` agree on the update mass of one run. Real runs: tests/conftest.py's
tiny_run trains the bundled base for 6 steps (checkpoints at 2, 4, 6)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mechdiag import models
from mechdiag.cli import main
from mechdiag.errors import UserError
from mechdiag.evidence import Signals
from mechdiag.integrations.readers import locate
from mechdiag.integrations.readers.trl_dir import is_trl_dir
from mechdiag.report.figures import _module_mass
from mechdiag.run import callback_run, is_run_dir, load_run, resolve_run
from tests.helpers import assert_bad_input


def _json(*args: str) -> list[dict]:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, (args, res.output, res.exception)
    return json.loads(res.stdout)


def _by_name(rows: list[dict], key: str = "name", value: str = "delta_fro") -> dict:
    return {r[key]: r[value] for r in rows}


def test_checkpoint_folder_resolves_every_form(tiny_run):
    bundled = models.bundled_path()
    assert models.checkpoint_folder("bundled") == bundled
    assert models.checkpoint_folder(bundled) == bundled
    assert models.checkpoint_folder(tiny_run) == tiny_run / "final"
    assert models.checkpoint_folder(tiny_run / "final") == tiny_run / "final"
    assert models.checkpoint_folder(tiny_run, 4) == tiny_run / "checkpoints" / "step-4"
    with pytest.raises(UserError, match="no complete checkpoint at step 5"):
        models.checkpoint_folder(tiny_run, 5)
    with pytest.raises(UserError, match="needs a run directory"):
        models.checkpoint_folder(bundled, 2)


def test_displacement_accepts_every_form(tiny_run):
    ref = _by_name(_json("displacement", "bundled", str(tiny_run / "final"), "--format", "json"))
    assert any(v > 0 for v in ref.values())
    for a in ("bundled", str(models.bundled_path())):
        for b in (str(tiny_run), str(tiny_run / "final")):
            assert _by_name(_json("displacement", a, b, "--format", "json")) == ref, (a, b)
    step2 = _by_name(_json("displacement", "bundled", str(tiny_run), "--checkpoint", "2", "--format", "json"))
    assert step2.keys() == ref.keys() and step2 != ref  # an earlier point of the same run


def test_shift_accepts_every_form(tiny_run):
    args = ("--task", "arith", "--n", "4", "--format", "json")
    ref = _json("shift", "bundled", str(tiny_run / "final"), *args)
    assert ref and all(r["shift"] >= 0 for r in ref)
    for base, tuned in (("bundled", str(tiny_run)), (str(models.bundled_path()), str(tiny_run))):
        rows = _json("shift", base, tuned, *args)
        assert [r["shift"] for r in rows] == pytest.approx([r["shift"] for r in ref], rel=1e-5), (base, tuned)
    early = _json("shift", "bundled", str(tiny_run), "--checkpoint", "2", *args)
    assert len(early) == len(ref)


def test_eval_accepts_every_form(tiny_run, tmp_path):
    args = ("--task", "arith", "--n", "4", "--k", "1", "--max-new-tokens", "8", "--format", "json")
    acc = {}
    for i, model in enumerate(("bundled", str(models.bundled_path()), str(tiny_run), str(tiny_run / "final"))):
        rows = _json("eval", model, *args, "--out", str(tmp_path / f"e{i}"))
        acc[i] = next(r["value"] for r in rows if r["metric"] == "accuracy" and r["model"] == "base")
    assert acc[0] == acc[1] and acc[2] == acc[3]  # the same base either way; a run and its final/ alike
    rows = _json("eval", "bundled", "--adapter", str(tiny_run), "--adapter", f"ck4={tiny_run}/checkpoints/step-4",
                 *args, "--out", str(tmp_path / "adapters"))
    assert {r["model"] for r in rows} == {"base", "run", "ck4"}


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:99"])
def test_bad_device_is_one_line(cli, tiny_run, device):
    assert_bad_input(cli("shift", "bundled", str(tiny_run), "--task", "arith", "--n", "2", "--device", device))


def test_report_recommend_and_displacement_agree_on_update_mass(tiny_run):
    rows = _json("displacement", "bundled", str(tiny_run), "--by", "module", "--format", "json")
    raw = {r["module"]: r["update_mass"] for r in rows}
    normalised = {r["module"]: r["update_mass_size_normalised"] for r in rows}
    run = load_run(tiny_run)
    report = _module_mass(run)  # the report's bar chart
    recommend = Signals.from_runs([run]).module_mass  # what the reduced_modules rule reads and prints
    moved = {m for m, v in raw.items() if v > 0}
    assert moved and set(report) >= moved and set(recommend) >= moved
    for m in moved:
        assert report[m] == pytest.approx(raw[m], rel=1e-4), m
        assert recommend[m] == pytest.approx(normalised[m], rel=1e-4), m
    assert sum(raw.values()) == pytest.approx(1.0) and sum(recommend.values()) == pytest.approx(1.0)


def test_one_rule_for_a_run_directory(tmp_path, tiny_run):
    """run.is_run_dir / run.callback_run decide for run arguments (resolve_run), model arguments
    (checkpoint_folder) and the readers (locate, is_trl_dir) alike."""
    evals = tmp_path / "evals"  # a run holding only eval records (mechdiag eval's output) is a run directory
    evals.mkdir()
    (evals / "eval_benchmarks.jsonl").write_text('{"step": 0, "benchmark": "b", "metric": "accuracy"}\n')
    assert is_run_dir(evals) and resolve_run(evals).path == evals and locate(evals) is None
    with pytest.raises(UserError, match="neither final/ nor a complete checkpoint"):
        models.checkpoint_folder(evals)  # a run, but no model in it: said so, not passed on as a model folder
    out = tmp_path / "trl_out"  # a TRL output_dir whose MechdiagCallback wrote OUT/mechdiag/
    (out / "mechdiag").mkdir(parents=True)
    (out / "mechdiag" / "config.yaml").write_text((tiny_run / "config.yaml").read_text())
    assert not is_run_dir(out) and callback_run(out) == out / "mechdiag"
    assert resolve_run(out).path == out / "mechdiag" and is_trl_dir(out) and locate(out)[0] == "trl"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")  # a model folder is never a run
    assert not is_run_dir(empty) and callback_run(empty) is None and not is_trl_dir(empty)
    with pytest.raises(UserError, match="not a run directory"):
        resolve_run(empty)
    assert is_run_dir(tiny_run) and models.checkpoint_folder(tiny_run) == tiny_run / "final"
