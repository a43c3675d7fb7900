"""Issue 41, findings: each class of wrong or missed diagnosis fixed as a class, one test per class, on real published
runs (../shared/data/reallogs, numbers from their SOURCE.md) or runs written by the trainers' own writers
(tensorboard's SummaryWriter with HF's train/ and eval/ tags, HF's trainer_state.json). None of these runs is the
one a rule's threshold was set from: the thresholds say what the numbers mean (docs/recommendations.md)."""

from __future__ import annotations

import json

import pytest

from mechdiag.errors import UserError
from mechdiag.integrations.readers import read_any_run
from mechdiag.recommend import recommend
from mechdiag.run import base_eval
from mechdiag.watch import watch
from tests import synth_runs as S


def _findings(run) -> dict:
    return {f.rule: f for f in recommend([run]).findings}


def _text(rec) -> str:
    return " ".join(f"{f.evidence} {f.reason}" for f in rec.findings)


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    """A TRL run as HF's TensorBoardCallback writes it: one SummaryWriter, train/<key> and eval/<key> tags."""
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - the trainers' writer

    def write(name: str, train: dict, evals: dict | None = None, steps: int = 40):
        folder = tmp_path_factory.mktemp(name)
        w = SummaryWriter(log_dir=str(folder))
        for step in range(1, steps + 1):
            t = (step - 1) / (steps - 1)
            for key, (a, b) in train.items():
                w.add_scalar(f"train/{key}", a + (b - a) * t, step)
            w.add_scalar("train/learning_rate", 1e-6, step)
            if evals and step % 10 == 0:
                for key, (a, b) in evals.items():
                    w.add_scalar(f"eval/{key}", a + (b - a) * t, step)
        w.close()
        return read_any_run(folder)
    return write


def test_no_reward_stream_is_cannot_judge_not_healthy(tb_run):
    run = tb_run("noreward", {"loss": (0.01, 0.02), "grad_norm": (0.5, 0.4), "kl": (0.001, 0.01)})
    found = _findings(run)
    assert "cannot_judge" in found and "reward" in found["cannot_judge"].evidence


def test_levels_on_the_rewards_own_scale(data_dir):
    """All-negative penalties (Unsloth, -5..+1) are not "reward 0"; a run hovering at 0.7 of a 0-1 reward (TRL
    hotpotqa) is not saturated: a batch mean's own best is not the reward's ceiling."""
    neg = read_any_run(data_dir / "reallogs" / "unsloth-qwen3-4b-console#train_grpo.log.gz:launch1")
    assert max(m["reward"] for m in neg.metrics) < 0
    found = _findings(neg)
    assert "no_signal" not in found and "reward 0" not in _text(recommend([neg]))
    hot = read_any_run(data_dir / "reallogs" / "trl-hotpotqa-kl-v1")
    found = _findings(hot)
    assert "early_saturation" not in found and "saturat" not in _text(recommend([hot]))


def test_nan_and_constant_zero_streams_are_findings(data_dir):
    """grad_norm NaN at all 20 steps and KL exactly 0 while the groups differ (frac_reward_zero_std 0): no update."""
    run = read_any_run(data_dir / "reallogs" / "unsloth-qwen3-4b-console#train_grpo.log.gz:launch1")
    f = _findings(run)["no_update"]
    assert "grad_norm NaN/inf at 20 of 20" in f.evidence and "kl exactly 0" in f.evidence
    assert f.onset == 1 and f.confidence >= 0.9
    alerts = {a.alert: a for a in watch(f"{run.path}", once=True, fmt="json", echo=lambda _: None).alerts}
    assert alerts["no_update"].step == 10 and "grad_norm NaN" in alerts["no_update"].evidence  # live, too


def test_kl_blowup_without_eval_is_a_finding_with_onset_and_cost(data_dir, cli):
    """KL 0.002 -> 2.7 with no held-out stream (TRL hotpotqa; its authors raised beta next run)."""
    path = str(data_dir / "reallogs" / "trl-hotpotqa-kl-v1")
    f = _findings(read_any_run(path))["kl_blowup"]
    assert "no held-out stream" in f.evidence and f.onset is not None and f.onset <= 100
    assert "beta" in f.reason and "beta = " not in f.reason  # the run does not show its beta: no value stated
    proc = cli("recommend", path, "--format", "json")
    rec = next(r for r in json.loads(proc.stdout) if r.get("rule") == "kl_blowup")
    assert rec["onset_step"] == f.onset and rec["cost.steps_since_onset"] >= 1700 and rec["confidence"] > 0.5
    assert any(k.startswith("evidence.kl_") for k in rec)
    alerts = {a.alert for a in watch(path, once=True, fmt="json", echo=lambda _: None).alerts}
    assert "kl_blowup" in alerts  # the live view says it too, with no eval stream


def test_entropy_and_length_watched_in_both_directions(tb_run):
    """Entropy rising 0.15 -> 1.23 while held-out accuracy falls; completions shrinking to nothing."""
    run = tb_run("entropy", {"reward": (0.5, 0.5), "entropy": (0.15, 1.23), "kl": (0.01, 0.05)},
                 {"accuracy": (0.6, 0.3)})
    assert "entropy_rise" in _findings(run)
    run = tb_run("short", {"reward": (0.5, 0.6), "completions/mean_length": (60.0, 1.0), "kl": (0.01, 0.02)})
    assert "length_collapse" in _findings(run)


def test_flat_reward_with_nothing_solved_is_not_healthy(tb_run):
    """A format reward flat at 0.3 while no game is solved (a success stream at 0 throughout)."""
    run = tb_run("unsolved", {"reward": (0.3, 0.3), "rewards/solved_reward/mean": (0.0, 0.0), "kl": (0.01, 0.02),
                              "reward_std": (0.1, 0.1)})
    f = _findings(run)["no_signal"]
    assert "no correct answer" in f.evidence


def test_first_eval_is_base_only_at_step_0(tmp_path):
    """A resumed run's first eval at step 20 is not the base model."""
    hist = [h for h in S.trl_history("1.16", list(range(20, 61)), {"f": (lambda s: 0.5, lambda s: 0.1)})
            if "loss" in h]
    hist += [{"eval_accuracy": 0.5, "eval_loss": 0.1, "step": 20}, {"eval_accuracy": 0.3, "eval_loss": 0.1,
                                                                     "step": 60}]
    run = read_any_run(S.write_trl_state(tmp_path / "resumed", hist))
    assert base_eval(run) == {}
    text = _text(recommend([run]))
    assert "(base " not in text and "first eval (step 20)" in text


