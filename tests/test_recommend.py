"""Rules on synthetic run directories built to show one symptom each; healthy runs give no change."""

import json
import math
import re

import pytest

from mechdiag import config as configlib
from mechdiag import recommend as R
from mechdiag.compare import side_by_side
from mechdiag.errors import UserError
from mechdiag.evidence import Signals
from mechdiag.paths import REPO_ROOT
from mechdiag.run import base_eval, final_eval, load_runs
from tests.helpers import assert_bad_input
from tests.synth import ends_heavy, write_run

FLAT = {"reward": (1.5, 1.6), "kl": 0.01}  # no reward rise and a low, flat KL: isolates the other rules


# The synthetic runs start from the study's anchor (beta 0.005, lr 2e-3), not from the embedded default.
STUDY = ["beta=0.005", "learning_rate=2e-3"]


def cfg_with(*overrides):
    return configlib.load(overrides=[*STUDY, *overrides])


def rec(tmp_path, cfg=None, name="run", **kw):
    write_run(tmp_path / name, cfg or cfg_with(), **kw)
    return R.recommend(load_runs([tmp_path / name]))


def fired(r):
    return {f.rule for f in r.findings}


def changed(r):
    return {c.key: c.new for c in r.changes}


def test_healthy_run_gives_no_change(tmp_path):
    r = rec(tmp_path)
    assert r.findings == []
    assert r.cfg == r.base_cfg
    assert "No rule fired" in r.header


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_is_robust_to_noise(tmp_path, seed):
    assert rec(tmp_path, seed=seed).findings == []


def test_low_diversity_low_reward_raises_temperature(tmp_path):
    r = rec(tmp_path, cfg_with("temperature=0.5"), reward_cv=0.04, frac_zero_std=0.7, **FLAT)
    assert fired(r) == {"low_diversity"}
    assert changed(r) == {"temperature": 0.7}
    f = r.findings[0]
    assert "reward_cv 0.0" in f.evidence and "< 0.1" in f.evidence and "steps 31-40" in f.evidence
    assert 0.5 <= f.confidence <= 0.95


def test_frac_zero_std_alone_fires(tmp_path):
    r = rec(tmp_path, cfg_with("temperature=0.8"), frac_zero_std=0.75, **FLAT)
    assert changed(r) == {"temperature": 1.0}
    assert "frac_zero_std" in r.findings[0].evidence and "reward_cv" not in r.findings[0].evidence


def test_low_diversity_high_reward_raises_upper_clip(tmp_path):
    r = rec(tmp_path, cfg_with("num_iterations=2"), reward=(2.8, 3.0), reward_cv=0.03, kl=0.01)  # 81% of max: high
    assert changed(r) == {"epsilon_high": 0.3}
    assert "eps_high" in r.findings[0].reason


def test_no_clip_change_where_the_clip_cannot_bind(tmp_path):
    """num_iterations 1: one update per rollout, the ratio is exactly 1, so epsilon_high is inert (two refined runs
    came out bit-identical to their sick runs): the temperature moves instead, and the reason says why."""
    r = rec(tmp_path, reward=(2.8, 3.0), reward_cv=0.03, kl=0.01)
    assert changed(r) == {"temperature": 1.2}
    assert "needs num_iterations > 1" in r.findings[0].reason
    r = rec(tmp_path, cfg_with("temperature=1.2"), name="capped", reward=(2.8, 3.0), reward_cv=0.03, kl=0.01)
    assert r.changes == [] and "epsilon" not in {c.key for c in r.changes}


def test_low_diversity_with_nothing_left_to_raise_is_advice_only(tmp_path, cli):
    cfg = cfg_with("temperature=1.2", "epsilon_high=0.3")
    r = rec(tmp_path, cfg, reward_cv=0.03, **FLAT)
    assert fired(r) == {"low_diversity"} and r.changes == []
    assert r.cfg == cfg
    assert "advice only" in r.header and "- advice [low_diversity" in r.header
    proc = cli("recommend", str(tmp_path / "run"))
    assert proc.returncode == 0 and "advice only" in proc.stdout


def _step_cut(r, lr):
    """kl_drift's learning rate: lr / sqrt(kl tail / KL_WORKING), at least halved."""
    kl = r.findings[0].data["kl_tail"]
    return pytest.approx(R._sig(lr / max(2.0, math.sqrt(kl / R.KL_WORKING))))


def test_kl_high_with_accuracy_falling_raises_beta_and_sizes_the_step(tmp_path):
    r = rec(tmp_path, reward=(1.5, 1.6), kl=(0.0, 0.2, 0.3), accuracy=(0.4, 0.3))
    assert fired(r) == {"kl_drift"}
    lr = r.base_cfg.learning_rate
    assert changed(r) == {"beta": pytest.approx(0.015), "learning_rate": _step_cut(r, lr)}
    assert changed(r)["learning_rate"] < lr / 4  # kl ~0.25: 25x a working run's, a step 5x too large
    assert "kl 0.2" in r.findings[0].evidence or "kl 0.3" in r.findings[0].evidence
    assert "eval accuracy 0.3" in r.findings[0].evidence


def test_rising_kl_below_high_still_fires(tmp_path):
    r = rec(tmp_path, reward=(1.5, 1.6), kl=(0.0, 0.02, 0.08), accuracy=(0.4, 0.3))
    assert changed(r) == {"beta": pytest.approx(0.015)}
    assert "kl rising" in r.findings[0].evidence


def test_high_kl_with_accuracy_rising_is_fine(tmp_path):
    assert rec(tmp_path, reward=(1.5, 1.6), kl=(0.0, 0.3), accuracy=(0.3, 0.5)).findings == []


def test_very_high_kl_cuts_the_learning_rate_further(tmp_path):
    r = rec(tmp_path, reward=(1.5, 1.6), kl=(0.2, 0.9), accuracy=(0.4, 0.2))
    assert changed(r) == {"beta": pytest.approx(0.015), "learning_rate": _step_cut(r, r.base_cfg.learning_rate)}
    assert "sqrt(kl / 0.01)" in r.findings[0].evidence


def test_beta_zero_without_kl_record_and_falling_accuracy(tmp_path):
    r = rec(tmp_path, cfg_with("beta=0"), reward=(1.5, 1.6), kl_recorded=False, accuracy=(0.4, 0.3))
    assert changed(r) == {"beta": R.BETA_FROM_ZERO}
    assert "kl not recorded" in r.findings[0].evidence


