"""Runs users bring (TRL, Unsloth, verl, OpenRLHF, custom loops) read as they were: the real published runs of
../shared/data/reallogs, synthetic logs in each trainer's documented format, provenance of config values, the
run's own maximum reward, and advice that never starts from a value the run did not have."""

import csv
import gzip
import json
import re

import pytest
from click.testing import CliRunner

from mechdiag.cli import main
from mechdiag.evidence import Signals
from mechdiag.integrations.readers import read_any_run
from mechdiag.recommend import recommend

# folder -> (train records, eval records)
REAL = {"aaipl-minesweeper": (50, 0), "chaos-economy": (40, 0), "gemma3-1b-gsm8k": (25, 0),
        "memredteam-sparse": (100, 0), "taubench-1log": (1, 0), "unsloth-llama8b-gsm8k": (250, 0),
        "verl-econ-qwen7b": (699, 0), "verl-gui-cursor": (10, 0), "verl-qwen05b-ppo": (435, 43),
        "rewardhack-custom-excerpt": (12, 2)}
TRL_STATE = {"aaipl-minesweeper": "outputs/checkpoint-500", "chaos-economy": "", "gemma3-1b-gsm8k":
             "outputs/checkpoint-250", "memredteam-sparse": "", "taubench-1log": "",
             "unsloth-llama8b-gsm8k": "outputs/checkpoint-250"}


@pytest.fixture(scope="module")
def reallogs(data_dir):
    path = data_dir / "reallogs"
    assert path.is_dir(), f"missing {path}"
    return path


