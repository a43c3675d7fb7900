"""A real short run of the embedded default goes through recommend and back into train (needs the trainer)."""

import json

from mechdiag import config as configlib

SMALL = ["--max-steps", "4", "--set", "eval_n=16", "--set", "prompts_per_step=2", "--set", "group_size=4",
         "--set", "threads=1", "--set", "save_every=0", "--set", "temperature=0.5", "--set", "beta=0"]


def test_real_run_recommend_and_train_again(tmp_path, cli):
    run0, refined, run1 = tmp_path / "run0", tmp_path / "refined.yaml", tmp_path / "run1"
    proc = cli("train", *SMALL, "--out", str(run0))
    assert proc.returncode == 0, proc.stderr
    proc = cli("recommend", str(run0), "--out", str(refined), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout)
    assert all({"rule", "symptom", "evidence", "change", "confidence"} <= set(f) for f in findings)
    cfg = configlib.load(refined)
    assert refined.read_text().startswith("# Refined by mechdiag recommend")
    assert (cfg == configlib.load(run0 / "config.yaml")) == (not any(f["change"] != "none (advice only)"
                                                                    for f in findings))
    proc = cli("train", str(refined), "--out", str(run1))
    assert proc.returncode == 0, proc.stderr
    assert configlib.load(run1 / "config.yaml") == cfg  # train took the refined config unchanged
    assert (run1 / "eval.jsonl").read_text().strip()