def test_reward_rising_accuracy_flat_reshapes_rewards(tmp_path):
    r = rec(tmp_path, reward=(1.0, 2.8), accuracy=(0.4, 0.4), kl=0.01,
            components={"correctness": (0.4, 0.4), "format": (0.1, 0.9)})
    assert fired(r) == {"reward_misalignment"}
    w = changed(r)["rewards.weights"]
    assert w["correctness"] == 4.0 and w["format"] == 0.25 and w["xml_count"] == 0.25
    assert w["reasoning_nonempty"] == 0.05
    assert "reward/correctness 0.4 -> 0.4, 0% of the rise" in r.findings[0].evidence
    assert str(r.changes[0]).startswith("rewards.weights: correctness 2 -> 4, xml_count 0.5 -> 0.25")


def test_reward_rise_paid_by_correctness_is_not_misalignment(tmp_path):
    # correctness 0.1 -> 0.8 at weight 2 pays 1.4 of the 1.8 rise: the reward is not the problem
    r = rec(tmp_path, reward=(1.0, 2.8), accuracy=(0.4, 0.4), kl=0.01,
            components={"correctness": (0.1, 0.8), "format": (0.5, 0.9)})
    assert r.findings == []


def test_high_clipped_ratio_raises_budget(tmp_path):
    r = rec(tmp_path, clipped=0.5, **FLAT)
    assert fired(r) == {"truncation"}
    assert changed(r) == {"max_completion_tokens": 72}


def test_length_pressing_on_budget_raises_it(tmp_path):
    """The bench/tune case: at a 24-token budget few completions are cut (2%), but their mean length sits at 85%
    of the budget, so the policy cannot lengthen its reasoning; at 60% of the budget nothing fires."""
    r = rec(tmp_path, cfg_with("max_completion_tokens=24"), clipped=0.02, length=20.5, **FLAT)
    assert fired(r) == {"truncation"} and changed(r) == {"max_completion_tokens": 40}
    assert "85% of the 24-token budget" in r.findings[0].evidence
    assert rec(tmp_path, cfg_with("max_completion_tokens=34"), name="roomy", clipped=0.02, length=20.5,
               **FLAT).findings == []
    assert rec(tmp_path, cfg_with("max_completion_tokens=24"), name="uncut", clipped=0.0, length=20.5,
               **FLAT).findings == []
    # 40 steps at 24 tokens: 10% cut at first, none at the end, the length parked at 86% of the cap
    r = rec(tmp_path, cfg_with("max_completion_tokens=24"), name="parked", clipped=(0.1, 0.0, 0.0), length=20.7,
            **FLAT)
    assert changed(r) == {"max_completion_tokens": 40} and "over steps 1-10" in r.findings[0].evidence


def test_budget_pressure_fixes_the_budget_first(tmp_path):
    """bench/tune's round 0 at 16 tokens: every completion cut at first, then the policy cut its reasoning short to
    fit (length 16 -> 11.8, clipped 1.0 -> 0.15), reward rose on the tags while accuracy fell and KL grew. The
    budget explains the other symptoms, so only it changes; kl_drift and reward_misalignment wait a round."""
    r = rec(tmp_path, cfg_with("max_completion_tokens=16", "beta=0"), clipped=(1.0, 0.2, 0.15),
            length=(16.0, 12.5, 11.8), accuracy=(0.094, 0.042), kl=(0.0, 0.15, 0.3), reward=(0.7, 1.8), reward_cv=0.3)
    assert {"truncation", "kl_drift"} <= fired(r)
    assert changed(r) == {"max_completion_tokens": 48}  # under 24 tokens no answer fits: twice that floor
    trunc = next(f for f in r.findings if f.rule == "truncation")
    assert "the policy shortened its completions to fit the budget" in trunc.evidence
    assert re.search(r"completion_length 15\.\d+ -> 12 \(-21%\) by steps 31-40", trunc.evidence), trunc.evidence
    kl = next(f for f in r.findings if f.rule == "kl_drift")
    assert kl.changes == [] and "deferred: truncation" in kl.reason
    # without the budget symptom the same KL rise is treated
    r2 = rec(tmp_path, cfg_with("max_completion_tokens=16", "beta=0"), name="kl_only", clipped=0.0, length=11.8,
             accuracy=(0.094, 0.042), kl=(0.0, 0.15, 0.3), reward=(0.7, 1.8), reward_cv=0.3)
    assert "truncation" not in fired(r2) and "beta" in changed(r2)


def test_clipped_ratio_at_budget_cap_is_advice(tmp_path):
    r = rec(tmp_path, cfg_with("max_completion_tokens=1024"), clipped=0.5, **FLAT)
    assert fired(r) == {"truncation"} and r.changes == []
    assert "penalise length" in r.findings[0].reason


def test_displacement_at_the_ends_reduces_layers(tmp_path):
    r = rec(tmp_path, layer_mass=ends_heavy(8, 6.0), **FLAT)
    assert fired(r) == {"reduced_layers"}
    assert changed(r) == {"lora.layers": "first2+last2"}
    assert "displacement" in r.findings[0].evidence


def test_moderate_end_concentration_needs_a_regression(tmp_path):
    assert rec(tmp_path, name="a", layer_mass=ends_heavy(8, 3.0), **FLAT).findings == []
    r = rec(tmp_path, name="b", layer_mass=ends_heavy(8, 3.0), accuracy=(0.4, 0.3), **FLAT)
    assert "reduced_layers" in fired(r) and "accuracy 0.3" in r.findings[-1].evidence


def test_shift_at_the_last_layers_reduces_layers(tmp_path):
    r = rec(tmp_path, shift=lambda layer: 0.1 if layer >= 6 else 0.01, **FLAT)
    assert changed(r) == {"lora.layers": "first2+last2"}
    assert "shift.shift" in r.findings[0].evidence


def test_already_reduced_layers_do_not_fire(tmp_path):
    cfg = cfg_with("lora.layers=first2+last2")
    assert rec(tmp_path, cfg, shift=lambda layer: 0.1 if layer >= 6 else 0.01, **FLAT).findings == []


def test_concentrated_module_mass_reduces_modules(tmp_path):
    mass = {m: 1.0 for m in configlib.ALL_MODULES} | {"v_proj": 8.0, "o_proj": 8.0}
    r = rec(tmp_path, module_mass=mass, **FLAT)
    assert fired(r) == {"reduced_modules"}
    assert sorted(changed(r)["lora.target_modules"]) == ["o_proj", "v_proj"]
    assert "v_proj 38%" in r.findings[0].evidence or "o_proj 38%" in r.findings[0].evidence