def test_advice_never_states_a_value_or_key_the_run_does_not_hold(data_dir, cli, tmp_path):
    """Over the real runs of every trainer family (the long verl and TensorBoard logs left to test_run_forms): no
    task.options advice to another trainer's run, no "beta = 0" unless the run shows beta, and `recommend --out`
    writes only the settings the run's files show."""
    slow = {"trl-tb-wordle-4070", "verl-econ-qwen7b", "verl-qwen05b-ppo", "wandb-csv-grpo-gsm8k-05b",
            "aaipl-minesweeper"}  # aaipl: its budget advice looks up gpt-oss-20b's context (slow offline)
    for folder in sorted(p for p in (data_dir / "reallogs").iterdir() if p.is_dir() and p.name not in slow):
        run = read_any_run(folder)
        rec = recommend([run])
        text = _text(rec) + " ".join(str(c) for c in rec.changes)
        assert "task.options" not in text, folder.name
        if "beta" not in (run.provenance or {}).get("keys", {}):
            assert "beta = " not in text, folder.name
    out = tmp_path / "refined.yaml"
    proc = cli("recommend", str(data_dir / "reallogs" / "trl-hotpotqa-kl-v1"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    body = out.read_text()
    assert "temperature:" not in body and "group_size:" not in body  # mechdiag defaults, never the run's


def test_degenerate_text_from_samples(tmp_path):
    """A TRL output_dir whose completions parquet (log_completions) turns into a loop of one phrase."""
    import pandas as pd  # noqa: PLC0415 - the parquet TRL writes

    steps = list(range(1, 21))
    hist = [h for h in S.trl_history("1.16", steps, {"fmt": (lambda s: 0.8, lambda s: 0.1)}) if "loss" in h]
    path = S.write_trl_state(tmp_path / "out", hist)
    out = path if path.is_dir() else path.parent
    (out / "completions").mkdir()
    for s in steps:
        text = "Let me think. 3 + 4 = 7, so the answer is 7." if s < 10 else "the answer the answer " * 8
        rows = [{"step": s, "prompt": f"p{g}", "completion": text, "fmt": 0.8 + 0.1 * (i % 2), "advantage": 0.0}
                for g in range(2) for i in range(4)]
        pd.DataFrame(rows).to_parquet(out / "completions" / f"completions_{s:05d}.parquet")
    f = _findings(read_any_run(out))["degenerate_text"]
    assert f.onset == 10 and "repeated 4-grams" in f.evidence


def test_attention_only_lora_is_told_to_widen(tmp_path):
    """LoRA Without Regret as a treatment beside narrowing: peft's own adapter_config.json says q+v only, and
    held-out accuracy stays flat."""
    from peft import LoraConfig  # noqa: PLC0415 - the adapter writer

    hist = [h for h in S.trl_history("1.16", list(range(1, 41)), {"fmt": (lambda s: 0.5, lambda s: 0.1)})
            if "loss" in h]
    hist += [{"eval_accuracy": 0.41 + 0.002 * (s % 2), "eval_loss": 0.1, "step": s} for s in (0, 20, 40)]
    path = S.write_trl_state(tmp_path / "out", hist)
    out = path if path.is_dir() else path.parent
    LoraConfig(r=64, lora_alpha=128, target_modules=["q_proj", "v_proj"]).save_pretrained(out / "checkpoint-40")
    f = _findings(read_any_run(out))["narrow_lora"]
    assert "attention only" in f.evidence and "LoRA Without Regret" in f.reason


# ---- classes found on published runs no rule was written from (bench/_work/unseen, 2026-12-07) ----------------
def _hf_state(folder, rows: list[dict]):
    """A trainer_state.json as HF's Trainer writes it (log_history, one dict per logged step)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({
        "global_step": rows[-1]["step"], "max_steps": rows[-1]["step"], "logging_steps": 1, "log_history": rows}))
    return read_any_run(folder)


def _bar(step: int, total: int) -> str:
    return f"{100 * step // total:3d}%|##        | {step}/{total} [01:{step:02d}<44:45, 81.39s/it]"


def test_a_console_log_takes_each_dicts_step_from_the_training_bar_and_a_short_run_is_read_for_levels(tmp_path, cli):
    """A TRL console log printing every 10th step of 43, stopped at 36: the step is the training bar's position when
    the dict was printed (not index x another bar's total over the records); three records still show grad_norm 0
    with every completion cut (masked truncation leaves nothing to learn), which a reader sees at once."""
    dicts = [{"loss": -0.04, "grad_norm": 0.30, "learning_rate": 7.9e-06, "completions/mean_length": 142.7,
              "completions/max_length": 243.5, "completions/clipped_ratio": 0.30, "rewards/acc/mean": 0.58,
              "rewards/penalty/mean": -1.0, "rewards/penalty/std": 0.0, "reward": 1.88, "reward_std": 1.27,
              "frac_reward_zero_std": 0.4, "entropy": 1.03, "epoch": 0.23},
             {"loss": -0.008, "grad_norm": 0.0, "learning_rate": 5.6e-06, "completions/mean_length": 253.8,
              "completions/max_length": 256.0, "completions/clipped_ratio": 0.966, "rewards/acc/mean": 0.37,
              "rewards/penalty/mean": -1.0, "rewards/penalty/std": 0.0, "reward": 0.49, "reward_std": 1.17,
              "frac_reward_zero_std": 0.58, "entropy": 0.113, "epoch": 0.47},
             {"loss": 0.0, "grad_norm": 0.0, "learning_rate": 3.3e-06, "completions/mean_length": 255.8,
              "completions/max_length": 256.0, "completions/clipped_ratio": 0.995, "rewards/acc/mean": 0.48,
              "rewards/penalty/mean": -1.0, "rewards/penalty/std": 0.0, "reward": 0.93, "reward_std": 1.18,
              "frac_reward_zero_std": 0.58, "entropy": 0.0085, "epoch": 0.70}]
    lines = ["Map: " + _bar(1400, 1400)]  # another bar, with a larger total, before training starts
    for step in range(1, 37):
        lines.append(_bar(step, 43))
        if step % 10 == 0:
            lines.append(" " * 40 + repr(dicts[step // 10 - 1]))
    log = tmp_path / "run_terminal.md"
    log.write_text("\r".join(lines) + "\n")
    run = read_any_run(log)
    assert [m["step"] for m in run.metrics] == [10, 20, 30]
    found = _findings(run)
    assert {"too_few_records", "no_update", "component_never_pays"} <= set(found)
    assert "cut at the budget" in found["no_update"].evidence and "reward/penalty" in \
        found["component_never_pays"].evidence
    proc = cli("watch", "--once", "--format", "json", str(log))
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    alerts = {a["alert"]: a["step"] for a in lines if "alert" in a}
    assert alerts.get("truncation") == 10 and alerts.get("entropy_collapse") == 20


def test_a_constant_correctness_penalty_is_no_correct_answer_and_whole_batches_at_one_length_are_cut(tmp_path):
    """Unsloth's check_answer at -1 on all 100 records (the format components vary) is "no correct answer", not
    healthy; batches whose mean length is exactly the run's longest, at 14 steps, ran every completion to the cap."""
    rows = []
    for step in range(1, 101):
        length = 768.0 if step % 7 == 0 else 300.0 + (step * 37) % 400
        fmt = 0.75 if step % 3 == 0 else 0.0
        rows.append({"step": step, "loss": 0.0, "grad_norm": 0.2, "learning_rate": 5e-6, "kl": 0.001 * step / 50,
                     "completion_length": length, "rewards/check_answer": -1.0,
                     "rewards/match_format_exactly": fmt, "reward": -1.0 + fmt, "reward_std": 0.8})
    found = _findings(_hf_state(tmp_path / "unsloth", rows))
    assert "no_signal" in found and "-1 throughout" in found["no_signal"].evidence
    assert "cannot pay" in found["no_signal"].reason
    assert "truncation" in found and "exactly 768" in found["truncation"].evidence
    # a signed correctness reward whose batch mean moves (-2.6, -2.0, ...) can hide right answers: not no_signal
    for i, r in enumerate(rows):
        r["rewards/check_answer"] = -2.0 - 0.625 * (i % 3)
    assert "no_signal" not in _findings(_hf_state(tmp_path / "signed", rows))


def test_a_custom_table_is_read_by_what_its_columns_mean(tmp_path):
    """An author's own CSV of a verl run: reward_mean, validation_accuracy, zero_std_group_ratio, and both kl
    (PPO's old-vs-new, signed) and kl_loss (the KL to the reference): the reference KL is kl_loss."""
    head = "global_step,reward_mean,reward_std,validation_accuracy,kl,kl_loss,entropy,response_length_mean," \
           "zero_std_group_ratio,grad_norm"
    rows = [head]
    for step in range(1, 21):
        acc = {10: "0.4307", 20: "0.4493"}.get(step, "")
        rows.append(f"{step},{-0.34 + 0.002 * step:.4f},0.6,{acc},{(-1) ** step * 3e-5},{1.2e-4 * step:.6f},0.33,"
                    f"{1768 + 17 * step},{0.4 + 0.01 * (step % 5)},0.15")
    path = tmp_path / "training_metrics.csv"
    path.write_text("\n".join(rows) + "\n")
    run = read_any_run(path)
    assert run.metrics[-1]["reward"] == pytest.approx(-0.30) and run.metrics[-1]["kl"] == pytest.approx(0.0024)
    assert [e["accuracy"] for e in run.eval if "accuracy" in e] == [0.4307, 0.4493]
    assert run.metrics[-1]["frac_zero_std"] == pytest.approx(0.4) and "completion_length" in run.metrics[-1]
    assert "cannot_judge" not in _findings(run)


def test_grad_norm_logged_as_0_while_the_kl_grows_is_a_loggers_0_not_no_update(tmp_path):
    rows = [{"step": s, "loss": 0.01, "grad_norm": 0.0, "learning_rate": 1e-6, "kl": 0.002 * s,
             "reward": 0.3 + 0.01 * s, "reward_std": 0.3, "completion_length": 120.0 + s} for s in range(1, 31)]
    assert "no_update" not in _findings(_hf_state(tmp_path / "zero3", rows))
    for r in rows:
        r["kl"] = 0.0003
    assert "no_update" in _findings(_hf_state(tmp_path / "frozen", rows))


def test_a_terminal_capture_with_hard_wrapped_dicts_is_read(tmp_path, cli):
    """tmux / screen captures wrap each printed dict at the terminal's width, inside keys and numbers: the dict is
    joined back, not refused (and watch on a file it cannot read says so, not "run directory not found")."""
    width, lines = 120, []
    for step in range(1, 5):
        d = {"loss": 0.05, "grad_norm": 5.0 + step, "learning_rate": 5e-07, "completions/mean_length": 212.6875,
             "completions/clipped_ratio": 0.0, "rewards/correctness_reward_func/mean": 0.125 * (step == 3),
             "rewards/strict_format_reward_func/mean": 0.0, "reward": 0.1579999998211860 * step, "reward_std": 0.3,
             "kl": 0.0002 * step, "epoch": 0.05 * step}
        text = f"  {5 * step}%|##   | {step}/20 [05:56<1:52:59, 356.80s/it]" + repr(d)
        lines += [text[i:i + width] for i in range(0, len(text), width)]
    log = tmp_path / "train_excerpt.log"
    log.write_text("\n".join(lines) + "\n")
    run = read_any_run(log)
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4]
    assert run.metrics[0]["reward"] == pytest.approx(0.1579999998211860)
    assert "component_never_pays" in _findings(run)  # strict format 0 on all 4 records while the reward varies
    junk = tmp_path / "notes.txt"
    junk.write_text("nothing here\n")
    proc = cli("watch", "--once", str(junk))
    assert proc.returncode == 2 and "not a log mechdiag reads" in proc.stderr


def test_a_signal_that_died_after_a_blow_up_names_the_blow_up_not_the_sampler(tmp_path):
    """KL 10,000 nats/token at the first record, then every completion cut and every group alike to the end (a
    published Unsloth run): no_signal from the step the signal went, caused by the blow-up, with a smaller step;
    kl_blowup names the peak and the gradient beside it though the KL came back down."""
    rows = []
    for i, step in enumerate(range(10, 410, 10)):
        kl = 10832.9 / (3 ** i) if i < 12 else 0.04
        rows.append({"step": step, "loss": 1083.3 if i == 0 else 0.004,
                     "grad_norm": 421404.0 if i == 0 else 0.3 + i % 3,
                     "learning_rate": 5e-6, "kl": kl, "reward": 0.0242 if i == 0 else 0.0,
                     "reward_std": 0.0015 if i == 0 else 0.0, "frac_reward_zero_std": 0.975 if i == 0 else 1.0,
                     "completions/clipped_ratio": 1.0, "completions/mean_length": 128.0,
                     "completions/max_length": 128.0, "rewards/fbeta_reward/mean": 0.0242 if i == 0 else 0.0,
                     "rewards/fbeta_reward/std": 0.0015 if i == 0 else 0.0})
    found = _findings(_hf_state(tmp_path / "fbeta", rows))
    assert "from step 20 to the end" in found["no_signal"].evidence
    assert found["no_signal"].data["cause"] == "the policy blew up" and "smaller step" in found["no_signal"].reason
    assert "kl peaked at 1.08e+04 at step 10" in found["kl_blowup"].evidence
    assert "grad_norm peaked at 4.21e+05" in found["kl_blowup"].evidence
    assert "no reward function spreads" in found["low_diversity"].evidence


def test_a_reward_stuck_at_its_floor_is_no_signal_with_its_cause_left_open(tmp_path):
    """A published Unsloth run: reward -2.0 with every group alike on 18 of 20 records (98% of groups alike over the
    run), the other two a sliver: no_signal, not low diversity for a hotter sampler; with no completions, no format
    component and no correctness stream in the logs, the cause is not guessed."""
    rows = [{"step": 5 * k, "loss": 0.0, "grad_norm": 0.001, "learning_rate": 5e-6, "kl": 0.003,
             "reward": -1.9 if k in (10, 14) else -2.0, "reward_std": 0.2 if k in (10, 14) else 0.0,
             "frac_reward_zero_std": 0.8 if k in (10, 14) else 1.0, "rewards/tsc_reward_fn/mean": -2.0,
             "completions/clipped_ratio": 0.05, "completions/mean_length": 90.0, "completions/max_length": 128.0}
            for k in range(1, 21)]
    found = _findings(_hf_state(tmp_path / "stuck", rows))
    assert "98% of groups alike over the run" in found["no_signal"].evidence
    assert found["no_signal"].data["cause"] == "not shown by the logs" and found["no_signal"].changes == []
    assert "low_diversity" not in found or found["low_diversity"].changes == []  # waits behind no_signal
    # a run whose groups differ on a fifth of the records is low diversity, not no signal
    for r in rows[:5]:
        r["frac_reward_zero_std"], r["reward_std"], r["reward"] = 0.6, 0.3, -1.5
    assert "no_signal" not in _findings(_hf_state(tmp_path / "sparse", rows))


def test_a_printed_dict_cut_off_is_skipped_and_said_so_never_swallowing_the_next(tmp_path, cli):
    """A log pasted in part: one dict cut mid-line, then complete ones. The cut one is skipped and the reader says
    so; the dicts after it are read (not joined into it as a wrapped line)."""
    full = {"loss": 0.0, "grad_norm": 0.4, "learning_rate": 3e-6, "reward": -0.5, "reward_std": 0.3, "kl": 0.001,
            "epoch": 0.1}
    lines = [repr({**full, "epoch": 0.1 * i}) for i in range(1, 4)]
    lines.insert(2, repr(full)[:60])  # cut off
    lines.insert(3, "some chat text in between")
    log = tmp_path / "pasted.log"
    log.write_text("\n".join(lines) + "\n")
    run = read_any_run(log)
    assert len(run.metrics) == 3
    proc = cli("recommend", str(log))
    assert proc.returncode == 0 and "1 printed dict(s) cut off or unreadable, skipped" in proc.stderr


def _progress_table(titles: list[str], rows: list[list]) -> str:
    """The HTML HF's NotebookProgressCallback leaves in a notebook cell's output."""
    head = "".join(f"      <th>{t}</th>\n" for t in titles)
    body = "".join("    <tr>\n" + "".join(f"      <td>{v}</td>\n" for v in r) + "    </tr>\n" for r in rows)
    return ("<div>\n  <progress value='30' max='30' style='width:300px; height:20px;'></progress>\n"
            "  [30/30 12:34, Epoch 0/1]\n</div>\n<table border=\"1\" class=\"dataframe\">\n  <thead>\n"
            f" <tr style=\"text-align: left;\">\n{head}    </tr>\n  </thead>\n  <tbody>\n{body}  </tbody>\n</table><p>")


def test_a_notebook_is_read_from_its_saved_outputs(tmp_path, cli):
    """Colab / Jupyter users bring the .ipynb: its training cell holds HF's progress table (Unsloth's GRPO notebook:
    Step | Training Loss | reward | ... | rewards / <function>), and a later cell printed log dicts: two runs, told
    apart and named; the table's columns read as TRL's keys."""
    titles = ["Step", "Training Loss", "reward", "reward_std", "completion_length", "kl",
              "rewards / xmlcount_reward_func", "rewards / strict_format_reward_func",
              "rewards / correctness_reward_func"]
    rows = [[s, f"{0.0 if s < 3 else 0.0001 * s:.6f}", f"{0.1 + 0.05 * s:.6f}", "0.400000", f"{180 - s:.6f}",
             f"{0.0 if s == 1 else 0.0005 * s:.6f}", f"{0.05 + 0.01 * s:.6f}", "0.000000", f"{0.04 * s:.6f}"]
            for s in range(1, 31)]
    printed = "".join(repr({"loss": 0.0, "grad_norm": 0.5, "learning_rate": 5e-6, "reward": 0.2, "reward_std": 0.3,
                            "kl": 0.001 * i, "epoch": 0.01 * i}) + "\n" for i in range(1, 4))
    nb = {"nbformat": 4, "nbformat_minor": 0, "metadata": {}, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": ["# GRPO"]},
        {"cell_type": "code", "metadata": {}, "execution_count": 7, "source": ["trainer.train()"], "outputs": [
            {"output_type": "stream", "name": "stdout",
             "text": ["==((====))==  Unsloth - 2x faster free finetuning | Num GPUs used = 1\n"]},
            {"output_type": "display_data", "metadata": {},
             "data": {"text/html": _progress_table(titles, rows).splitlines(keepends=True),
                      "text/plain": ["<IPython.core.display.HTML object>"]}}]},
        {"cell_type": "code", "metadata": {}, "execution_count": 9, "source": ["trainer.train()"], "outputs": [
            {"output_type": "stream", "name": "stdout", "text": printed.splitlines(keepends=True)}]}]}
    path = tmp_path / "Qwen2.5_(3B)-GRPO.ipynb"
    path.write_text(json.dumps(nb))
    from mechdiag.integrations.readers import runs_in  # noqa: PLC0415
    assert [e["name"] for e in runs_in(path)] == [f"{path.name}:cell2", f"{path.name}:cell3"]
    run = read_any_run(path)
    assert [m["step"] for m in run.metrics] == list(range(1, 31))
    last = run.metrics[-1]
    assert last["reward"] == pytest.approx(1.6) and last["kl"] == pytest.approx(0.015)
    assert last["reward/correctness_reward_func"] == pytest.approx(1.2) and last["loss"] == pytest.approx(0.003)
    assert "component_never_pays" in _findings(run)
    proc = cli("recommend", str(path))
    assert proc.returncode == 0 and "holds 2 runs" in proc.stderr and "strict_format_reward_func" in proc.stdout
    nb["cells"][2]["outputs"].append({"output_type": "error", "ename": "OutOfMemoryError",
                                      "evalue": "CUDA out of memory. Tried to allocate 2.00 GiB", "traceback": []})
    path.write_text(json.dumps(nb))
    crashed = read_any_run(f"{path}#{path.name}:cell3")
    assert "OutOfMemoryError: CUDA out of memory" in _findings(crashed)["run_crashed"].evidence
    empty = tmp_path / "empty.ipynb"
    empty.write_text(json.dumps({**nb, "cells": nb["cells"][:1]}))
    proc = cli("recommend", str(empty))
    assert proc.returncode == 2 and "no training log" in proc.stderr and "Traceback" not in proc.stderr


def test_a_notebooks_eval_table_is_read_as_held_out(tmp_path):
    """With evaluation on, HF's notebook table titles each eval metric ("Validation Loss", "Accuracy"): read back as
    eval_loss and eval_accuracy, the held-out stream, while raw train keys stay train keys."""
    rows = [[s, f"{0.01 * s:.6f}", f"{0.5 - 0.01 * s:.6f}", f"{0.30 + 0.002 * s:.6f}", f"{0.2 + 0.005 * s:.6f}"]
            for s in range(10, 110, 10)]
    html = _progress_table(["Step", "Training Loss", "Validation Loss", "Accuracy", "reward"], rows)
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": [], "outputs": [
            {"output_type": "display_data", "metadata": {}, "data": {"text/html": html}}]}]}
    path = tmp_path / "grpo.ipynb"
    path.write_text(json.dumps(nb))
    run = read_any_run(path)
    assert [e["accuracy"] for e in run.eval if "accuracy" in e][-1] == pytest.approx(0.5)
    assert run.metrics[-1]["reward"] == pytest.approx(0.7)


