"""`mechdiag check-reward`: degenerate completions scored by the task's real reward components under a config's
weights; a component that pays a failure more than a genuine wrong answer, and a reward that pays the format rather
than the answer, are flagged (exit 1); bad input exits 2 with one line."""

from __future__ import annotations

from mechdiag import config as configlib
from mechdiag.reward_check import FAILURES, check_reward
from mechdiag.tasks.arith import Arith

FORMAT_HEAVY = ("rewards.weights={correctness: 0.1, xml_count: 1.0, numeric: 1.0, format: 1.0, "
                "reasoning_nonempty: 0.5, answer_nonempty: 0.5}")


class LenientArith(Arith):
    """A reward whose numeric component defaults to full credit when it cannot read a number (a common bug)."""

    def components(self, completion, example):
        comps = super().components(completion, example)
        if "<answer>" not in completion:
            comps["numeric"] = 1.0
        return comps


def test_the_study_weights_pass_and_every_failure_scores_below_a_wrong_answer():
    check = check_reward(configlib.load(None, []), n=4)
    assert not check.flags
    wrong, right = check.scores["genuine_wrong"]["total"], check.scores["genuine_correct"]["total"]
    assert right - wrong == 2.0  # correctness is the whole difference under Table 6's math weights
    assert all(check.scores[f]["total"] < wrong for f in FAILURES)
    assert check.scores["empty"]["total"] == 0.0 and check.scores["format_only"]["format"] == 0.5


def test_format_over_correctness_is_flagged():
    check = check_reward(configlib.load(None, [FORMAT_HEAVY]), n=4)
    assert [f.what for f in check.flags] == ["correctness"]
    assert "2% of the maximum 4.1" in check.flags[0].message


def test_a_component_whose_default_beats_a_wrong_answer_is_flagged():
    cfg = configlib.load(None, [f"task.name={__name__}:LenientArith"])
    check = check_reward(cfg, n=2)
    flagged = {(f.what, f.message.split(" ")[2]) for f in check.flags}
    assert ("numeric", "empty") in flagged and ("numeric", "prompt") in flagged  # pays the empty and echo answers
    assert check.scores["empty"]["numeric"] == 0.5 and check.scores["genuine_wrong"]["numeric"] == 0.5


def test_cli_exit_codes(cli):
    ok = cli("check-reward", "--n", "2")
    assert ok.returncode == 0 and "ok: no failure" in ok.stdout
    bad = cli("check-reward", "--n", "2", "--set", FORMAT_HEAVY, "--format", "json")
    assert bad.returncode == 1 and '"what": "correctness"' in bad.stdout
    for args in (["missing.yaml"], ["--n", "0"], ["--set", "rewards.weights={corectness: 1.0}"]):
        proc = cli("check-reward", *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