def test_module_mass_ignores_tensors_lora_does_not_adapt(tmp_path):
    mass = {m: 1.0 for m in configlib.ALL_MODULES} | {"v_proj": 8.0, "o_proj": 8.0}
    write_run(tmp_path / "run", module_mass=mass, **FLAT)
    rows = [{"step": 40, "name": "model.embed_tokens.weight", "layer": None, "module": "embed_tokens",
             "ref_fro": 1.0, "delta_fro": 10.0, "rel_fro": 10.0},
            {"step": 40, "name": "model.layers.0.input_layernorm.weight", "layer": 0,
             "module": "input_layernorm", "ref_fro": 1.0, "delta_fro": 0.5, "rel_fro": 0.5}]
    with open(tmp_path / "run" / "displacement.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    r = R.recommend(load_runs([tmp_path / "run"]))
    assert changed(r) == {"lora.target_modules": ["v_proj", "o_proj"]}


def test_module_mass_is_size_normalised(tmp_path):
    # gate/up move 3x the Frobenius norm of the others, but they are 3x bigger matrices: no concentration
    write_run(tmp_path / "run", **FLAT)
    path = tmp_path / "run" / "displacement.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        if r["module"] in ("gate_proj", "up_proj"):
            r["delta_fro"] *= 3.0
            r["ref_fro"] *= 3.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert R.recommend(load_runs([tmp_path / "run"])).findings == []
    for r in rows:
        r["ref_fro"] = 1.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = R.recommend(load_runs([tmp_path / "run"]))
    assert sorted(changed(r)["lora.target_modules"]) == ["gate_proj", "up_proj"]


def test_mildly_uneven_module_mass_does_not_fire(tmp_path):
    mass = {m: 1.0 for m in configlib.ALL_MODULES} | {"v_proj": 1.5}
    assert rec(tmp_path, module_mass=mass, **FLAT).findings == []


STALLED = {"accuracy": (0.4, 0.4)}  # held-out accuracy that did not move: entropy's cost


def test_entropy_collapse_raises_temperature_then_beta(tmp_path):
    r = rec(tmp_path, cfg_with("temperature=0.8"), name="a", entropy=(1.5, 0.1), **FLAT, **STALLED)
    assert fired(r) == {"entropy_collapse"} and changed(r) == {"temperature": 1.0}
    assert "eval accuracy stalled 0.4" in r.findings[0].evidence
    r = rec(tmp_path, cfg_with("temperature=1.2"), name="b", entropy=(1.5, 0.1), **FLAT, **STALLED)
    assert changed(r) == {"beta": pytest.approx(0.015)}


def test_entropy_falling_while_accuracy_rises_with_diverse_groups_changes_nothing(tmp_path):
    """The embedded default's shape (issue 14): greedy-ish entropy 0.08 -> 0.02, accuracy +42 points, reward CV
    steady. A sharper policy is what RL is for; with no cost beside it nothing fires."""
    r = rec(tmp_path, name="default", entropy=(0.08, 0.02), accuracy=(0.38, 0.80), reward_cv=0.23, **FLAT)
    assert r.findings == [] and r.cfg == r.base_cfg
    # relative to the run's own start, not an absolute floor: 0.078 -> 0.045 is not a collapse, even when stalled
    r = rec(tmp_path, name="low_start", entropy=(0.078, 0.045), reward_cv=0.23, **FLAT, **STALLED)
    assert "entropy_collapse" not in fired(r)


def test_entropy_collapse_fires_on_each_cost(tmp_path):
    # reward CV halved (not yet low enough for low_diversity), accuracy rising
    r = rec(tmp_path, cfg_with("temperature=0.8"), name="cv", entropy=(1.5, 0.1), reward_cv=(0.5, 0.15), **FLAT)
    assert fired(r) == {"entropy_collapse"} and changed(r) == {"temperature": 1.0}
    assert "with reward_cv 0.4" in r.findings[0].evidence and "accuracy" not in r.findings[0].evidence
    # sampled pass@4 falling while greedy accuracy rises
    r = rec(tmp_path, cfg_with("temperature=0.8"), name="pk", entropy=(1.5, 0.1), pass_k={"pass@4": (0.7, 0.55)},
            **FLAT)
    assert fired(r) == {"entropy_collapse"} and "pass@4 0.7 (best) -> 0.55" in r.findings[0].evidence
    # the same pass@4 holding up: no cost, no finding
    assert rec(tmp_path, name="pk_ok", entropy=(1.5, 0.1), pass_k={"pass@4": (0.7, 0.72)}, **FLAT).findings == []


def test_one_key_is_changed_by_the_first_rule_only(tmp_path):
    r = rec(tmp_path, cfg_with("temperature=0.6"), reward_cv=0.03, entropy=(1.5, 0.1), **FLAT, **STALLED)
    assert fired(r) == {"low_diversity", "entropy_collapse"}
    assert changed(r) == {"temperature": 0.8}
    assert "already changed by low_diversity" in r.findings[1].reason


def test_early_saturation_asks_for_harder_data(tmp_path):
    r = rec(tmp_path, reward=(3.45, 3.6), frac_zero_std=0.8, reward_cv=0.02, kl=0.01)
    assert fired(r) == {"early_saturation"}  # low_diversity defers: equal rewards of a solved task
    assert changed(r) == {"task.options": {"difficulty": 3}}


def test_saturation_at_hardest_level_is_advice(tmp_path):
    r = rec(tmp_path, cfg_with("task.options={difficulty: 4}"), reward=(3.45, 3.6), kl=0.01)
    assert fired(r) == {"early_saturation"} and r.changes == []


def test_late_saturation_is_healthy(tmp_path):
    assert rec(tmp_path, reward=(1.0, 3.4, 3.6), kl=0.01).findings == []


def test_refined_config_round_trips_with_header(tmp_path, cli):
    write_run(tmp_path / "run", cfg_with("temperature=0.5", "beta=0"), reward_cv=0.03, kl_recorded=False,
              accuracy=(0.4, 0.3), reward=(1.5, 1.6), layer_mass=ends_heavy(8, 6.0))
    out = tmp_path / "refined.yaml"
    proc = cli("recommend", str(tmp_path / "run"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    again = configlib.load(out)
    expected = R.recommend(load_runs([tmp_path / "run"])).cfg
    assert again == expected
    assert (again.temperature, again.beta, again.lora.layers) == (0.7, R.BETA_FROM_ZERO, "first2+last2")
    head = [ln for ln in out.read_text().splitlines() if ln.startswith("#")]
    assert any("temperature: 0.5 -> 0.7" in ln and "[low_diversity" in ln for ln in head)
    assert any("beta: 0 -> 0.005" in ln and "[kl_drift" in ln for ln in head)
    assert any("lora.layers: all -> first2+last2" in ln for ln in head)
    assert "refined config with 3 change(s)" in proc.stdout


def test_json_records(tmp_path, cli):
    write_run(tmp_path / "run", clipped=0.5, **FLAT)
    proc = cli("recommend", str(tmp_path / "run"), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    recs = json.loads(proc.stdout)
    assert len(recs) == 1
    r = recs[0]
    assert {"rule", "symptom", "evidence", "change", "confidence"} <= set(r)
    assert r["rule"] == "truncation" and r["change"] == "max_completion_tokens: 48 -> 72"
    assert isinstance(r["confidence"], float) and r["evidence.clipped_tail"] > 0.4
    assert all(not isinstance(v, (dict, list)) for v in r.values())


def test_healthy_cli_says_so_and_copies_config(tmp_path, cli):
    write_run(tmp_path / "run")
    out = tmp_path / "same.yaml"
    proc = cli("recommend", str(tmp_path / "run"), "--out", str(out))
    assert proc.returncode == 0 and "healthy: no rule fired" in proc.stdout
    assert configlib.load(out) == configlib.load(tmp_path / "run" / "config.yaml")
    proc = cli("recommend", str(tmp_path / "run"), "--format", "json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == []


def test_seeds_pool_and_treatments_compare(tmp_path, cli):
    base = cfg_with("temperature=0.6")
    treated = cfg_with("temperature=0.9")
    paths = []
    for seed, acc in ((42, 0.40), (3407, 0.42)):
        write_run(tmp_path / f"base-{seed}", base.model_copy(update={"seed": seed}), seed=seed, accuracy=(0.2, acc))
        paths.append(tmp_path / f"base-{seed}")
    for seed, acc in ((42, 0.55), (3407, 0.57)):
        write_run(tmp_path / f"t-{seed}", treated.model_copy(update={"seed": seed}), seed=seed, accuracy=(0.2, acc),
                  clipped=0.5)
        paths.append(tmp_path / f"t-{seed}")
    records = side_by_side(load_runs(paths))
    acc = {r["group"]: r for r in records if r["metric"] == "accuracy"}
    assert set(acc) == {"temperature=0.6", "temperature=0.9"}
    assert acc["temperature=0.9"]["mean"] == pytest.approx(0.56, abs=0.01)
    assert acc["temperature=0.9"]["std"] == pytest.approx(0.0141, abs=0.005)
    assert acc["temperature=0.9"]["verdict"] == "helped" and acc["temperature=0.6"]["verdict"] == "baseline"
    assert acc["temperature=0.9"]["delta"] == pytest.approx(0.15, abs=0.01)
    assert acc["temperature=0.9"]["vs_base"] == pytest.approx(0.36, abs=0.01)  # base accuracy 0.2
    # the rules read the best group (the treated one, which truncates)
    r = R.recommend(load_runs(paths))
    assert fired(r) == {"truncation"} and r.base_cfg.temperature == 0.9
    proc = cli("recommend", *map(str, paths))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"0\.55\d* ± 0\.01\d* \(\+0\.35\d", proc.stdout)  # accuracy; the synthetic runs sample no pass@k
    assert "temperature=0.9 vs temperature=0.6: accuracy +0.15" in proc.stdout and "(helped)" in proc.stdout


def test_overlapping_seeds_are_within_noise(tmp_path):
    paths = []
    for name, temp, accs in (("a", 0.6, (0.40, 0.50)), ("b", 0.9, (0.42, 0.52))):
        for seed, acc in zip((1, 2), accs, strict=True):
            write_run(tmp_path / f"{name}{seed}", cfg_with(f"temperature={temp}", f"seed={seed}"), accuracy=(0.2, acc))
            paths.append(tmp_path / f"{name}{seed}")
    acc = [r for r in side_by_side(load_runs(paths)) if r["metric"] == "accuracy"]
    assert acc[-1]["verdict"] == "within seed noise"


def test_bad_inputs_exit_2_one_line(tmp_path, cli):
    assert_bad_input(cli("recommend", str(tmp_path / "missing")))
    empty = tmp_path / "noconfig"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "reward": 1.0}\n')
    proc = cli("recommend", str(empty))  # metrics.jsonl without config.yaml: another loop's log (readers)
    assert proc.returncode == 0 and "too few records" in proc.stdout, proc.stderr
    write_run(tmp_path / "corrupt")
    (tmp_path / "corrupt" / "metrics.jsonl").write_text('{"step": 1, "reward": 1.0}\n{not json\n')
    proc = cli("recommend", str(tmp_path / "corrupt"))
    assert_bad_input(proc)
    assert "corrupt" in proc.stderr
    write_run(tmp_path / "badcfg")
    (tmp_path / "badcfg" / "config.yaml").write_text("temperature: -3\n")
    assert_bad_input(cli("recommend", str(tmp_path / "badcfg")))


def test_no_records_is_bad_input(tmp_path):
    rd = tmp_path / "bare"
    rd.mkdir()
    configlib.save(configlib.load(), rd / "config.yaml")
    with pytest.raises(UserError, match="nothing to diagnose"):
        R.recommend(load_runs([rd]))


def test_every_threshold_and_rule_is_documented():
    doc = (REPO_ROOT / "docs" / "recommendations.md").read_text()
    constants = [k for k, v in vars(R).items() if k.isupper() and isinstance(v, (int, float, tuple))]
    assert len(constants) > 30
    missing = [k for k in constants if f"`{k}`" not in doc]
    assert missing == []
    assert [name for name, _, _ in R.RULES if f"`{name}`" not in doc] == []


def test_flat_summary_keys_give_base_and_final(tmp_path):

    write_run(tmp_path / "run", n_evals=2)
    (tmp_path / "run" / "eval.jsonl").write_text("")
    (tmp_path / "run" / "summary.json").write_text('{"base_accuracy": 0.25, "final_accuracy": 0.5, "steps": 40}')
    run = load_runs([tmp_path / "run"])[0]
    assert base_eval(run) == {"accuracy": 0.25} and final_eval(run) == {"accuracy": 0.5}


def test_nothing_solved_at_max_temperature_asks_for_easier_data(tmp_path):
    r = rec(tmp_path, cfg_with("temperature=1.2"), reward=0.05, frac_zero_std=0.95, reward_cv=0.0, kl=0.01)
    assert fired(r) == {"low_diversity"}
    assert changed(r) == {"task.options": {"difficulty": 1}}
    assert "easier data" in r.findings[0].reason


NO_TAGS = [{"completion": "the answer is 12 apples", "truncated": False, "reward": 0.0}] * 16
WELL_FORMED = [{"completion": "<reasoning>3+4=7</reasoning><answer>7</answer>", "truncated": False}] * 16
ZERO = {"reward": 0.0, "reward_cv": 0.0, "frac_zero_std": 1.0, "kl": 0.0, "accuracy": 0.0, "entropy": (1.0, 0.9),
        "noise": 0.0}


def test_zero_reward_throughout_names_the_format_as_the_cause(tmp_path):
    """Issue 14: a run whose reward is 0 throughout was told to raise the temperature. The base never writes the
    rewarded format: no learning signal, and no sampling change can create one."""
    r = rec(tmp_path, cfg_with("temperature=0.8"), samples=NO_TAGS, components={"correctness": 0.0}, **ZERO)
    assert "no_signal" in fired(r)
    f = next(f for f in r.findings if f.rule == "no_signal")
    assert f.data["cause"] == "format never produced" and "0% of 16 sampled completions close an <answer>" \
        in f.evidence
    assert "format" in f.reason and "SFT" in f.reason
    assert r.changes == [] and r.cfg == r.base_cfg  # low_diversity's temperature waits: no signal explains it
    low = next(f for f in r.findings if f.rule == "low_diversity")
    assert "deferred: no_signal" in low.reason
    # a rambling base cut at the budget without ever opening a tag: the format, not the budget, is the cause
    rambling = [{"completion": "Once upon a time there was a cat who", "truncated": True}] * 16
    r = rec(tmp_path, name="rambling", samples=rambling, clipped=1.0, **ZERO)
    f = next(f for f in r.findings if f.rule == "no_signal")
    assert f.data["cause"] == "format never produced" and "100% cut at the budget" in f.evidence
    assert r.changes == []


def test_no_signal_from_truncation_raises_the_budget(tmp_path):
    cut = [{"completion": "<reasoning>3+4=7;7*2=1", "truncated": True}] * 16
    r = rec(tmp_path, samples=cut, clipped=0.9, **ZERO)
    f = next(f for f in r.findings if f.rule == "no_signal")
    assert f.data["cause"] == "budget too short" and "90% of completions cut" in f.evidence
    assert changed(r) == {"max_completion_tokens": 72}
    assert next(f for f in r.findings if f.rule == "truncation").changes == []  # one rule per key


def test_no_correct_answer_throughout_asks_for_easier_data(tmp_path):
    r = rec(tmp_path, samples=WELL_FORMED, **{**ZERO, "reward": 1.7}, components={"correctness": 0.0})
    f = next(f for f in r.findings if f.rule == "no_signal")
    assert f.data["cause"] == "task too hard" and "100% of sampled completions are well-formed" in f.evidence
    assert changed(r) == {"task.options": {"difficulty": 1}}


def test_some_correct_answers_are_a_signal(tmp_path):
    r = rec(tmp_path, samples=WELL_FORMED, reward=(0.2, 0.3), components={"correctness": (0.0, 0.02)},
            accuracy=(0.0, 0.01), kl=0.01)
    assert "no_signal" not in fired(r)


def test_too_few_records_is_never_healthy(tmp_path, cli):
    r = rec(tmp_path, steps=2)
    assert fired(r) == {"too_few_records"} and r.changes == []
    assert "too few records to judge (2 < 8" in r.findings[0].evidence
    proc = cli("recommend", str(tmp_path / "run"))
    assert proc.returncode == 0 and "healthy" not in proc.stdout and "too few records to judge (2 < 8" in proc.stdout
    # a short run: a level that holds at any record (90% cut at the budget) is read, a trend (KL rising while
    # accuracy falls) is not
    cut = rec(tmp_path, name="short_cut", steps=5, clipped=0.9)
    assert fired(cut) == {"too_few_records", "truncation"} and "max_completion_tokens" in changed(cut)
    assert "rest on these few records" in cut.findings[0].reason
    assert fired(rec(tmp_path, name="short_drift", steps=5, reward=(1.5, 1.6), kl=(0.0, 0.2, 0.3),
                     accuracy=(0.4, 0.3))) == {"too_few_records"}
    assert "kl_drift" in fired(rec(tmp_path, name="long_drift", reward=(1.5, 1.6), kl=(0.0, 0.2, 0.3),
                                   accuracy=(0.4, 0.3)))
    assert "too_few_records" not in fired(rec(tmp_path, name="enough", steps=8))


def test_max_reward_uses_the_tasks_weights(tmp_path):
    """MCQ's Table 6 weights sum to 3.5 (math 3.7, code 3.1): saturation is judged against the right maximum."""

    for task, best in (("arith", 3.7), ("arc", 3.5), ("mbpp", 3.1)):
        write_run(tmp_path / task, cfg_with(f"task.name={task}"))
        assert Signals.from_runs(load_runs([tmp_path / task])).max_reward == pytest.approx(best)
    # 3.2 is 91% of MCQ's maximum (saturated) but 86% of math's
    assert "early_saturation" in fired(rec(tmp_path, cfg_with("task.name=arc"), name="arc_sat", reward=(3.2, 3.25),
                                           kl=0.01))
    assert "early_saturation" not in fired(rec(tmp_path, name="math_sat", reward=(3.2, 3.25), kl=0.01))


RULE_CASES = {  # for every rule, a run that shows its symptom; write_run's defaults are the healthy run
    "too_few_records": {"steps": 2},
    "component_never_pays": {"components": {"xml_count": (0.0, 0.0)}},
    "run_crashed": {"ended": {"error": "RuntimeError: CUDA out of memory", "planned_steps": 100}},
    "no_signal": {"samples": NO_TAGS, **ZERO},
    "early_saturation": {"reward": (3.45, 3.6), "frac_zero_std": 0.8, "reward_cv": 0.02, "kl": 0.01},
    "low_diversity": {"reward_cv": 0.04, "frac_zero_std": 0.7, **FLAT},
    "kl_drift": {"reward": (1.5, 1.6), "kl": (0.0, 0.2, 0.3), "accuracy": (0.4, 0.3)},
    "reward_misalignment": {"reward": (1.0, 2.8), "accuracy": (0.4, 0.4), "kl": 0.01,
                            "components": {"correctness": (0.4, 0.4), "format": (0.1, 0.9)}},
    "truncation": {"clipped": 0.5, **FLAT},
    "reduced_layers": {"layer_mass": ends_heavy(8, 6.0), **FLAT},
    "reduced_modules": {"module_mass": {m: 1.0 for m in configlib.ALL_MODULES} | {"v_proj": 8.0, "o_proj": 8.0},
                        **FLAT},
    "entropy_collapse": {"entropy": (1.5, 0.1), **FLAT, **STALLED},
    "sampler_mismatch": {"sampler_gap": (1e-4, 2e-3)},
    "held_still": {"kl": 0.001, "reward": (1.5, 1.5), "accuracy": (0.4, 0.4), "frac_zero_std": 0.2,
                   "eval_reward": (1.5, 1.5)},
    "no_update": {"kl": 0.0, "noise": 0.0},  # the groups differ (frac_zero_std 0.1), yet KL never leaves 0
    "cannot_judge": {"drop": ("reward",), "eval_reward": None},
    "kl_blowup": {"kl": (0.01, 1.5, 2.0)},
    "entropy_rise": {"entropy": (0.3, 1.2), **FLAT},
    "reward_declined": {"reward": (1.0, 2.0, 1.0), "accuracy": (0.4, 0.4)},
    "no_progress": {"reward": (1.0, 1.0), "accuracy": None, "kl_recorded": False},
    "length_collapse": {"length": (30.0, 4.0)},
    "narrow_lora": {"cfg": cfg_with("lora.target_modules=[v_proj,o_proj]"), **STALLED},
    "degenerate_text": {"samples": [{"completion": "so so so so so so so so so so so so so so so", "reward": 1.0}] * 8},
    "step_too_large": {"kl": (0.0, 2.0, 6.0), "accuracy": (0.4, 0.0), "reward": (1.5, 0.2)},
    "correctness_unpaid": {"cfg": cfg_with("rewards.weights={correctness: 0.1, xml_count: 1.0, format: 1.0}")},
    "group_small": {"cfg": cfg_with("group_size=2", "prompts_per_step=32"), "frac_zero_std": 0.6, **FLAT},
    "clip_tight": {"cfg": cfg_with("num_iterations=4", "epsilon=0.005"), "clip_fraction": 0.6, **FLAT},
    "sampling_too_hot": {"cfg": cfg_with("temperature=2.0"), "components": {"correctness": 0.05},
                         "accuracy": (0.4, 0.4), **FLAT},
    "lora_narrow": {"cfg": cfg_with("lora.r=1", "lora.layers=[0]", "lora.target_modules=[q_proj]"), "kl": 0.001,
                    "reward": (1.5, 1.5), "accuracy": (0.4, 0.4), "frac_zero_std": 0.2, "eval_reward": (1.5, 1.5)},
}


@pytest.mark.parametrize("name", [name for name, _, _ in R.RULES])
def test_every_rule_has_a_run_that_fires_it_and_the_healthy_run_does_not(tmp_path, name):
    assert name in RULE_CASES, f"rule {name} has no test run that should fire it"
    assert name in fired(rec(tmp_path, name="sick", **RULE_CASES[name]))
    assert name not in fired(rec(tmp_path, name="healthy"))


def test_sampler_mismatch_treats_the_sampler_precision_first(tmp_path):
    """A lower-precision sampler is sampled at the update's precision; otherwise the off-policy sequence mask."""
    low = rec(tmp_path, cfg_with("sampler_dtype=bfloat16"), name="bf16", sampler_gap=0.02)
    assert changed(low) == {"sampler_dtype": None}
    r = rec(tmp_path, name="vllm", sampler_gap=(1e-4, 2e-3))  # growing past SAMPLER_GAP_HIGH
    assert changed(r) == {"off_policy_mask_threshold": R.OFF_POLICY_MASK_TARGET}
    assert configlib.from_dict(r.cfg.model_dump()).off_policy_mask_threshold == R.OFF_POLICY_MASK_TARGET
    assert "sampler_mismatch" not in fired(rec(tmp_path, name="floor", sampler_gap=2e-6))  # float32's rounding


def test_every_trl_option_can_be_prescribed():
    """recommend (and tune, which trains its refined config) sets TRL 1.16's options as Config fields; each lands
    in the refined config and in the TRL snippet under GRPOConfig's own name."""
    from mechdiag.integrations.trl_args import SAME_FIELDS, trl_snippet

    new = {"loss_type": "cispo", "importance_sampling_level": "sequence", "delta": 1.5,
           "mask_truncated_completions": True, "top_entropy_quantile": 0.2, "entropy_coef": 0.01,
           "use_bias_correction_kl": True, "multi_objective_aggregation": "normalize_then_sum",
           "sapo_temperature_pos": 1.1, "sapo_temperature_neg": 1.2, "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5,
           "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5, "off_policy_mask_threshold": 0.5, "top_k": 20,
           "min_p": 0.05, "repetition_penalty": 1.1, "use_adaptive_entropy": True, "entropy_coef_min": 0.001,
           "entropy_coef_max": 0.5, "entropy_coef_delta": 0.01, "entropy_target": 1.0, "steps_per_generation": 8,
           "sync_ref_model": False, "ref_model_mixup_alpha": 0.9, "ref_model_sync_steps": 64}
    assert set(SAME_FIELDS) <= set(new)
    cfg = cfg_with("grad_accum=4")
    changes = [R.Change(k, getattr(cfg, k), v) for k, v in new.items()]
    refined = R.apply(cfg, [R.Finding("r", "s", "e", changes, "why", 1.0)])
    assert {k: getattr(refined, k) for k in new} == new
    snippet = trl_snippet(changes, cfg)
    assert all(f"{k}={v!r}" in snippet for k, v in new.items()), snippet


# ---- sick starts: each treatment sized from the evidence (bench/clinic.py re-trains them) --------------------
def test_held_still_sizes_the_learning_rate_from_how_far_kl_sits_under_a_working_run(tmp_path):
    """lr 50x too low on the embedded default left KL at ~5e-6 (clinic): x10 did not cure it; the factor is
    sqrt(KL_WORKING / kl), bounded."""
    still = dict(reward=(1.5, 1.5), accuracy=(0.4, 0.4), frac_zero_std=0.2, eval_reward=(1.5, 1.5), noise=0.0,
                 steps=12)  # the clinic's length: a working run's KL is KL_WORKING
    r = rec(tmp_path, cfg_with("beta=0", "learning_rate=2e-5"), kl=4e-6, **still)
    assert changed(r) == {"learning_rate": pytest.approx(1e-3)}  # sqrt(0.01 / 4e-6) = 50
    assert "sqrt(0.01 / kl) = 50" in r.findings[0].evidence
    r = rec(tmp_path, cfg_with("beta=0", "learning_rate=5e-4"), name="near", kl=0.005, **still)
    assert changed(r) == {"learning_rate": pytest.approx(1.5e-3)}  # sqrt(2) = 1.4, at least LR_FREE_MIN = 3


def test_a_longer_run_is_held_still_against_a_longer_working_run(tmp_path):
    """A working run's KL grows with its steps (12 steps: 0.01; 20: 0.033; 40: 0.048 on the embedded default): the
    same KL after 20 steps sits further under a working run's, so the step grows more; after 40 it levels off."""
    still = dict(reward=(1.5, 1.5), accuracy=(0.4, 0.4), frac_zero_std=0.2, eval_reward=(1.5, 1.5), noise=0.0)
    got = {n: changed(rec(tmp_path, cfg_with("beta=0", "learning_rate=1e-5"), name=f"s{n}", kl=1e-6, steps=n,
                          **still))["learning_rate"] for n in (12, 20, 40, 80)}
    assert got[12] == pytest.approx(1e-3)  # sqrt(0.01 / 1e-6) = 100, the most one round gives
    got = {n: changed(rec(tmp_path, cfg_with("beta=0", "learning_rate=1e-5"), name=f"t{n}", kl=1e-5, steps=n,
                          **still))["learning_rate"] for n in (12, 20, 40, 80)}
    assert got[12] == pytest.approx(R._sig(1e-5 * math.sqrt(0.01 / 1e-5)))
    assert got[20] == pytest.approx(R._sig(1e-5 * math.sqrt(0.01 * (20 / 12) ** 2 / 1e-5)))
    assert got[40] == got[80] == pytest.approx(R._sig(1e-5 * math.sqrt(R.KL_WORKING_MAX / 1e-5)))


def test_a_gain_the_evals_noise_could_make_is_no_gain(tmp_path):
    """LoRA r 2 on v_proj alone (clinic --magnitudes): KL 10x under a working run's and +2 points on 200 held-out
    problems, inside the eval's 2 SE (7 points): held still. The same gain measured on 20,000 problems is real."""
    kw = dict(kl=0.0015, reward=(1.5, 1.5), accuracy=(0.365, 0.39), frac_zero_std=0.2, eval_reward=(1.5, 1.52),
              noise=0.0)
    r = rec(tmp_path, cfg_with("beta=0", "learning_rate=1e-3", "eval_n=200"), name="small", steps=12, **kw)
    factor = max(R.LR_FREE_MIN, math.sqrt(R.KL_WORKING / 0.0015))
    assert "held_still" in fired(r) and changed(r) == {"learning_rate": pytest.approx(R._sig(1e-3 * factor))}
    assert "2 SE of the eval's noise" in r.findings[0].evidence
    assert "held_still" not in fired(rec(tmp_path, cfg_with("beta=0", "eval_n=20000"), name="big", steps=12, **kw))


def test_beta_beyond_its_range_is_freed_even_while_accuracy_creeps_up(tmp_path):
    """beta 2.0 and 0.5: accuracy rose a little, so the flat-accuracy test never fired; an anchor above BETA_MAX
    holding the KL under KL_STILL is the finding."""
    for beta in (2.0, 0.5):
        r = rec(tmp_path, cfg_with(f"beta={beta}"), name=f"b{beta}", kl=0.002, accuracy=(0.37, 0.44), **{
            "reward": (1.5, 1.7)})
        assert "held_still" in fired(r) and changed(r)["beta"] == 0.01
    assert "held_still" not in fired(rec(tmp_path, cfg_with("beta=0.1"), name="b01", kl=0.002, accuracy=(0.37, 0.44)))


def test_a_blown_up_policy_gets_a_smaller_step_sized_by_its_kl_and_nothing_else(tmp_path):
    r = rec(tmp_path, cfg_with("beta=0", "learning_rate=4e-2"), kl=(0.0, 3.0, 6.0), accuracy=(0.4, 0.0),
            reward=(1.5, 0.2), clipped=(0.0, 0.9), frac_zero_std=0.9, noise=0.0)
    assert changed(r) == {"learning_rate": pytest.approx(4e-2 / 24, rel=0.05)}  # sqrt(6 / 0.01) = 24.5
    assert {"truncation", "low_diversity"} <= fired(r)  # still reported, their changes wait
    assert all(not f.changes for f in r.findings if f.rule != "step_too_large")


def test_small_groups_grow_at_the_same_rollouts(tmp_path):
    r = rec(tmp_path, cfg_with("group_size=2", "prompts_per_step=32"), frac_zero_std=0.6, noise=0.0, **FLAT)
    assert changed(r) == {"group_size": 8, "prompts_per_step": 8}  # 0.6^2 = 0.36 > 0.25, 0.6^4 = 0.13
    assert "low_diversity" in fired(r) and "temperature" not in changed(r)


def test_a_still_policy_with_small_groups_waits_for_them_only_when_they_explain_it(tmp_path):
    """group_size 2, 60% of groups alike: groups of 8 give (1 - 0.6^4) / (1 - 0.6) = 2.2x the groups that differ,
    KL x 4.7. KL 0.009 x 4.7 reaches a working 40-step run's 0.04: larger groups are the cure, held_still changes
    nothing. A KL far under it, or a beta beyond any working range: the config's own cause, changed beside them."""
    still = {"reward": (1.5, 1.5), "accuracy": (0.4, 0.4), "eval_reward": (1.5, 1.5), "frac_zero_std": 0.6,
             "noise": 0.0}
    near = rec(tmp_path, cfg_with("group_size=2", "prompts_per_step=32", "beta=0"), name="near", kl=0.009, **still)
    held = next(f for f in near.findings if f.rule == "held_still")
    assert held.changes == [] and "group_small" in held.reason and "kl x 4.7" in held.evidence
    assert changed(near) == {"group_size": 8, "prompts_per_step": 8}
    far = rec(tmp_path, cfg_with("group_size=2", "prompts_per_step=32", "beta=0", "learning_rate=1e-5"), name="far",
              kl=0.0002, **still)
    assert changed(far)["group_size"] == 8 and changed(far)["learning_rate"] > 1e-5
    anchored = rec(tmp_path, cfg_with("group_size=2", "prompts_per_step=32", "beta=2"), name="anchored", kl=0.008,
                   **still)
    assert changed(anchored)["group_size"] == 8 and changed(anchored)["beta"] == 0.01


def test_a_tight_clip_widens_where_it_binds(tmp_path):
    # in the working range's tenth and above: sized by the exponential model, 0.03 / ln(1 / 0.6) * ln(1 / 0.05)
    r = rec(tmp_path, cfg_with("num_iterations=4", "epsilon=0.03"), clip_fraction=0.6, noise=0.0, **FLAT)
    assert changed(r) == {"epsilon": pytest.approx(0.176, abs=0.001)}
    assert "clip_tight" not in fired(rec(tmp_path, cfg_with("epsilon=0.005"), name="one", clip_fraction=0.6, **FLAT))


def test_small_groups_under_the_usual_rollouts_grow_to_them(tmp_path):
    """group_size 2 x 8 prompts (16 rollouts) in the clinic: the same 16 rollouts as 16 x 1 did not cure it; the
    groups grow and the prompts stay, up to the usual 64 rollouts per step."""
    r = rec(tmp_path, cfg_with("group_size=2", "prompts_per_step=8"), frac_zero_std=0.6, noise=0.0, **FLAT)
    assert changed(r) == {"group_size": 8}
    assert "64 rollouts per step instead of 16" in next(f for f in r.findings if f.rule == "group_small").reason
    r = rec(tmp_path, cfg_with("group_size=2", "prompts_per_step=8"), name="worse", frac_zero_std=0.8, noise=0.0,
            **FLAT)
    assert changed(r) == {"group_size": 16, "prompts_per_step": 4}  # 0.8^4 = 0.41 > 0.25, 0.8^8 = 0.17


def test_an_epsilon_off_the_working_range_goes_to_it(tmp_path):
    """epsilon 0.0002 at num_iterations 4 (clinic): most tokens sit at ratio ~1, so a few percent clipped is all it
    shows, and the exponential model would only double it; a clip that binds at a tenth of the working range goes
    to 0.2 in one round. Where it does not bind, or sits in the range, nothing."""
    r = rec(tmp_path, cfg_with("num_iterations=4", "epsilon=0.0002"), clip_fraction=0.04, noise=0.0, **FLAT)
    assert changed(r) == {"epsilon": R.EPSILON_WORKING}
    assert "< 0.02" in r.findings[0].evidence
    for name, eps, frac in (("unbound", "0.0002", 0.005), ("in-range", "0.05", 0.04)):
        assert "clip_tight" not in fired(rec(tmp_path, cfg_with("num_iterations=4", f"epsilon={eps}"), name=name,
                                             clip_fraction=frac, noise=0.0, **FLAT))


def test_sampling_too_hot_cools_to_the_model_then_to_the_floor(tmp_path):
    """temperature 2.0 on the embedded default (clinic): the rollouts solve 6% while greedy solves 37%. Cooled to
    1.0 (the model's own distribution) from above it, to the working floor 0.7 from 1.0; quiet at the floor, where
    the rollouts solve as much as greedy, and on a foreign run (whose eval may be sampled)."""
    hot = {"components": {"correctness": 0.05}, "accuracy": (0.4, 0.4), **FLAT}
    r = rec(tmp_path, cfg_with("temperature=2.0"), **hot)
    assert changed(r) == {"temperature": 1.0}
    assert "0.12 x the greedy base accuracy 0.4" in r.findings[0].evidence
    assert changed(rec(tmp_path, cfg_with("temperature=1.0"), name="t1", **hot)) == {"temperature": 0.7}
    assert "sampling_too_hot" not in fired(rec(tmp_path, cfg_with("temperature=0.7"), name="t07", **hot))
    assert "sampling_too_hot" not in fired(rec(tmp_path, cfg_with("temperature=2.0"), name="ok", **{
        **hot, "components": {"correctness": 0.35}}))


def test_a_narrow_lora_that_held_still_is_widened_not_given_a_bigger_step(tmp_path):
    r = rec(tmp_path, **RULE_CASES["lora_narrow"])
    assert changed(r) == {"lora.layers": "all", "lora.target_modules": configlib.ALL_MODULES}
    assert "1 of 21" in next(f for f in r.findings if f.rule == "lora_narrow").evidence
    for rule in ("held_still", "narrow_lora"):  # a bigger step, or attention-only widened by module, waits
        held = next(f for f in r.findings if f.rule == rule)
        assert held.changes == [] and "deferred: lora_narrow" in held.reason


def test_a_reward_that_pays_the_format_gets_correctness_back(tmp_path):
    r = rec(tmp_path, cfg_with("rewards.weights={correctness: 0.1, xml_count: 1.0, format: 1.0}"))
    assert changed(r) == {"rewards.weights": {"correctness": 2.0, "xml_count": 1.0, "format": 1.0}}
    assert "5% of the maximum" in r.findings[0].evidence


def test_a_format_paying_reward_is_not_called_saturated(tmp_path):
    r = rec(tmp_path, cfg_with("rewards.weights={correctness: 0.1, xml_count: 1.0, format: 1.0}"),
            reward=(2.05, 2.08), frac_zero_std=0.8, reward_cv=0.02, kl=0.01)
    assert {"correctness_unpaid", "early_saturation"} <= fired(r)
    assert set(changed(r)) == {"rewards.weights"}  # not harder data: the saturation is the format's


def test_a_near_deterministic_sampler_doubling_a_tiny_entropy_is_not_a_rise(tmp_path):
    """temperature 0.1 in the clinic: entropy 0.0035 -> 0.0069 nats, x2 but +0.003; entropy_rise asked for half
    the learning rate there and undid low_diversity's cure. A rise is ENTROPY_RISE_MIN nats as well as x1.5."""
    from mechdiag import alerts

    tiny = rec(tmp_path, cfg_with("temperature=0.1"), name="tiny", entropy=(0.0035, 0.007), **FLAT)
    assert "entropy_rise" not in fired(tiny)
    assert "entropy_rise" in fired(rec(tmp_path, name="real", entropy=(0.15, 1.2), **FLAT))
    recs = [{"step": s, "entropy": 0.0035 * (1 + s / 10)} for s in range(1, 21)]
    assert alerts.entropy_rise(recs) is None
    assert alerts.entropy_rise([{**r, "entropy": r["entropy"] * 100} for r in recs]) is not None


def test_the_diagnosis_never_waits_on_the_network(tmp_path, monkeypatch):
    """A run of a Hub model (a foreign run's `unsloth/gemma-3-1b-it`) asks only the local cache for its layer count:
    offline, each reallog naming one waited ~23 s on the Hub before lora_narrow could answer."""
    import transformers

    asked = []

    def from_pretrained(name, **kw):
        asked.append((str(name), kw.get("local_files_only")))
        raise OSError("not cached")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    held = {"kl": 0.001, "reward": (1.5, 1.5), "accuracy": (0.4, 0.4), "frac_zero_std": 0.2, "eval_reward": (1.5, 1.5)}
    r = rec(tmp_path, cfg_with("model.name_or_path=some-org/some-model", "lora.layers=[0]",
                               "lora.target_modules=[q_proj]"), **held)
    assert asked == [("some-org/some-model", True)]
    assert "lora_narrow" not in fired(r)  # its share of the sites cannot be known: nothing claimed


def test_a_gain_is_offered_its_control_and_the_control_run_says_what_it_is(tmp_path):
    """A held-out gain beyond CONTROL_GAIN gets the Spurious-rewards note with our own switch to train the control;
    the control run itself (rewards.control: random) is read as the gain a reward with no signal gives."""
    gain = rec(tmp_path, name="gain", accuracy=(0.3, 0.5), **FLAT)
    assert any("`--set rewards.control=random`" in n for n in gain.notes)
    control = rec(tmp_path, cfg_with("rewards.control=random"), name="control", accuracy=(0.3, 0.5), **FLAT)
    assert any("under a random reward" in n for n in control.notes)
    assert not rec(tmp_path, name="flat", accuracy=(0.4, 0.41), **FLAT).notes