def _raw_console(path):
    """verl console lines parsed here independently of the reader: step -> {key: text}."""
    out = {}
    for line in gzip.decompress(path.read_bytes()).decode("utf-8", "replace").splitlines():
        m = re.search(r"step:(\d+) - (.*)$", re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            out[int(m.group(1))] = dict(p.rsplit(":", 1) for p in m.group(2).split(" - ") if ":" in p)
    return out


def _num(text):
    return float(re.sub(r"^np\.\w+\((.*)\)$", r"\1", text))


def test_every_real_run_read_with_raw_values(reallogs):
    for name, (n_train, n_eval) in REAL.items():
        run = read_any_run(reallogs / name)
        assert (len(run.metrics), len(run.eval)) == (n_train, n_eval), name
        got = {m["step"]: m for m in run.metrics}
        if name in TRL_STATE:
            hist = [h for h in json.loads((reallogs / name / TRL_STATE[name] / "trainer_state.json").read_text())
                    ["log_history"] if "loss" in h]
            for h in (hist[0], hist[len(hist) // 2], hist[-1]):  # three values equal to the raw file
                assert got[h["step"]]["reward"] == h["reward"]
                assert got[h["step"]]["grad_norm"] == h["grad_norm"]
                length = h.get("completions/mean_length", h.get("completion_length"))
                assert got[h["step"]]["completion_length"] == length
        elif name.startswith("verl"):
            raw = _raw_console(next((reallogs / name).glob("*.gz")))
            train = sorted(s for s, d in raw.items() if "critic/score/mean" in d)
            for s in (train[0], train[len(train) // 2], train[-1]):
                assert got[s]["reward"] == _num(raw[s]["critic/score/mean"])
                assert got[s]["completion_length"] == _num(raw[s]["response_length/mean"])
                assert got[s]["grad_norm"] == _num(raw[s]["actor/grad_norm"])
        else:
            rows = [json.loads(x) for x in (reallogs / name / "results/baseline/metrics.jsonl").read_text()
                    .splitlines() if "train_reward" in x]
            for r in (rows[0], rows[6], rows[-1]):
                assert (got[r["step"]]["reward"], got[r["step"]]["kl"], got[r["step"]]["loss"]) == \
                    (r["train_reward"], r["kl"], r["pg_loss"])


def test_every_real_run_through_recommend_report_watch(reallogs, tmp_path):
    runner = CliRunner()
    for name in REAL:
        path = str(reallogs / name)
        rec = runner.invoke(main, ["recommend", path, "--format", "json"])
        assert rec.exit_code == 0, (name, rec.output)
        rules = [f["rule"] for f in json.loads(rec.output)]
        assert ("too_few_records" in rules) == (name == "taubench-1log"), (name, rules)
        assert "held_still" not in rules, name  # none of these is held still by its penalty
        rep = runner.invoke(main, ["report", path, "--out", str(tmp_path / f"{name}.html")])
        assert rep.exit_code == 0, (name, rep.output)
        page = (tmp_path / f"{name}.html").read_text()
        assert "0.001</td>" not in page or name == "verl-qwen05b-ppo"  # mechdiag's lr default never shown
        w = runner.invoke(main, ["watch", path, "--once", "--format", "json"])
        assert w.exit_code == 0, (name, w.output)
    # a single log file as well as its folder
    one = reallogs / "verl-gui-cursor" / "verl_demo.log.gz"
    for cmd in (["recommend", str(one)], ["watch", str(one), "--once"]):
        assert runner.invoke(main, cmd).exit_code == 0
    att = runner.invoke(main, ["attribute", str(reallogs / "chaos-economy")])
    assert att.exit_code == 2 and "without mechdiag's adapter" in att.output


def test_unsloth_config_subclass_read_safely(reallogs):
    run = read_any_run(reallogs / "gemma3-1b-gsm8k")
    prov = run.provenance
    assert prov["trainer"] == "unsloth"
    keys = prov["keys"]
    assert keys["group_size"] == {"how": "read", "value": 4, "evidence": "checkpoint-250/training_args.bin"}
    assert keys["max_completion_tokens"]["value"] == 768 and keys["learning_rate"]["value"] == 1e-5
    assert keys["warmup_ratio"]["value"] == 0.1  # TRL 0.2x's warmup_ratio field
    assert keys["lora.r"]["how"] == "read"
    # TRL 0.23: per-device 4 completions x 4 accumulation / G 8 = 2 prompts per optimizer step
    aaipl = read_any_run(reallogs / "aaipl-minesweeper").provenance["keys"]
    assert aaipl["prompts_per_step"]["value"] * aaipl["grad_accum"]["value"] == 2
    assert "lora.r" not in aaipl  # no adapter_config.json: nothing claimed
    assert "adapter_config" not in (reallogs / "aaipl-minesweeper").name


def test_no_config_advice_from_the_logs_not_defaults(reallogs):
    run = read_any_run(reallogs / "chaos-economy")  # trainer_state.json only, completions cut at 512
    keys = run.provenance["keys"]
    assert keys["max_completion_tokens"]["how"] == "inferred" and keys["max_completion_tokens"]["value"] == 512
    assert "group_size" not in keys and "beta" not in keys
    rec = recommend([run])
    assert rec.changes == []  # nothing changes from a value the run did not hold
    text = " ".join(f.reason for f in rec.findings)
    assert "raise max_completion_length above the observed 512" in text
    assert "48 -> 72" not in text


def _trl_state(tmp_path, history):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": history[-1]["step"],
                                                             "log_history": history}))
    return tmp_path


def _steps(n, **fn):
    return [{"step": s, "loss": 0.01, "grad_norm": 0.5, "learning_rate": 1e-5,
             "reward": sum(f(s) for f in fn.values()), **{f"rewards/{k}/mean": f(s) for k, f in fn.items()}}
            for s in range(1, n + 1)]


def test_max_reward_is_the_runs_own(tmp_path):
    a = read_any_run(_trl_state(tmp_path / "a", _steps(12, fmt=lambda s: 0.5, correct=lambda s: s / 6)))
    b = read_any_run(_trl_state(tmp_path / "b", _steps(12, fmt=lambda s: 0.5, judge=lambda s: s / 2)))
    ma, mb = Signals.from_runs([a]).max_reward, Signals.from_runs([b]).max_reward
    assert ma == pytest.approx(0.5 + 2.0) and mb == pytest.approx(0.5 + 6.0)
    assert a.provenance["keys"]["rewards.weights"]["value"] == {"correct": 1.0, "fmt": 1.0}  # solved from the log
    w = read_any_run(_trl_state(tmp_path / "w", [{**r, "reward": r["rewards/fmt/mean"] + 3 * r["rewards/c/mean"]}
                                                 for r in _steps(12, fmt=lambda s: 0.5, c=lambda s: s / 12)]))
    assert w.provenance["keys"]["rewards.weights"]["value"] == {"c": 3.0, "fmt": 1.0}
    assert Signals.from_runs([w]).max_reward == pytest.approx(0.5 + 3.0)


def test_synthetic_trl_versions(tmp_path):
    # TRL 0.14: completion_length, rewards/<f> (no /mean); TRL 0.23+: completions/*, rewards/<f>/mean|std
    old = [{"step": s, "loss": 0.0, "grad_norm": 0.0, "learning_rate": 1e-6, "reward": 1.0, "reward_std": 0.2,
            "kl": 0.001, "completion_length": 50.0 + s, "rewards/correct": 1.0} for s in range(1, 13)]
    new = [{"step": s, "loss": 0.1, "grad_norm": 1.0, "learning_rate": 1e-6, "reward": 1.0, "reward_std": 0.2,
            "completions/mean_length": 40.0, "completions/max_length": 64.0, "completions/min_length": 3.0,
            "completions/clipped_ratio": 0.5, "completions/mean_terminated_length": 20.0,
            "rewards/correct/mean": 1.0, "rewards/correct/std": 0.3, "clip_ratio/region_mean": 0.0,
            "frac_reward_zero_std": 0.25, "entropy": 0.4} for s in range(1, 13)]
    r_old = read_any_run(_trl_state(tmp_path / "old", old))
    m = r_old.metrics[0]
    assert (m["completion_length"], m["reward/correct"]) == (51.0, 1.0) and not any(k.startswith("trl/") for k in m)
    r_new = read_any_run(_trl_state(tmp_path / "new", new))
    m = r_new.metrics[0]
    assert (m["completion_length_max"], m["terminated_length"], m["reward_std/correct"]) == (64.0, 20.0, 0.3)
    assert r_new.provenance["keys"]["max_completion_tokens"]["value"] == 64
    runner = CliRunner()
    w = runner.invoke(main, ["watch", str(tmp_path / "old"), "--once", "--format", "json"])
    assert w.exit_code == 0 and "grad_norm exactly 0" in w.output  # grad_norm == 0 feeds no_update


def test_synthetic_verl_jsonl_and_console(tmp_path):
    data = [{"critic/score/mean": 0.1 * s, "critic/score/max": 1.0, "actor/entropy": 0.5, "actor/kl_loss": 0.01,
             "actor/pg_loss": 0.0, "actor/grad_norm": 1.0, "actor/lr": 1e-6, "response_length/mean": 100.0,
             "response_length/max": 256.0, "response_length/min": 4.0, "response_length/clip_ratio": 0.25,
             "rollout/too_bad_sample_ratio": 0.5, "rollout/too_good_sample_ratio": 0.1} for s in range(1, 11)]
    jl = tmp_path / "metrics.jsonl"
    jl.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in enumerate(data, 1)))
    console = tmp_path / "run.log"
    console.write_text("INFO start\n" + "".join(
        f"(TaskRunner pid=7) step:{s} - " + " - ".join(f"{k}:np.float64({v})" for k, v in d.items()) + "\n"
        for s, d in enumerate(data, 1)))
    old = tmp_path / "ppo.log"  # verl Dec 2024: critic/kl, scaled actor/lr(1e-4), val/test_score
    old.write_text("".join(f"step:{s} - critic/kl:0.002 - critic/kl_coeff:0.001 - actor/lr(1e-4):0.010 - "
                           f"critic/score/mean:0.{s} - critic/score/max:1.000 - response_length/mean:200.0"
                           + (f" - val/test_score/openai/gsm8k:0.{s}" if s % 5 == 0 else "") + "\n"
                           for s in range(1, 11)))
    for path in (jl, console):
        run = read_any_run(path)
        m = run.metrics[-1]
        assert (m["reward"], m["completion_length_max"], m["filter_too_bad_ratio"]) == (1.0, 256.0, 0.5), path
        assert run.provenance["keys"]["max_completion_tokens"]["how"] == "inferred"
        assert run.provenance["max_reward"]["value"] == 1.0
    run = read_any_run(old)
    assert run.metrics[0]["kl"] == 0.002 and run.metrics[0]["lr"] == pytest.approx(1e-6)
    assert run.provenance["keys"]["beta"]["value"] == 0.001 and len(run.eval) == 2


