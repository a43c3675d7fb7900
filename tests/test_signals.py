"""Issue 16's signals: group outcomes (native, GroupCV, TRL and verl readers), the forgetting probe, the live
alerts and `mechdiag watch` on synthetic runs and on live native and TRL runs."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from mechdiag import alerts as A
from mechdiag import config as C
from mechdiag.integrations.readers.trl_dir import completions_rows
from mechdiag.integrations.readers.verl_log import read_verl_run
from mechdiag.integrations.trl import GroupCV
from mechdiag.metrics import max_reward
from mechdiag.outcomes import KEYS, group_stats
from mechdiag.paths import REPO_ROOT
from mechdiag.probes.forget import ForgetProbe
from mechdiag.report import write_report
from mechdiag.run import RunDir, load_run
from mechdiag.tasks import reward_weights
from mechdiag.train.trainer import train
from tests.helpers import assert_bad_input
from tests.synth_runs import ALERT_FAULTS, make_alert_run

torch.set_num_threads(1)


def small(model_dir, *extra) -> list[str]:
    return [f"model.name_or_path={model_dir}", "task.name=tests.toy:Toy", "group_size=4", "prompts_per_step=2",
            "max_completion_tokens=12", "max_prompt_tokens=32", "eval_n=8", "threads=1", "learning_rate=0.01",
            "record.displacement_every=0", "record.shift_at_eval=false", "record.samples_every=1",
            "max_time_s=null", *extra]


# ---- group outcomes ---------------------------------------------------------------------------------------------
def test_group_outcomes_by_hand():
    groups = [([2.5, 2.5, 2.5], [1, 1, 1]),  # all correct, zero std
              ([0.0, 0.0, 0.0], [0, 0, 0]),  # all wrong, zero std
              ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),  # zero std, partial credit: neither
              ([2.5, 2.0, 2.5], [1, 1, 1]),  # correctness equal, reward differs: shaping only
              ([0.5, 0.0, 0.5], [0, 0, 0]),  # shaping only among wrong answers
              ([2.5, 0.5, 0.0], [1, 0, 0]),  # a real correctness signal
              ([1.0, math.nan, 1.0], [1, 1, 1])]  # an unscorable completion is left out: all correct
    rewards = [r for g, _ in groups for r in g]
    correct = [c for _, g in groups for c in g]
    keys = [i for i, (g, _) in enumerate(groups) for _ in g]
    out = {k: v for k, v in group_stats(rewards, keys, correct).items() if k in KEYS}
    assert out == {"frac_groups_all_correct": 2 / 7, "frac_groups_all_wrong": 1 / 7, "frac_groups_shaping_only": 2 / 7}
    assert group_stats([1.0, 2.0], ["a", "b"], [1, 1]) == {}  # no group of two


def _outcomes_from_samples(run: RunDir) -> dict[int, dict]:
    by_step: dict[int, list] = {}
    for s in run.read("samples"):
        if s["split"] == "train":
            by_step.setdefault(s["step"], []).append(s)
    return {step: {k: v for k, v in group_stats([s["reward"] for s in rows], [s["group"] for s in rows],
                                                [s["reward/correctness"] for s in rows]).items() if k in KEYS}
            for step, rows in by_step.items()}


@pytest.mark.parametrize("task", ["arith", "tests.toy:Shaped"])
def test_native_metrics_carry_outcomes(stories260k, tmp_path, task):
    """The trainer's keys equal a recount from samples.jsonl; on Shaped (correctness always 0, a format term)
    every group with spread is shaping only and every zero-std group is all wrong."""
    over = ["max_steps=3", "save_every=0", "eval_every=0", "threads=1", "max_time_s=null", "group_size=4",
            "prompts_per_step=4", "eval_n=8", "record.samples_every=1", "record.shift_at_eval=false",
            "record.displacement_every=0"]
    if task != "arith":
        over = small(stories260k, f"task.name={task}", "max_steps=3", "save_every=0")
    run = train(C.load(None, over), tmp_path / "run")
    metrics = run.read("metrics")
    recount = _outcomes_from_samples(run)
    for m in metrics:
        assert {k: m[k] for k in KEYS} == pytest.approx(recount[m["step"]], abs=1e-12)
        assert m["frac_groups_all_correct"] + m["frac_groups_all_wrong"] <= m["frac_zero_std"] + 1e-12
    if task == "arith":
        assert any(m["frac_groups_all_correct"] > 0 for m in metrics)  # the bundled base solves some problems
    else:
        for m in metrics:
            assert m["frac_groups_shaping_only"] == pytest.approx(1 - m["frac_zero_std"])
            assert m["frac_groups_all_wrong"] == pytest.approx(m["frac_zero_std"])
        assert any(m["frac_groups_shaping_only"] > 0 for m in metrics)


def test_group_cv_logs_outcomes():
    correct = [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0]
    fmt = [0.5, 0.5, 0.5, 0.5, 0.2, 0.4, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5]

    def correctness(prompts=None, completions=None, **_):
        return [float(c) for c in correct]

    def format_(prompts=None, completions=None, **_):
        return fmt

    logged = {}
    prompts, completions = [f"p{i // 4}" for i in range(12)], [f"c{i}" for i in range(12)]
    cv = GroupCV([format_, correctness], [0.5, 2.0], group_size=4)
    for f in cv.funcs:  # TRL calls each function on the same list objects
        f(prompts=prompts, completions=completions, log_metric=lambda k, v: logged.__setitem__(k, v))
    # group 0 all correct (zero std), group 1 wrong with format spread (shaping only), group 2 mixed
    assert (logged["frac_groups_all_correct"], logged["frac_groups_all_wrong"],
            logged["frac_groups_shaping_only"]) == (1 / 3, 0.0, 1 / 3)
    logged.clear()
    cv = GroupCV([format_, correctness], [0.5, 2.0], group_size=4, correctness="format_")  # told which one
    for f in cv.funcs:
        f(prompts=prompts, completions=completions, log_metric=lambda k, v: logged.__setitem__(k, v))
    # format as "correctness": group 2 (format all 0.5, reward varying) is now the shaping-only one
    assert (logged["frac_groups_all_correct"], logged["frac_groups_all_wrong"],
            logged["frac_groups_shaping_only"]) == (0.0, 0.0, 1 / 3)
    with pytest.raises(Exception, match="names none of the reward functions"):
        GroupCV([format_], correctness="nope")


def test_readers_outcomes(tmp_path):
    """TRL's completions parquet (a correctness column) and verl's rollout dump (acc beside score)."""
    df = pd.DataFrame({"step": [1] * 8, "prompt": ["a"] * 4 + ["b"] * 4, "completion": ["x"] * 8,
                       "correctness": [1.0] * 4 + [0.0] * 4, "format": [0.5] * 4 + [0.1, 0.3, 0.1, 0.1]})
    path = tmp_path / "completions_00001.parquet"
    df.to_parquet(path)
    stats, _ = completions_rows(path, ["correctness", "format"], {"correctness": 2.0, "format": 0.5}, 4)
    assert (stats["frac_groups_all_correct"], stats["frac_groups_all_wrong"],
            stats["frac_groups_shaping_only"]) == (0.5, 0.0, 0.5)
    folder = tmp_path / "verl"
    (folder / "rollouts").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.5}}) + "\n")
    rows = [{"input": f"q{k}", "output": "o", "score": float(k == 0) + 0.1 * (j % 2) * (k == 1),
             "acc": float(k == 0)} for k in range(2) for j in range(4)]
    (folder / "rollouts" / "1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = read_verl_run(folder / "metrics.jsonl", into=tmp_path / "run", rollout_dir=folder / "rollouts").read(
        "metrics")[0]
    assert (m["frac_groups_all_correct"], m["frac_groups_all_wrong"], m["frac_groups_shaping_only"]) == \
        (0.5, 0.0, 0.5)


# ---- forgetting probe ---------------------------------------------------------------------------------------------
def test_forget_kl_exact(stories260k):
    """ForgetProbe against a by-hand computation: greedy continuations of the base decoded one prompt at a time
    with full forwards, KL(base || merged tuned model) per token, averaged over all continuation tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories260k)
    base = AutoModelForCausalLM.from_pretrained(stories260k).eval()
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    prompts = ["Once upon a time", "The cat sat on the mat and", "Lily"]
    probe = ForgetProbe(prompts, tok, max_new_tokens=6, batch_size=2)
    got = probe.kl(peft)
    tuned = copy.deepcopy(peft).merge_and_unload().eval()
    eos = tok.eos_token_id
    total, n = 0.0, 0
    with torch.no_grad():
        for p in prompts:
            ids = tok(p)["input_ids"]
            cont = []
            for _ in range(6):
                nxt = int(base(torch.tensor([ids + cont])).logits[0, -1].argmax())
                cont.append(nxt)
                if nxt == eos:
                    break
            full = torch.tensor([ids + cont])
            lb = torch.log_softmax(base(full).logits[0, len(ids) - 1:-1].double(), -1)
            lt = torch.log_softmax(tuned(full).logits[0, len(ids) - 1:-1].double(), -1)
            total += float((lb.exp() * (lb - lt)).sum())
            n += len(cont)
    assert got > 0 and got == pytest.approx(total / n, rel=1e-4)
    assert probe.kl(peft) == got  # cached continuations: the same number again
    for n_, p in peft.named_parameters():
        if "lora_B" in n_:
            p.data.zero_()
    assert probe.kl(peft) == 0.0  # B = 0: tuned is the base, exactly