def test_kl_exactly_0_is_no_update_only_where_the_kl_is_measured(tmp_path):
    """TRL and Unsloth log kl 0 at beta = 0 (no reference model): with beta unknown, a KL of exactly 0 is "cannot
    judge the drift", not no_update at 0.95 (a published SmolLM2 notebook, beta 0 in its config cell); the same
    log showing beta > 0 is a policy that never moved."""
    rows = [{"step": 5 * k, "loss": 0.0, "reward": 0.03 + 0.001 * k, "reward_std": 0.15, "kl": 0.0,
             "completions/mean_length": 245.0, "completions/clipped_ratio": 0.45, "completions/max_length": 384.0}
            for k in range(1, 11)]
    found = _findings(_hf_state(tmp_path / "beta0", rows))
    assert "no_update" not in found and "kl exactly 0 at every step" in found["cannot_judge"].evidence
    for r in rows:
        r["kl_coef"] = 0.04
    run = read_any_run(tmp_path / "beta0")
    run.provenance["keys"]["beta"] = {"how": "read", "value": 0.04, "evidence": "the config given"}
    assert "no_update" in _findings(run)


def test_a_log_of_loss_only_or_reward_only_is_never_healthy(tmp_path, cli):
    """A notebook titled GRPO that ran SFTTrainer (loss only) is said to look supervised; a custom loop's prints of
    the reward and loss only ("[Step 020] Loss = ... - Avg Reward = ...") are read, and what they cannot show is
    named instead of "healthy"."""
    sft = [{"step": 10 * k, "loss": 1.6 - 0.08 * k, "learning_rate": 2e-4, "grad_norm": 0.9} for k in range(1, 10)]
    found = _findings(_hf_state(tmp_path / "sft", sft))
    assert "supervised (SFT)" in found["cannot_judge"].evidence
    lines = [f"[Step {20 * k:03d}] Loss = {(-1) ** k * 0.3 * k:.4f} -  Avg Reward = {0.5 + 0.02 * (k % 5):.3f}"
             for k in range(1, 16)]
    log = tmp_path / "train_output.txt"
    log.write_text("Training...\n" + "\n".join(lines) + "\nDone.\n")
    run = read_any_run(log)
    assert [m["step"] for m in run.metrics] == [20 * k for k in range(1, 16)]
    assert run.metrics[-1]["reward"] == pytest.approx(0.5) and run.metrics[0]["loss"] == pytest.approx(-0.3)
    proc = cli("recommend", str(log), "--format", "json")
    assert proc.returncode == 0 and "reward and loss only" in proc.stdout and json.loads(proc.stdout)
    readme = tmp_path / "README.txt"
    readme.write_text("Step 1: install\nStep 2: train (loss: see below)\nStep 3: evaluate\n")
    assert cli("recommend", str(readme)).returncode == 2