def test_synthetic_openrlhf_wandb_csv_and_jsonl(tmp_path):
    rows = [{"train/global_step": s, "train/reward": 0.1 * s, "train/kl": 0.01, "train/policy_loss": 0.1,
             "train/response_length": 120.0, "train/actor_lr": 5e-7, "train/policy_entropy": 0.3}
            for s in range(1, 11)]
    jl = tmp_path / "openrlhf.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = tmp_path / "wandb_export.csv"
    with c.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Step", "run1 - train/reward", "run1 - train/reward__MIN", "run1 - train/kl"])
        for r in rows:
            w.writerow([r["train/global_step"], r["train/reward"], 0, r["train/kl"]])
    a, b = read_any_run(jl), read_any_run(c)
    assert a.provenance["trainer"] == b.provenance["trainer"] == "openrlhf"
    assert a.metrics[4]["reward"] == b.metrics[4]["reward"] == pytest.approx(0.5)
    assert a.metrics[0]["completion_length"] == 120.0 and b.metrics[0]["kl"] == 0.01
    assert a.provenance["keys"]["learning_rate"]["value"] == 5e-7
    assert "learning_rate" not in b.provenance["keys"]


def test_one_record_run_too_few(reallogs):
    rec = recommend([read_any_run(reallogs / "taubench-1log")])
    assert [f.rule for f in rec.findings] == ["too_few_records"]