def test_trainer_forget_kl_and_report(stories260k, tmp_path):
    probes = tmp_path / "probes.txt"
    probes.write_text("The capital of France is\nOnce upon a time there was\n\nA dog\n")
    cfg = C.load(None, small(stories260k, "max_steps=4", "eval_every=2", "save_every=0",
                             f"record.forget_prompts={probes}", "record.forget_tokens=8"))
    run = train(cfg, tmp_path / "run")
    evals = run.read("eval")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert evals[0]["forget_kl"] == 0.0  # the base against itself
    assert evals[-1]["forget_kl"] > 0
    html = write_report([load_run(run.path)], tmp_path / "r.html").read_text()
    assert "forget KL to base" in html


def test_forget_prompts_bad_input(stories260k, tmp_path, cli):
    out = tmp_path / "run"
    proc = cli("train", "--out", str(out), *[a for s in small(stories260k, "max_steps=1",
                                                               "record.forget_prompts=no/such/file.txt")
                                             for a in ("--set", s)])
    assert_bad_input(proc)
    assert "forget_prompts" in proc.stderr and not out.exists()


# ---- alerts -------------------------------------------------------------------------------------------------------
def _check(run: RunDir) -> list[A.Alert]:
    return A.check(run.read("metrics"), run.read("eval"), run.read("displacement"),
                   max_reward(reward_weights(C.load(run.config_path))))