def _monarch_log(path, steps: int, kl_at, crash: str | None = None) -> None:
    """A custom trainer's stdout (a published Monarch GRPO run's form): a planned total, one line per step, and
    the traceback it died with."""
    lines = ["Training: 7473 problems, 32 prompts/step, 233 steps/epoch, 233 total steps"]
    for k in range(steps):
        lines.append(f"step:{k} | policy_loss=0.0123 | kl_divergence={kl_at(k):.4f} | "
                     f"mean_reward={0.14 + 0.003 * k:.4f} | clip_fraction=0.0035 | grad_norm=0.86 | "
                     "step_time_seconds=82.1")
    if crash:
        lines += ["Traceback (most recent call last):", '  File "train.py", line 412, in <module>',
                  "    save_checkpoint(learner)", crash]
    path.write_text("\n".join(lines) + "\n")


def test_a_log_that_ends_in_a_traceback_is_a_crash_with_its_error(tmp_path, data_dir):
    """The run died after step 11 of 233 planned: the finding says so with the error, not only what the 12 steps
    show; the KL the trainer names kl_divergence is read as the KL."""
    log = tmp_path / "training.log"
    _monarch_log(log, 12, lambda k: 0.0006 * k, "ValueError: call_one requires exactly 1 actor, but mesh has 8")
    run = read_any_run(log)
    assert run.metrics[-1]["kl"] == pytest.approx(0.0066)
    found = _findings(run)
    assert "after step 11 of 233 planned: ValueError: call_one" in found["run_crashed"].evidence
    clean = tmp_path / "clean.log"
    _monarch_log(clean, 12, lambda k: 0.0006 * k)
    assert "run_crashed" not in _findings(read_any_run(clean))
    # a worker's traceback logged while the run went on (verl, Ray-prefixed) is not a crash; a checkpoint save that
    # died at the end of a verl run is
    assert "run_crashed" not in _findings(read_any_run(data_dir / "reallogs" / "verl-gui-cursor"))
    econ = _findings(read_any_run(data_dir / "reallogs" / "verl-econ-qwen7b"))["run_crashed"]
    assert "after step 699" in econ.evidence and "RuntimeError" in econ.evidence


