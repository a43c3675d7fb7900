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


HELD = ["--max-steps", "16", "--set", "eval_n=64", "--set", "prompts_per_step=2", "--set", "group_size=4",
        "--set", "threads=1", "--set", "save_every=0"]


def test_held_still_by_kl_freed_and_the_advice_trains_better(tmp_path, cli):
    """A run whose huge beta holds the policy at the reference gets held_still's advice (a weaker anchor); the
    refined config, trained the same way, ends above it on held-out reward and accuracy."""
    held, refined, freed = tmp_path / "held", tmp_path / "refined.yaml", tmp_path / "freed"
    assert cli("train", *HELD, "--set", "beta=50", "--out", str(held)).returncode == 0
    proc = cli("recommend", str(held), "--out", str(refined), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rules = {f["rule"]: f for f in json.loads(proc.stdout)}
    assert "held_still" in rules and rules["held_still"]["change"] == "beta: 50 -> 0.01"
    assert configlib.load(refined).beta == 0.01
    assert cli("train", str(refined), *HELD[:2], "--out", str(freed)).returncode == 0
    last = [json.loads(x) for x in (held / "eval.jsonl").read_text().splitlines()]
    new = [json.loads(x) for x in (freed / "eval.jsonl").read_text().splitlines()]
    assert last[-1]["accuracy"] == last[0]["accuracy"]  # held still
    assert new[-1]["eval_reward"] > last[-1]["eval_reward"] and new[-1]["accuracy"] > last[-1]["accuracy"]


def test_held_still_by_a_tiny_step_size_freed_and_the_advice_trains_better(tmp_path, cli):
    """beta 0 and a learning rate too small to move the policy in 16 steps: held_still raises the learning rate
    by sqrt(KL_WORKING / kl), at least x3; the refined config, trained the same way, ends above the held run on
    held-out reward and accuracy."""
    held, refined, freed = tmp_path / "held", tmp_path / "refined.yaml", tmp_path / "freed"
    assert cli("train", *HELD, "--set", "beta=0", "--set", "learning_rate=0.0001", "--out", str(held)).returncode == 0
    proc = cli("recommend", str(held), "--out", str(refined), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rules = {f["rule"]: f for f in json.loads(proc.stdout)}
    assert "held_still" in rules and rules["held_still"]["change"].startswith("learning_rate: 0.0001 -> ")
    assert configlib.load(refined).learning_rate >= 3e-4
    assert cli("train", str(refined), *HELD[:2], "--out", str(freed)).returncode == 0
    last = [json.loads(x) for x in (held / "eval.jsonl").read_text().splitlines()]
    new = [json.loads(x) for x in (freed / "eval.jsonl").read_text().splitlines()]
    assert last[-1]["accuracy"] == last[0]["accuracy"]  # held still
    assert new[-1]["eval_reward"] > last[-1]["eval_reward"] and new[-1]["accuracy"] > last[-1]["accuracy"]