def test_healthy_run_fires_nothing(tmp_path):
    assert _check(make_alert_run(tmp_path / "ok")) == []


@pytest.mark.parametrize("fault", ALERT_FAULTS)
def test_each_alert_fires_on_its_fault(tmp_path, fault):
    fired = _check(make_alert_run(tmp_path / fault, fault))
    assert [a.alert for a in fired] == [fault]
    start = {"no_update": 10, "reward_accuracy_gap": 10, "kl_spike": 25, "update_spike": 25}.get(fault)
    assert fired[0].step == start if start else 20 <= fired[0].step <= 24
    assert fired[0].evidence


def test_no_update_from_reward_and_loss():
    """Without displacement records (full fine-tuning, a reader's run): reward 0 and loss 0 for N steps."""
    recs = [{"step": s, "reward": 0.0, "loss": 0.0, "kl": 0.0} for s in range(1, A.NO_UPDATE_STEPS + 3)]
    fired = A.check(recs)
    assert [(a.alert, a.step) for a in fired] == [("no_update", A.NO_UPDATE_STEPS)]
    recs[A.NO_UPDATE_STEPS - 2]["loss"] = 1e-3  # one step with a loss restarts the count
    assert A.no_update(recs, []) is None


def test_watch_live_mode_ends_with_the_run(tmp_path, cli):
    """Without --once, watch follows the run until its summary.json appears (here: already there)."""
    run = make_alert_run(tmp_path / "r", "truncation")
    run.write_summary({"steps": 40})
    proc = cli("watch", str(run.path), "--interval", "0.2")
    assert proc.returncode == 0 and "(finished)" in proc.stdout and "truncation" in proc.stdout
    proc = cli("watch", str(run.path), "--format", "json", "--interval", "0.2")
    assert proc.returncode == 0 and [json.loads(x)["alert"] for x in proc.stdout.splitlines()] == ["truncation"]