def test_lone_kl_spikes_are_an_estimate_that_blew_up_not_a_step_too_large(tmp_path):
    """KL 36 at one step, 5 at another, each gone at the next (a published run that learned 0.14 -> 0.87): named
    as lone spikes with the sampler-gap advice and no change; a KL that stays up is a blow-up with a smaller step."""
    log = tmp_path / "training.log"
    _monarch_log(log, 233, lambda k: {25: 5.1, 68: 36.3, 147: 6.88}.get(k, 0.13))
    found = _findings(read_any_run(log))
    assert "spiked above 1 nats/token at 3 single records" in found["kl_blowup"].evidence
    assert found["kl_blowup"].changes == [] and "sampler" in found["kl_blowup"].reason
    held = tmp_path / "held.log"
    _monarch_log(held, 233, lambda k: 5.0 if 60 <= k < 70 else 0.13)
    f = _findings(read_any_run(held))["kl_blowup"]
    assert "peaked at 5 at step 60" in f.evidence and "lower learning_rate" in f.reason


def _step_log(path, rewards: list[float], kl_at, extra: str = "") -> None:
    """A custom trainer's stdout (the Monarch form): one line per step, no held-out stream."""
    lines = [f"step:{k} | policy_loss=0.0011 | kl_divergence={kl_at(k):.5f} | mean_reward={r:.4f} | "
             f"clip_fraction=0.02 | grad_norm=0.9{extra}" for k, r in enumerate(rewards)]
    path.write_text("\n".join(lines) + "\n")


