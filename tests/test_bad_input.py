"""The bad-input contract for every command: exit code 2, one line on stderr, no traceback, no output written.

A table of (command, bad input) cases run in-process through click (one import of torch for all), plus a few of
them as real `python -m mechdiag` processes. Paths: {bad} the corpus folder, {run} a finished tiny run,
{adapter} its final adapter, {base} the bundled base, {out} a path that must not exist afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mechdiag.cli import main
from mechdiag.errors import first_line
from mechdiag.models import bundled_path
from mechdiag.paths import shared_path
from mechdiag.run import held
from tests.helpers import assert_bad_input, run_cli

TRAIN_OUT = ["--out", "{out}"]
FAST = ["--set", "max_steps=1", "--set", "eval_n=2", "--set", "threads=1"]

# id -> (argv, text the one stderr line must contain or "")
CASES: dict[str, tuple[list[str], str]] = {
    # ---- train
    "train/config-missing": (["train", "{bad}/nope.yaml", *TRAIN_OUT], "not found"),
    "train/config-is-folder": (["train", "{bad}/empty_dir", *TRAIN_OUT], "directory"),
    "train/config-invalid-yaml": (["train", "{bad}/invalid.yaml", *TRAIN_OUT], "invalid YAML"),
    "train/config-not-mapping": (["train", "{bad}/list.yaml", *TRAIN_OUT], "mapping"),
    "train/config-binary": (["train", "{bad}/binary.yaml", *TRAIN_OUT], ""),
    "train/config-truncated": (["train", "{bad}/truncated.yaml", *TRAIN_OUT], ""),
    "train/unknown-key": (["train", "{bad}/unknown.yaml", *TRAIN_OUT], "did you mean learning_rate"),
    "train/unknown-nested-key": (["train", *TRAIN_OUT, "--set", "lora.alhpa=3"], "did you mean lora.alpha"),
    "train/unknown-option": (["train", "--outt", "{out}"], "did you mean '--out'"),
    "train/out-of-range": (["train", "{bad}/range.yaml", *TRAIN_OUT], "group_size"),
    "train/out-of-range-set": (["train", *TRAIN_OUT, "--set", "learning_rate=5"], "learning_rate"),
    "train/wrong-type": (["train", *TRAIN_OUT, "--set", "max_steps=many"], "max_steps"),
    "train/set-without-equals": (["train", *TRAIN_OUT, "--set", "beta"], "key=value"),
    "train/set-empty-key": (["train", *TRAIN_OUT, "--set", "=3"], "key before '=' is empty"),
    "train/max-steps-option-type": (["train", *TRAIN_OUT, "--max-steps", "x"], "max-steps"),
    "train/unknown-task": (["train", *TRAIN_OUT, "--set", "task.name=arihtm"], "did you mean arith"),
    "train/model-missing": (["train", *TRAIN_OUT, *FAST, "--set", "model.name_or_path={bad}/nope"], ""),
    "train/model-garbage": (["train", *TRAIN_OUT, *FAST, "--set", "model.name_or_path={bad}/fake_model"], ""),
    "train/model-truncated-weights": (["train", *TRAIN_OUT, *FAST, "--set", "model.name_or_path={bad}/trunc_model"],
                                      ""),
    "train/layers-out-of-range": (["train", *TRAIN_OUT, *FAST, "--set", "lora.layers=0-99"], "out of range"),
    "train/dataset-empty": (["train", *TRAIN_OUT, *FAST, "--set", "task.name=jsonl",
                             "--set", "task.path={bad}/empty.jsonl"], ""),
    "train/dataset-corrupt": (["train", *TRAIN_OUT, *FAST, "--set", "task.name=jsonl",
                               "--set", "task.path={bad}/corrupt.jsonl"], ""),
    "train/dataset-wrong-fields": (["train", *TRAIN_OUT, *FAST, "--set", "task.name=jsonl",
                                    "--set", "task.path={bad}/noprompt.jsonl"], ""),
    "train/dataset-missing": (["train", *TRAIN_OUT, *FAST, "--set", "task.name=jsonl",
                               "--set", "task.path={bad}/nope.jsonl"], "not found"),
    "train/hook-missing": (["train", *TRAIN_OUT, *FAST, "--set", "hooks=[nope.nope:x]"], "hook"),
    "train/resume-not-a-run": (["train", "--resume", "{bad}/empty_dir"], "not a mechdiag run"),
    "train/resume-bad-config": (["train", "--resume", "{bad}/run_bad_config"], "invalid YAML"),
    "train/resume-truncated-checkpoint": (["train", "--resume", "{bad}/run_trunc_ckpt"], "checkpoint"),
    "train/resume-corrupt-metrics": (["train", "--resume", "{bad}/run_corrupt_metrics"], "corrupt"),
    "train/out-is-file": (["train", "--out", "{bad}/text.txt", *FAST], "is a file"),
    "train/out-parent-is-file": (["train", "--out", "{bad}/text.txt/run", *FAST], "not a folder"),
    "train/out-unwritable": (["train", "--out", "{ro}/run", *FAST], "cannot write"),
    "train/dry-run-unknown-task": (["train", "--dry-run", "--set", "task.name=arihtm"], "did you mean arith"),
    "train/dry-run-data-missing": (["train", "--dry-run", "--set", "task.name=jsonl",
                                    "--set", "task.path={bad}/nope.jsonl"], "not found"),
    "train/dry-run-data-empty": (["train", "--dry-run", "--set", "task.name=jsonl",
                                  "--set", "task.path={bad}/empty.jsonl"], ""),
    # ---- displacement
    "displacement/missing": (["displacement", "{bad}/nope.safetensors", "{adapter}", "--out", "{out}"], ""),
    "displacement/empty-file": (["displacement", "{bad}/empty.safetensors", "{adapter}", "--out", "{out}"], ""),
    "displacement/garbage": (["displacement", "{bad}/garbage.safetensors", "{adapter}", "--out", "{out}"], ""),
    "displacement/truncated": (["displacement", "{base}", "{bad}/trunc_adapter", "--out", "{out}"], ""),
    "displacement/text-file": (["displacement", "{bad}/text.txt", "{adapter}", "--out", "{out}"], ""),
    "displacement/empty-folder": (["displacement", "{bad}/empty_dir", "{adapter}", "--out", "{out}"], ""),
    "displacement/garbage-model": (["displacement", "{bad}/fake_model", "{adapter}", "--out", "{out}"], ""),
    "displacement/bad-choice": (["displacement", "{base}", "{adapter}", "--by", "head", "--out", "{out}"], "head"),
    "displacement/parquet-no-out": (["displacement", "{base}", "{adapter}", "--format", "parquet"], "--out"),
    "displacement/html-garbage": (["displacement", "{bad}/garbage.safetensors", "{adapter}", "--html", "{out}"], ""),
    "displacement/out-is-folder": (["displacement", "{base}", "{adapter}", "--out", "{bad}/empty_dir"], "empty_dir"),
    "displacement/out-parent-is-file": (["displacement", "{base}", "{adapter}", "--out", "{bad}/text.txt/rows.csv"],
                                        "not a folder"),
    "displacement/html-unwritable": (["displacement", "{base}", "{adapter}", "--html", "{ro}/heat.html"],
                                     "cannot write"),
    # ---- shift
    "shift/base-missing": (["shift", "{bad}/nope", "{adapter}", "--prompts", "{bad}/prompts.txt", "--out", "{out}"],
                           ""),
    "shift/tuned-garbage": (["shift", "{base}", "{bad}/fake_model", "--prompts", "{bad}/prompts.txt",
                             "--out", "{out}"], ""),
    "shift/tuned-truncated": (["shift", "{base}", "{bad}/trunc_adapter", "--prompts", "{bad}/prompts.txt",
                               "--out", "{out}"], ""),
    "shift/prompts-missing": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/nope.txt", "--out", "{out}"],
                              "not found"),
    "shift/prompts-empty": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/empty.jsonl", "--out", "{out}"],
                            "no prompts"),
    "shift/prompts-corrupt": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/corrupt.jsonl", "--out", "{out}"],
                              "not JSON"),
    "shift/prompts-binary": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/binary.yaml", "--out", "{out}"], ""),
    "shift/prompts-and-task": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/prompts.txt", "--task", "arith",
                                "--out", "{out}"], "exactly one"),
    "shift/n-zero": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/prompts.txt", "--n", "0", "--out", "{out}"],
                     ""),
    "shift/unknown-task": (["shift", "{base}", "{adapter}", "--task", "arihtm", "--out", "{out}"], "did you mean"),
    "shift/out-is-folder": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/prompts.txt",
                             "--out", "{bad}/empty_dir"], "empty_dir"),
    "shift/html-parent-is-file": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/prompts.txt",
                                   "--html", "{bad}/text.txt/shift.html"], "not a folder"),
    "shift/out-unwritable": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/prompts.txt",
                              "--out", "{ro}/rows.json"], "cannot write"),
    "shift/device-unusable": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/prompts.txt", "--device",
                               "cuda:99", "--out", "{out}"], "--device cuda:99"),
    "shift/device-nonsense": (["shift", "{base}", "{adapter}", "--prompts", "{bad}/prompts.txt", "--device",
                               "gpu", "--out", "{out}"], "--device gpu"),
    "shift/adapter-of-another-base": (["shift", "{stories}", "{adapter}", "--prompts", "{bad}/prompts.txt",
                                       "--out", "{out}"], ""),
    # ---- eval
    "eval/adapter-of-another-base": (["eval", "{stories}", "--adapter", "{adapter}", "--task", "arith", "--n", "1",
                                      "--device", "cpu", "--out", "{out}"], "do not fit the model"),
    "eval/device-unusable": (["eval", "{base}", "--task", "arith", "--n", "1", "--device", "cuda:99",
                              "--out", "{out}"], "--device cuda:99"),
    "eval/out-is-file": (["eval", "{base}", "--task", "arith", "--n", "1", "--out", "{bad}/text.txt"], "is a file"),
    "eval/out-unwritable": (["eval", "{base}", "--task", "arith", "--n", "1", "--out", "{ro}/eval"], "cannot write"),
    # ---- recommend
    "recommend/missing": (["recommend", "{bad}/nope", "--out", "{out}"], ""),
    "recommend/empty-folder": (["recommend", "{bad}/empty_dir", "--out", "{out}"], ""),
    "recommend/file-not-folder": (["recommend", "{bad}/text.txt", "--out", "{out}"], ""),
    "recommend/corrupt-metrics": (["recommend", "{bad}/run_corrupt_metrics", "--out", "{out}"], "line 3 "),
    "recommend/empty-metrics": (["recommend", "{bad}/run_empty_metrics", "--out", "{out}"], ""),
    "recommend/truncated-metrics": (["recommend", "{bad}/run_truncated_metrics", "--out", "{out}"], ""),
    "recommend/bad-config": (["recommend", "{bad}/run_bad_config", "--out", "{out}"], ""),
    "recommend/unknown-key-config": (["recommend", "{bad}/run_unknown_key", "--out", "{out}"], "did you mean"),
    "recommend/corrupt-summary": (["recommend", "{bad}/run_bad_summary", "--out", "{out}"], ""),
    "recommend/bad-format": (["recommend", "{run}", "--format", "xml", "--out", "{out}"], "xml"),
    "recommend/out-is-folder": (["recommend", "{run}", "--out", "{bad}/empty_dir"], "empty_dir"),
    "recommend/out-unwritable": (["recommend", "{run}", "--out", "{ro}/refined.yaml"], "cannot write"),
    # ---- tune
    "tune/config-missing": (["tune", "{bad}/nope.yaml", "--out", "{out}"], "not found"),
    "tune/invalid-yaml": (["tune", "{bad}/invalid.yaml", "--out", "{out}"], "invalid YAML"),
    "tune/unknown-key": (["tune", "{bad}/unknown.yaml", "--out", "{out}"], "did you mean learning_rate"),
    "tune/out-of-range": (["tune", "--set", "beta=-1", "--out", "{out}"], "beta"),
    "tune/rounds-zero": (["tune", "--rounds", "0", "--out", "{out}"], "rounds"),
    "tune/trainer-missing": (["tune", "--trainer", "nope.nope:train", "--out", "{out}"], ""),
    "tune/trainer-not-callable": (["tune", "--trainer", "mechdiag.run:STREAMS", "--out", "{out}"], ""),
    "tune/dataset-empty": (["tune", "--rounds", "1", *FAST, "--set", "task.name=jsonl",
                            "--set", "task.path={bad}/empty.jsonl", "--out", "{out}"], ""),
    "tune/out-is-file": (["tune", "--rounds", "1", *FAST, "--out", "{bad}/text.txt"], "is a file"),
    "tune/out-parent-is-file": (["tune", "--rounds", "1", *FAST, "--out", "{bad}/text.txt/tune"], "not a folder"),
    # ---- report
    "report/missing": (["report", "{bad}/nope", "--out", "{out}.html"], ""),
    "report/empty-folder": (["report", "{bad}/empty_dir", "--out", "{out}.html"], ""),
    "report/file-not-folder": (["report", "{bad}/text.txt", "--out", "{out}.html"], ""),
    "report/corrupt-metrics": (["report", "{bad}/run_corrupt_metrics", "--out", "{out}.html"], "line 3 "),
    "report/corrupt-summary": (["report", "{bad}/run_bad_summary", "--out", "{out}.html"], ""),
    "report/bad-config": (["report", "{bad}/run_bad_config", "--out", "{out}.html"], ""),
    "report/out-wrong-type": (["report", "{run}", "--out", "{out}.png"], "html"),
    "report/out-parent-is-file": (["report", "{run}", "--out", "{bad}/text.txt/r.html"], "not a folder"),
    "report/out-unwritable": (["report", "{run}", "--out", "{ro}/r.html"], "cannot write"),
    # ---- demo (all must fail before training)
    "demo/max-steps-zero": (["demo", "--max-steps", "0", "--out", "{out}"], "max-steps"),
    "demo/max-steps-type": (["demo", "--max-steps", "x", "--out", "{out}"], "max-steps"),
    "demo/out-is-file": (["demo", "--out", "{bad}/text.txt", "--report", "{out}.html"], ""),
    "demo/report-wrong-type": (["demo", "--out", "{out}", "--report", "{out}.png"], "html"),
    "demo/out-parent-is-file": (["demo", "--out", "{bad}/text.txt/demo", "--report", "{out}.html"], "not a folder"),
    "demo/report-unwritable": (["demo", "--out", "{out}", "--report", "{ro}/demo.html"], "cannot write"),
    # ---- the group
    "mechdiag/unknown-command": (["trian"], "did you mean"),
}
# A folder nobody can create entries in, root included (permission bits do not stop root).
READ_ONLY = "/proc"
SUBPROCESS = ["shift/out-unwritable", "train/dry-run-unknown-task", "train/unknown-key",
              "displacement/truncated", "shift/prompts-corrupt", "recommend/corrupt-metrics",
              "tune/unknown-key", "report/corrupt-metrics", "demo/max-steps-zero", "train/config-is-folder"]


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def _copy_run(src: Path, dst: Path, checkpoints: bool = False) -> Path:
    shutil.copytree(src, dst, ignore=None if checkpoints else shutil.ignore_patterns("checkpoints"))
    return dst


@pytest.fixture(scope="module")
def corpus(tiny_run, tmp_path_factory) -> Path:
    bad = tmp_path_factory.mktemp("bad")
    (bad / "empty_dir").mkdir()
    (bad / "invalid.yaml").write_text("lora: [1, 2\nbeta: 0.1\n")
    (bad / "list.yaml").write_text("- 1\n- 2\n")
    (bad / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (bad / "truncated.yaml").write_text('lora:\n  r: 4\n  target_modules: ["q_proj", "v_pr')
    (bad / "unknown.yaml").write_text("lerning_rate: 0.001\n")
    (bad / "range.yaml").write_text("group_size: 1\n")
    (bad / "text.txt").write_text("this is not a model\n")
    (bad / "prompts.txt").write_text("1 + 1 =\n2 + 2 =\n")
    (bad / "long.txt").write_text("1 + " * 200_000 + "1 =\n")
    (bad / "long.jsonl").write_text(('{"prompt": "' + "1 + " * 200_000 + '1", "answer": "2"}\n') * 4)
    (bad / "empty.jsonl").write_text("")
    (bad / "corrupt.jsonl").write_text('{"prompt": "1 + 1", "answer": "2"}\n{not json at all\n')
    (bad / "noprompt.jsonl").write_text('{"q": "1 + 1", "a": "2"}\n')
    (bad / "empty.safetensors").write_bytes(b"")
    (bad / "garbage.safetensors").write_bytes(os.urandom(4096))
    fake = bad / "fake_model"
    fake.mkdir()
    (fake / "config.json").write_text("{ this is not json")
    (fake / "model.safetensors").write_bytes(os.urandom(1024))
    trunc_model = shutil.copytree(bundled_path(), bad / "trunc_model")
    for f in trunc_model.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    adapter = shutil.copytree(tiny_run / "final", bad / "trunc_adapter")
    w = adapter / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    # broken run directories
    r = _copy_run(tiny_run, bad / "run_corrupt_metrics", checkpoints=True)
    lines = (r / "metrics.jsonl").read_text().splitlines(keepends=True)
    (r / "metrics.jsonl").write_text("".join(lines[:2]) + "{garbage\n" + "".join(lines[2:]))
    r = _copy_run(tiny_run, bad / "run_empty_metrics")
    for s in ("metrics", "eval", "samples", "displacement", "shift"):
        (r / f"{s}.jsonl").write_text("")
    r = _copy_run(tiny_run, bad / "run_truncated_metrics")
    (r / "metrics.jsonl").write_text((r / "metrics.jsonl").read_text()[:30])
    (r / "eval.jsonl").write_text("")
    r = _copy_run(tiny_run, bad / "run_bad_config", checkpoints=True)
    (r / "config.yaml").write_text("lora: [1, 2\n")
    r = _copy_run(tiny_run, bad / "run_unknown_key")
    (r / "config.yaml").write_text((r / "config.yaml").read_text() + "lerning_rate: 0.1\n")
    r = _copy_run(tiny_run, bad / "run_bad_summary")
    (r / "summary.json").write_text('{"steps": 6, "base_acc')
    r = _copy_run(tiny_run, bad / "run_trunc_ckpt", checkpoints=True)
    last = max((r / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    opt = last / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 3])
    return bad


def _argv(args: list[str], corpus: Path, tiny_run: Path, out: Path) -> list[str]:
    subs = {"{bad}": str(corpus), "{run}": str(tiny_run), "{adapter}": str(tiny_run / "final"),
            "{base}": str(bundled_path()), "{out}": str(out),
            "{stories}": str(shared_path("models", "stories260K", "hf")), "{ro}": READ_ONLY}
    result = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        result.append(a)
    return result


def _check_nothing_written(cwd: Path, out: Path, corpus: Path, before: dict) -> None:
    assert list(cwd.iterdir()) == [], list(cwd.iterdir())  # no runs/, reports/ or other default output
    assert not any(out.parent.glob(out.name + "*")), list(out.parent.glob(out.name + "*"))
    assert _tree(corpus) == before  # inputs are left as they were (a failed --resume touches nothing)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_in_process(case, corpus, tiny_run, tmp_path, monkeypatch):
    args, needle = CASES[case]
    before = _tree(corpus)
    cwd, out = tmp_path / "cwd", tmp_path / "outputs" / "out"
    cwd.mkdir()
    out.parent.mkdir()
    monkeypatch.chdir(cwd)
    result = CliRunner().invoke(main, _argv(args, corpus, tiny_run, out))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("mechdiag: error: "), lines[0]
    assert needle.lower() in lines[0].lower(), lines[0]
    assert result.stdout == "", result.stdout
    _check_nothing_written(cwd, out, corpus, before)


@pytest.mark.parametrize("case", SUBPROCESS)
def test_bad_input_as_a_process(case, corpus, tiny_run, tmp_path):
    args, needle = CASES[case]
    before = _tree(corpus)
    cwd, out = tmp_path / "cwd", tmp_path / "outputs" / "out"
    cwd.mkdir()
    out.parent.mkdir()
    proc = run_cli(*_argv(args, corpus, tiny_run, out), cwd=cwd)
    assert_bad_input(proc)
    assert needle.lower() in proc.stderr.lower() and proc.stdout == ""
    _check_nothing_written(cwd, out, corpus, before)


def test_over_long_prompts_are_truncated_not_fatal(corpus, tiny_run, tmp_path):
    """Over-long prompts are cut to the limit (left-truncation keeps the question's end), with no traceback:
    shift says so in one note line; train cuts to max_prompt_tokens as documented."""
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(main, ["shift", str(bundled_path()), str(tiny_run / "final"), "--prompts",
                                       str(corpus / "long.txt"), "--format", "json", "--out", str(out)])
    assert result.exit_code == 0 and result.exception is None, result.stderr
    assert [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("shift prompts:")] == [
        "mechdiag: note: 1 of 1 prompts truncated to 512 tokens",  # beside the progress line of a log
        "mechdiag: note: position 0 (BOS) left out of the norms in 1 of 1 prompts (--keep-bos counts it)"]
    assert out.exists() and json.loads(out.read_text())
    result = CliRunner().invoke(main, ["train", *FAST, "--set", "task.name=jsonl", "--set",
                                       f"task.path={corpus / 'long.jsonl'}", "--set", "eval_n=1",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 0 and result.exception is None, result.stderr
    assert "Traceback" not in result.stderr and (tmp_path / "run" / "summary.json").exists()


def test_first_line_is_one_line_even_for_an_empty_message():
    """Two inline copies used `str(e).splitlines()[0]`, an IndexError on an empty message: errors.first_line is
    the one form, and it always returns a line."""
    assert first_line(OSError()) == "OSError"
    assert first_line(ValueError("  \n \n")) == "ValueError"
    assert first_line(ValueError("\n  bad key\nmore detail")) == "bad key"
    assert first_line(ValueError("x" * 500), 160) == "x" * 157 + "..."


def test_one_rule_for_a_folder_that_already_holds_a_run(tmp_path):
    """run.held is the rule train, `train --backend trl` and the readers share (the TRL backend looked only at
    metrics.jsonl, the readers also refused a lone config.yaml): any record stream or a summary.json."""
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    assert held(tmp_path) == []
    (tmp_path / "eval.jsonl").write_text("{}\n")
    (tmp_path / "summary.json").write_text("{}")
    assert held(tmp_path) == ["eval.jsonl", "summary.json"]
    result = CliRunner().invoke(main, ["train", "--out", str(tmp_path), *FAST])
    assert result.exit_code == 2 and "already holds a run" in result.stderr, result.stderr