def test_watcher_prints_each_alert_once(tmp_path, capsys):
    run = make_alert_run(tmp_path / "z", "zero_std")
    w = A.Watcher(3.7)
    for m in run.read("metrics"):
        w.update(metrics=[m])
    err = capsys.readouterr().err
    assert err.count("mechdiag: alert zero_std at step 22") == 1 and err.count("alert") == 1
    run = make_alert_run(tmp_path / "n", "no_update")  # displacement kept per step: the same alert as check()
    w = A.Watcher(3.7)
    for m in run.read("metrics"):
        w.update(metrics=[m], displacement=[r for r in run.read("displacement") if r["step"] == m["step"]])
    assert list(w.fired.values()) == _check(run) and len(w.displacement) == 4
    quiet = A.Watcher(3.7)  # a resumed run's history: remembered, not announced
    quiet.update(run.read("metrics"), run.read("eval"), run.read("displacement"), announce=False)
    assert "no_update" in quiet.fired and quiet.update(metrics=[{"step": 41, "reward": 1.0}]) == []
    assert "alert" not in capsys.readouterr().err.replace("mechdiag: alert no_update", "", 1)


def test_watch_cli_synthetic(tmp_path, cli):
    run = make_alert_run(tmp_path / "out" / "mechdiag", "kl_spike")  # a TRL output_dir with the callback's folder
    proc = cli("watch", str(tmp_path / "out"), "--once", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x) for x in proc.stdout.splitlines()] == [
        {"alert": "kl_spike", "step": 25, "evidence": _check(run)[0].evidence}]
    proc = cli("watch", str(run.path), "--once")
    assert proc.returncode == 0 and "kl_spike" in proc.stdout and "train reward" in proc.stdout
    assert "eval accuracy" in proc.stdout and "forget" not in proc.stdout
    proc = cli("watch", str(make_alert_run(tmp_path / "ok").path), "--once", "--format", "json")
    assert proc.returncode == 0 and proc.stdout == ""


def test_watch_shows_user_signals(tmp_path, cli):
    run = make_alert_run(tmp_path / "r")
    run.register("reward_gap")
    run.append("reward_gap", [{"step": 1, "gap": 0.5}, {"step": 2, "gap": 0.25, "note": "text"},
                              {"step": 2, "double_accuracy": 1.5}])
    proc = cli("watch", str(run.path), "--once", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x) for x in proc.stdout.splitlines()] == [
        {"signal": "reward_gap/gap", "latest": 0.25, "step": 2},
        {"signal": "reward_gap/double_accuracy", "latest": 1.5, "step": 2}]
    proc = cli("watch", str(run.path), "--once")
    lines = [ln for ln in proc.stdout.splitlines() if "reward_gap/" in ln]
    assert proc.returncode == 0 and len(lines) == 2  # the text key has no row
    assert [ln.replace("│", " ").split()[:4] for ln in lines] == [["reward_gap/gap", "0.25", "2", "█▁"],
                                                                   ["reward_gap/double_accuracy", "1.5", "2", "▁"]]


def test_sparkline():
    from mechdiag.watch import sparkline

    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([1e-9, -3e-9, 2e-9]) == "▁▁▁"  # float noise around 0 is flat
    assert sparkline([float("nan"), 2.0, 1.0]) == "█▁" and sparkline([]) == ""
    assert len(sparkline(list(range(100)))) == 30
    # the whole run, not its tail: a rise that then holds draws as a rise
    rise = sparkline([0.14 + 0.01 * i for i in range(70)] + [0.85 + 0.01 * (i % 3) for i in range(163)])
    assert rise[0] == "▁" and rise[-1] in "▇█" and len(rise) == 30


def test_watch_bad_input(tmp_path, cli):
    assert_bad_input(cli("watch", str(tmp_path / "missing"), "--once"))
    assert_bad_input(cli("watch", str(tmp_path), "--once"))  # an empty folder is no run
    run = make_alert_run(tmp_path / "r")
    with open(run.stream("metrics"), "a") as f:
        f.write("{not json\n")
    assert_bad_input(cli("watch", str(run.path), "--once"))
    assert_bad_input(cli("watch", str(run.path), "--once", "--format", "yaml"))


# ---- live runs ----------------------------------------------------------------------------------------------------
def _start(args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "mechdiag", *args], env=env, stdout=log, stderr=log)