def _wobble(k: int) -> float:
    """A deterministic step-to-step wobble of a batch mean (no trend): -1..1."""
    return ((k * 7919) % 13 - 6) / 6


def test_a_flat_reward_at_a_still_kl_without_an_eval_is_held_still(tmp_path):
    """A published custom run whose weight sync silently loaded nothing: reward 0.14 for 39 steps, KL 0.002, no
    eval. The train reward stands in for the eval; a rising reward, one too noisy to show a rise, and a beta-0
    log's KL of 0 are not a still policy."""
    flat = tmp_path / "flat.log"
    _step_log(flat, [0.14 + 0.03 * _wobble(k) for k in range(39)], lambda k: 0.0015 + 0.00003 * k)
    held = _findings(read_any_run(flat))["held_still"]
    assert "no eval stream: train reward" in held.evidence and "learning rate x" in held.reason
    rising = tmp_path / "rising.log"
    _step_log(rising, [0.14 + 0.01 * k + 0.03 * _wobble(k) for k in range(39)], lambda k: 0.0015 + 0.00003 * k)
    assert "held_still" not in _findings(read_any_run(rising))
    noisy = tmp_path / "noisy.log"  # a batch of 8 swinging -5..+5: no flatness can be read from it
    _step_log(noisy, [-2.5 + 4 * _wobble(k) for k in range(27)], lambda k: 0.0013)
    assert "held_still" not in _findings(read_any_run(noisy))
    beta0 = _hf_state(tmp_path / "beta0", [{"step": s, "loss": 0.0, "reward": 0.3 + 0.02 * _wobble(s),
                                            "reward_std": 0.3, "kl": 0.0, "grad_norm": 0.4} for s in range(1, 31)])
    assert "held_still" not in _findings(beta0)


def test_a_log_with_no_record_says_how_it_ended(tmp_path, cli):
    """Logs of launches that died before step 1 (verl's console: Ray start-up, then the driver's traceback) or kept
    only their progress bar are read, not refused: the crash with the function that raised it, or where the bar
    stopped; never "too few records, train longer". Text with neither is still not a log."""
    crash = tmp_path / "verl_demo.log"
    crash.write_text("\n".join([
        "2025-03-01 10:00:01,123\tINFO worker.py:1832 -- Started a local Ray instance.",
        "(main_task pid=19443) {'actor_rollout_ref': {'rollout': {'n': 5}}, 'trainer': {'total_epochs': 15}}",
        "(main_task pid=19443) Traceback (most recent call last):",
        "(main_task pid=19443) ImportError: flash_attn_2_cuda.so: undefined symbol: _ZNK3c1011StorageImpl",
        "Traceback (most recent call last):",
        '  File "verl/trainer/main_ppo.py", line 25, in main',
        "    run_ppo(config)",
        '  File "verl/utils/reward_score/__init__.py", line 45, in _default_compute_score',
        "    raise NotImplementedError",
        "NotImplementedError"]) + "\n")
    found = recommend([read_any_run(crash)]).findings
    assert [f.rule for f in found] == ["run_crashed"]
    assert "before its first record: NotImplementedError (raised in _default_compute_score)" in found[0].evidence
    assert "ImportError: flash_attn_2_cuda.so" in found[0].evidence  # the first error logged, where it differs
    bar = tmp_path / "grpo_train.log"
    bar.write_text("==((====))==  Unsloth - 2x faster free finetuning\n"
                   + "\r".join(_bar(s, 2196) for s in range(1, 98)) + "\n")
    judged = _findings(read_any_run(bar))
    assert set(judged) == {"cannot_judge"}
    assert "progress bar stops at step 97 of 2196" in judged["cannot_judge"].evidence
    for command in (("recommend",), ("watch", "--once"), ("report", "--out", str(tmp_path / "r.html"))):
        assert cli(*command, str(crash)).returncode == 0
    prose = tmp_path / "notes.txt"
    prose.write_text("We trained Qwen with GRPO and it went fine.\n")
    proc = cli("recommend", str(prose))
    assert proc.returncode == 2 and "not a log mechdiag reads" in proc.stderr


def test_a_notebook_exported_as_a_page_and_a_csv_counting_updates_are_read(tmp_path):
    """A notebook exported to Markdown keeps HF's progress table as HTML; an author's CSV counts its steps in an
    `update` column: both are runs, read by TRL's keys and by what the columns mean."""
    page = tmp_path / "maze_notebook_export.md"
    rows = [[s, 0.0, -2.75 + 0.09 * s, 3.0, 700 - 2 * s, 0.75 * (1 - s / 100) if s < 100 else 0.0, 0.001 * s]
            for s in range(1, 101, 9)]
    page.write_text("# Training\n\n```python\ntrainer.train()\n```\n\n" + _progress_table(
        ["Step", "Training Loss", "reward", "reward_std", "completions / mean_length", "completions / clipped_ratio",
         "kl"], rows) + "\n\nDone.\n")
    run = read_any_run(page)
    assert [m["step"] for m in run.metrics] == [r[0] for r in rows]
    assert run.metrics[-1]["completion_length"] == rows[-1][4]
    assert run.metrics[0]["completion_clipped_ratio"] == rows[0][5]
    csv = tmp_path / "grpo_training_metrics.csv"
    csv.write_text("update,reward_mean,reward_std,grad_norm,kl_reason\n" + "".join(
        f"{u},{0.2 + 0.005 * u:.4f},0.3,0.2,GRPO beta=0.0; reference-model KL is not computed\n" for u in range(1, 33)))
    got = read_any_run(csv)
    assert [m["step"] for m in got.metrics] == list(range(1, 33)) and got.metrics[-1]["reward"] == pytest.approx(0.36)


def test_a_cut_that_cost_nothing_is_not_truncation_and_no_default_budget_is_judged(tmp_path):
    """75% cut at first, then the policy fit its budget while its reward rose -2.75 -> 5: the cut cost nothing the
    logs show. The same shortening with a flat reward is truncation. A budget the run does not show is never
    mechdiag's default ("96 tokens = 201% of the 48-token budget")."""
    def state(name, reward_at):
        return _hf_state(tmp_path / name, [
            {"step": s, "loss": 0.0, "reward": reward_at(s), "reward_std": 2.0, "kl": 0.01,
             "completions/mean_length": 700 - 2.5 * s, "completions/clipped_ratio": max(0.0, 0.75 - 0.01 * s)}
            for s in range(1, 101, 3)])
    assert "truncation" not in _findings(state("gained", lambda s: -2.75 + 0.08 * s + 0.3 * _wobble(s)))
    flat = _findings(state("flat", lambda s: 0.5 + 0.3 * _wobble(s)))
    assert "the policy shortened its completions to fit the budget" in flat["truncation"].evidence
    unknown = _hf_state(tmp_path / "nobudget", [
        {"step": s, "loss": 0.0, "reward": 0.3 + 0.05 * _wobble(s), "reward_std": 0.3, "kl": 0.01,
         "completions/mean_length": 90.0 + 0.37 * s, "completions/clipped_ratio": 0.09 if s < 8 else 0.0}
        for s in range(1, 33)])
    assert "budget" not in " ".join(f.evidence for f in recommend([unknown]).findings)


def test_a_reward_that_fell_from_its_best_and_stayed_down_is_named(tmp_path):
    """A published Unsloth run: reward 1.38 -> 1.67 by step 15, then about 1.1 to step 100 with a small KL and its
    groups still differing: unlearning, not health. A run that rises and holds, and one whose held-out accuracy
    rose while its train reward fell (a harder curriculum), are not."""
    def state(name, reward_at, acc=None):
        rows = [{"step": s, "loss": 0.0, "reward": reward_at(s), "reward_std": 0.4, "kl": 0.00015 * s,
                 "grad_norm": 0.15} for s in range(5, 101, 5)]
        if acc:
            rows += [{"step": s, "eval_accuracy": a} for s, a in acc]
        return _findings(_hf_state(tmp_path / name, rows))
    peak = {5: 1.38, 10: 1.63, 15: 1.67, 20: 1.56}
    fell = state("fell", lambda s: peak.get(s, 1.1 + 0.08 * _wobble(s)))
    assert "reward_declined" in fell and "(its best)" in fell["reward_declined"].evidence
    assert "reward_declined" not in state("held", lambda s: peak.get(s, 1.6 + 0.08 * _wobble(s)))
    harder = state("harder", lambda s: peak.get(s, 1.1 + 0.08 * _wobble(s)), acc=[(0, 0.30), (50, 0.38), (100, 0.45)])
    assert "reward_declined" not in harder


def test_entropy_at_its_floor_in_an_excerpt_is_a_collapse(tmp_path):
    """A TinyZero excerpt (steps 383-399): entropy 0.005 at every record, every answer one template, the score 0.19
    of a best of 1.0. The fall is before the log; the floor is a finding. The same entropy on a run at its ceiling
    is a converged policy, not a finding."""
    def verl(name, score):
        log = tmp_path / name
        log.write_text("\n".join(
            f"(main_task pid=19799) step:{s} - critic/kl:0.75 - actor/entropy_loss:0.005 - actor/pg_loss:0.01 - "
            f"critic/score/mean:{score + 0.03 * _wobble(s):.3f} - critic/score/max:1.000 - critic/score/min:0.100 - "
            f"response_length/mean:35.0 - response_length/clip_ratio:0.000" for s in range(383, 400)) + "\n")
        return _findings(read_any_run(log))
    stuck = verl("stuck.log", 0.19)
    assert "entropy_collapse" in stuck and "0.01 nats/token" in stuck["entropy_collapse"].evidence
    assert "entropy_collapse" not in verl("done.log", 0.97)


def test_without_an_eval_a_kl_that_climbs_while_the_reward_gains_nothing_is_drift(tmp_path):
    """A published TRL run, resumed near its ceiling: reward 0.92 of a 0-1 reward (its batch maximum logged as
    reward_max) for 120 steps while the KL climbs 0.001 -> 0.09. Saturated early, and drifting; the same KL climb
    under a reward that rises is learning."""
    def log(name, reward_at):
        path = tmp_path / name
        path.write_text("\n".join(
            f"{{'reward': '{reward_at(s):.4f}', 'reward_max': '1', 'frac_reward_zero_std': '0', 'loss': '0.001', "
            f"'grad_norm': '0.9', 'kl': '{0.0007 * 1.04 ** s:.5f}', 'step_time': '5.9'}}" for s in range(120)) + "\n")
        return _findings(read_any_run(path))
    flat = log("flat.log", lambda s: 0.92 + 0.02 * _wobble(s))
    assert {"early_saturation", "kl_drift"} <= set(flat) and "no eval stream" in flat["kl_drift"].evidence
    assert "scale 0..1" in flat["early_saturation"].evidence
    assert "kl_drift" not in log("learning.log", lambda s: 0.3 + 0.004 * s + 0.02 * _wobble(s))


def test_an_alert_on_a_sparse_log_needs_two_records(tmp_path):
    """A published TRL log every 5 steps: entropy flat at 0.35 but for one record at 0.46; the live view raised
    entropy_rise on that one record against the first. A rise that holds over two records still fires."""
    def alerts(name, entropy_at):
        run = _hf_state(tmp_path / name, [{"step": s, "loss": 0.0, "reward": 0.4, "reward_std": 0.3, "kl": 0.001,
                                           "entropy": entropy_at(s), "frac_reward_zero_std": 0.2}
                                          for s in range(5, 301, 5)])
        return {a.alert for a in watch(f"{run.path}", once=True, fmt="json", echo=lambda _: None).alerts}
    flat = {5: 0.30, 225: 0.46}  # its first record low, one record high: 1.53x by one record each
    assert "entropy_rise" not in alerts("blip", lambda s: flat.get(s, 0.35 + 0.01 * _wobble(s)))
    assert "entropy_rise" in alerts("rise", lambda s: 0.6 if s >= 220 else 0.35 + 0.01 * _wobble(s))