def _wait_lines(path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and sum(1 for ln in path.read_text().splitlines() if ln.strip()) >= n:
            return
        assert proc.poll() is None, "the run ended early"
        time.sleep(0.5)
    pytest.fail(f"{path} did not reach {n} records in {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_watch_live_native_run(stories260k, tmp_path, cli):
    """`mechdiag train` in the background on a task where nothing can be learnt; `watch --once` while it writes
    shows the signals and the no_update and zero_std alerts, and the trainer printed each alert once."""
    out = tmp_path / "run"
    log = open(tmp_path / "train.log", "w")
    proc = _start(["train", "--out", str(out), *[a for s in small(
        stories260k, "task.name=tests.toy:Flat", "max_steps=500", "save_every=0", "record.displacement_every=5",
        "record.samples_every=0") for a in ("--set", s)]], log)
    try:
        _wait_lines(out / "metrics.jsonl", 11, proc)
        table = cli("watch", str(out), "--once")
        js = cli("watch", str(out), "--once", "--format", "json")
        assert proc.poll() is None and not (out / "summary.json").exists()  # it was live throughout
    finally:
        _stop(proc)
        log.close()
    assert table.returncode == 0, table.stderr
    assert "train reward" in table.stdout and "(finished)" not in table.stdout and "no_update" in table.stdout
    alerts = {r["alert"]: r for r in map(json.loads, js.stdout.splitlines())}
    assert set(alerts) >= {"no_update", "zero_std"}
    assert alerts["no_update"]["step"] == 10 and "exactly zero" in alerts["no_update"]["evidence"]
    assert "all wrong 100%" in alerts["zero_std"]["evidence"]
    printed = (tmp_path / "train.log").read_text()
    assert printed.count("mechdiag: alert no_update at step 10") == 1
    assert printed.count("mechdiag: alert zero_std") == 1
    print(table.stdout)


def test_watch_live_trl_run(stories260k, tmp_path, cli):
    """`mechdiag train --backend trl` (GRPOTrainer + MechdiagCallback + GroupCV) in the background; `watch --once`
    reads the callback's records while TRL writes them, group outcomes and forget_kl included."""
    out = tmp_path / "run"
    log = open(tmp_path / "train.log", "w")
    proc = _start(["train", "--backend", "trl", "--out", str(out), *[a for s in small(
        stories260k, "max_steps=500", "save_every=0", "max_completion_tokens=8", "eval_every=2",
        "record.forget_prompts=tests.toy:Toy", "record.forget_n=4") for a in ("--set", s)]], log)
    try:
        _wait_lines(out / "metrics.jsonl", 3, proc)
        _wait_lines(out / "eval.jsonl", 2, proc)
        table = cli("watch", str(out), "--once")
        js = cli("watch", str(out), "--once", "--format", "json")
        assert proc.poll() is None and not (out / "summary.json").exists()
    finally:
        _stop(proc)
        log.close()
    assert table.returncode == 0, table.stderr
    assert "train reward" in table.stdout and "(finished)" not in table.stdout
    assert "forget KL to base" in table.stdout and "all correct" in table.stdout
    assert js.returncode == 0 and all(set(json.loads(x)) == {"alert", "step", "evidence"}
                                      for x in js.stdout.splitlines())
    run = RunDir(out)
    assert all(set(KEYS) <= set(m) for m in run.read("metrics"))  # GroupCV logged them through TRL
    evals = run.read("eval")
    assert evals[0]["step"] == 0 and evals[0]["forget_kl"] == 0.0 and evals[1]["forget_kl"] > 0
    print(table.stdout)


def test_update_spike_sees_a_build_up_but_not_a_warmup():
    """A linear warmup's steps grow (k+1)/k per step: quiet. A learning rate doubling each step from step 20 is a
    run of growing steps: update_spike at 21, the second growth, when the step is 2.5x the median before it."""
    warmup = [{"step": s, "update_norm": 0.01 * min(s, 30) + 1e-3} for s in range(1, 41)]
    assert A.update_spike(warmup) is None
    ramp = [{"step": s, "update_norm": 0.2 * (2.0 ** max(0, s - 19) if s >= 20 else 1.0)} for s in range(1, 30)]
    fired = A.update_spike(ramp)
    assert fired is not None and fired.step == 21 and "grew x2 then x2" in fired.evidence
    ramp[20]["update_norm"] = 0.2 * 2.0 * 1.4  # growth x1.4 at 21 breaks the run: it fires at 22
    assert A.update_spike(ramp).step == 22


def test_update_spike_leaves_out_steps_without_a_gradient():
    """Groups all alike for 5 steps (grad_norm 0): weight decay alone moves the weights ~1e-3; the first real
    update (~0.1, 100x) is not a spike (clinic: four runs whose first groups all failed)."""
    recs = [{"step": s, "grad_norm": 0.0, "update_norm": 1e-3} for s in range(1, 6)]
    recs += [{"step": s, "grad_norm": 0.2, "update_norm": 0.1 - 0.005 * s} for s in range(6, 13)]
    assert A.update_spike(recs) is None
    recs[-1]["update_norm"] = 1.0  # 10x the real steps before it
    assert A.update_spike(recs).step == 12