def test_a_custom_loops_counter_fractions_and_components_are_read_and_a_signed_kl_is_not_a_kl(tmp_path):
    """A custom loop counting "(N/M)" in its lines (minimind's "Epoch:[1/1](N/9751), Reward: ..., KL_ref: ...") and
    one printing shares as counts ("correct=1/2") and its reward's components (format_reward, answer_reward). A
    "KL" negative on most records is a signed log-ratio (k1), not a KL: it is never read as a still policy. A
    checkpoint-loading bar is not a training bar."""
    mini = tmp_path / "grpo.log"
    mini.write_text("Loading checkpoint shards: 100%|##########| 2/2 [00:03<00:00,  1.50s/it]\n" + "\n".join(
        f"Epoch:[1/1]({s}/9751), Reward: {-1.8 + 0.3 * _wobble(s):.4f}, KL_ref: {-0.03 + 0.01 * _wobble(s):.4f}, "
        f"Adv Std: 0.9258, Actor Loss: 0.0000, Avg Response Len: {280 + s}.00, Learning Rate: 0.00000030"
        for s in range(1, 60)) + "\n")
    run = read_any_run(mini)
    assert [m["step"] for m in run.metrics] == list(range(1, 60))
    assert run.metrics[0]["completion_length"] == 281 and "kl" in run.metrics[0]
    found = _findings(run)
    assert "held_still" not in found and "negative on" in found["cannot_judge"].evidence
    loop = tmp_path / "custom.log"
    loop.write_text("".join(f"__main__ - INFO - step={s} loss=0.000000 reward={r:.4f} format_reward=0.5000 "
                            f"answer_reward={r:.4f} correct={int(2 * r)}/2 reward_groups=10\n"
                            for s, r in zip(range(1, 41), [0.5, 0.0, 1.0, 0.5] * 10, strict=True)))
    rows = read_any_run(loop).metrics
    assert rows[0]["reward/correct"] == 0.5 and rows[2]["reward/correct"] == 1.0
    assert rows[0]["reward/format"] == 0.5 and rows[1]["reward/answer"] == 0.0
    loading_only = tmp_path / "load.log"
    loading_only.write_text("Loading checkpoint shards: 100%|##########| 2/2 [00:03<00:00,  1.50s/it]\n"
                            "Map: 100%|##########| 7473/7473 [00:01<00:00, 5100.00 examples/s]\n")
    with pytest.raises(UserError, match="not a log mechdiag reads"):
        read_any_run(loading_only)


def test_a_progress_table_copied_as_text_and_a_stated_logging_interval_are_read(tmp_path):
    """Users copy a notebook's progress table out as tab-separated text beside Unsloth's banner, and paste printed
    dicts from a notebook whose code states logging_steps: the table is a run (its "No Log" cells absent), and the
    dicts' steps are the record index times the stated interval, not the index."""
    titles = ["Step", "Training Loss", "reward", "reward_std", "completions / clipped_ratio", "kl"]
    rows = ["\t".join(map(str, [s, "0.000000", "0.000000", "0.000000", "1.000000" if s > 6 else "0.500000",
                                "No Log" if s % 2 else "0.000000"])) for s in range(1, 21)]
    text = tmp_path / "train_output.txt"
    text.write_text("==((====))==  Unsloth - 2x faster free finetuning | Num GPUs used = 1\n"
                    "   \\\\   /|    Num examples = 64 | Num Epochs = 1 | Total steps = 20\n"
                    "[20/20 12:34, Epoch 0/1]\n" + "\t".join(titles) + "\n" + "\n".join(rows) + "\n")
    run = read_any_run(text)
    assert [m["step"] for m in run.metrics] == list(range(1, 21)) and run.metrics[-1]["completion_clipped_ratio"] == 1
    assert "kl" not in run.metrics[0] and run.metrics[1]["kl"] == 0
    assert "no_signal" in _findings(run)
    nb = tmp_path / "launch.ipynb"
    dicts = "".join(f"{{'loss': 0.0, 'grad_norm': 1.2, 'learning_rate': 1e-06, 'reward': {-368 + 30 * i}, "
                    f"'reward_std': 40.0, 'completion_length': 180.0, 'kl': 0.001, 'epoch': {0.033 * i:.2f}}}\n"
                    for i in range(1, 12))
    nb.write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": ["args = GRPOConfig(output_dir='out', logging_steps = 10, beta=0.04)\n"],
         "outputs": []},
        {"cell_type": "code", "source": ["trainer.train()\n"],
         "outputs": [{"output_type": "stream", "name": "stdout", "text": [dicts]}]}]}))
    assert [m["step"] for m in read_any_run(nb).metrics] == list(range(10, 111, 10))


def test_a_loop_logging_each_step_without_its_number_and_a_reward_functions_prints(tmp_path):
    """A course's GRPO loop logs one line a step with no step number ("- train - INFO - rl_loss: ..., l2_norm: ...,
    token_entropy: ...") and its reward function prints one completion's rewards as a dict: the lines are the run,
    one a step; the dicts of one completion are not a trainer's records."""
    log = tmp_path / "rl.log"
    lines = []
    for i in range(1, 19):
        lines.append(f"2025-09-23 09:{i:02d}:00,984 - train - INFO - rl_loss: {-0.002 * _wobble(i):.5f}, time: 109.1, "
                     f"l2_norm: 0.14, token_entropy: {0.8 - 0.02 * i:.4f}, reward_data: {{'total_num': 256}}")
        lines.append(f"2025-09-23 09:{i:02d}:30,089 - train - INFO - reward: {{'format_reward': 1.0, 'answer_reward': "
                     f"0.0, 'reward': 0.0}}")
    log.write_text("\n".join(lines) + "\n")
    run = read_any_run(log)
    assert [m["step"] for m in run.metrics] == list(range(1, 19))
    assert run.metrics[-1]["entropy"] == pytest.approx(0.44) and "reward" not in run.metrics[0]


def test_a_flat_reward_with_nothing_else_to_say_is_no_progress(tmp_path):
    """A custom loop with groups of 2 logging only its reward and loss: 0.06 -> 0 over 200 steps. No rule names a
    cause (no KL, no spread), so the flat reward itself is the finding, with what to log to tell the causes apart;
    a rising reward of the same form is not, and a rule that names a cause (held_still) speaks alone."""
    def log(name, reward_at):
        path = tmp_path / name
        path.write_text("".join(f"__main__ - INFO - step={s} loss=0.000000 reward={reward_at(s):.4f}\n"
                                for s in range(1, 201)))
        return _findings(read_any_run(path))
    flat = log("flat.log", lambda s: 0.5 if s % 9 == 0 and s < 140 else 0.0)  # a group of 2 half right, rarely
    assert "no_progress" in flat and "kl or the groups' spread" in flat["no_progress"].reason
    assert "no_progress" not in log("rising.log", lambda s: 0.002 * s + 0.03 * _wobble(s))
    still = tmp_path / "still.log"
    _step_log(still, [0.14 + 0.03 * _wobble(k) for k in range(39)], lambda k: 0.0015)
    assert "held_still" in _findings(read_any_run(still)) and "no_progress" not in _findings(read_any_run(still))
