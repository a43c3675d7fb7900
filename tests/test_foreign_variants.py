"""Foreign logs in the variants users bring, written from each trainer's documented formats (tests/synth_runs.py):
TRL 0.14..1.x key spellings, Unsloth's trainer_state, verl's file logger and three console value styles, W&B
exports (API history and chart CSV) of TRL, verl and OpenRLHF runs, OpenRLHF's TensorBoard events; NaN/inf,
missing steps, interleaved eval records, several reward functions with their std, gzip, CRLF, a torn last line.
Each reads with the right number of records and the values written, or stops with one line and exit 2."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from mechdiag import config as C
from mechdiag.cli import main
from mechdiag.errors import UserError
from mechdiag.integrations.provenance import own_terms_text
from mechdiag.integrations.readers import read_any_run
from mechdiag.recommend import Change, recommend
from tests import synth_runs as S

STEPS = list(range(1, 21))
FUNCS = {"correct": (lambda s: s / 40, lambda s: 0.4), "fmt": (lambda s: 0.5, lambda s: 0.0)}


def _by_step(run):
    return {m["step"]: m for m in run.metrics}


@pytest.mark.parametrize("version", S.TRL_VERSIONS)
def test_trl_versions_read_as_written(tmp_path, version):
    hist = S.trl_history(version, STEPS, FUNCS, eval_every=5, nan_at=7)
    run = read_any_run(S.write_trl_state(tmp_path, hist))
    assert (len(run.metrics), len(run.eval)) == (20, 4)
    got = _by_step(run)
    for s in (1, 10, 20):
        raw = next(h for h in hist if h.get("step") == s and "loss" in h)
        assert (got[s]["reward"], got[s]["grad_norm"], got[s]["lr"]) == (raw["reward"], raw["grad_norm"],
                                                                          raw["learning_rate"])
        assert got[s]["completion_length"] == raw.get("completions/mean_length", raw.get("completion_length"))
        assert got[s]["reward/correct"] == s / 40  # per-function mean, either spelling
    assert got[7]["grad_norm"] is None and got[7]["loss"] is None  # NaN and inf kept as null (a finding), not dropped
    assert got[8]["grad_norm"] == 0.0  # an exact 0 is a value
    assert not any(k.startswith("trl/") for m in run.metrics + run.eval for k in m)  # every key mapped
    assert [e["step"] for e in run.eval] == [5, 10, 15, 20] and run.eval[1]["eval_reward"] == 0.6
    if version != "0.14":
        assert (got[20]["reward_std/correct"], got[20]["terminated_length"], got[20]["completion_length_max"]) == \
            (0.4, 110.0, 256.0)
        assert run.provenance["keys"]["max_completion_tokens"]["value"] == 256  # inferred from the logs
    assert run.provenance["max_reward"]["value"] == pytest.approx(0.5 + 0.5)  # its own functions' best


def test_trl_missing_steps_crlf_gzip_and_one_file(tmp_path):
    sparse = [5, 10, 15, 25, 30, 40, 45, 50]
    run = read_any_run(S.write_trl_state(tmp_path / "sparse", S.trl_history("0.23", sparse, FUNCS)))
    assert [m["step"] for m in run.metrics] == sparse
    for kw in ({"crlf": True}, {"gz": True}):
        path = S.write_trl_state(tmp_path / next(iter(kw)), S.trl_history("1.16", STEPS, FUNCS), **kw)
        for target in (path.parent, path):  # the folder and the file itself
            r = read_any_run(target)
            assert len(r.metrics) == 20 and _by_step(r)[20]["reward"] == 1.0, kw


@pytest.mark.parametrize("version", ["0.14", "0.23"])
def test_wandb_export_of_a_trl_run(tmp_path, version):
    hist = S.trl_history(version, STEPS, FUNCS, eval_every=5)
    rows = S.wandb_trl_rows(hist)
    api = read_any_run(S.wandb_csv(tmp_path / "history.csv", rows, "train/global_step"))
    chart = read_any_run(S.wandb_csv(tmp_path / "chart.csv", [r for r in rows if "train/reward" in r],
                                     "train/global_step", run_name="grpo - run 1"))
    for run in (api, chart):
        assert run.provenance["trainer"] == "trl" and len(run.metrics) == 20
        m = _by_step(run)[10]
        assert (m["reward"], m["reward/correct"], m["completion_length"], m["kl"]) == (0.75, 0.25, 110.0, 0.01)
        assert not any(k.startswith(("trl/", "_")) for k in m)  # W&B's _runtime/_timestamp are not metrics
    assert len(api.eval) == 4 and api.eval[0]["eval_reward"] == 0.55
    bom = tmp_path / "excel.csv"  # re-saved by a spreadsheet: a byte-order mark before the header
    bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "history.csv").read_bytes().replace(b"\n", b"\r\n"))
    assert len(read_any_run(bom).metrics) == 20


@pytest.mark.parametrize("style", ["pformat", "3f", "fmv"])
@pytest.mark.parametrize("prefix", ["(TaskRunner pid=7) ", "", "INFO:root:"])
def test_verl_console_styles(tmp_path, style, prefix):
    run = read_any_run(S.write_verl_console(tmp_path / "train.log", STEPS, style, prefix, val_every=5, nan_at=3))
    assert (len(run.metrics), len(run.eval)) == (20, 5)  # the base validation at step 0 included
    got = _by_step(run)
    places = 3 if style == "3f" else 9
    assert got[10]["reward"] == pytest.approx(0.2, abs=10 ** -places)
    assert got[10]["reward/acc"] == pytest.approx(0.06, abs=10 ** -places)  # reward_extra_info/<f>
    assert got[10]["kl"] == pytest.approx(0.01, abs=10 ** -places)
    assert "grad_norm" not in got[3] and got[5]["grad_norm"] == 0.0
    assert run.eval[0]["step"] == 0 and run.eval[2]["accuracy"] == pytest.approx(0.4, abs=10 ** -places)
    assert run.provenance["keys"]["max_completion_tokens"]["value"] == 1024


def test_verl_console_crlf_gzip_torn_and_ppo(tmp_path):
    run = read_any_run(S.write_verl_console(tmp_path / "x.log.gz", STEPS, crlf=True, torn=True, gz=True))
    assert len(run.metrics) == 20 and run.metrics[-1]["step"] == 20  # the line cut mid-write left out
    ppo = read_any_run(S.write_verl_console(tmp_path / "ppo.log", STEPS, ppo=True))
    m = _by_step(ppo)[4]
    assert (m["kl"], m["kl_coef"], m["value_loss"]) == (0.002, 0.001, 0.5)
    assert ppo.provenance["keys"]["beta"] == {"how": "read", "value": 0.001,
                                              "evidence": "the logged kl coefficient (last step)"}
    jl = read_any_run(S.write_verl_jsonl(tmp_path / "metrics.jsonl", STEPS, torn=True, val_every=5))
    assert (len(jl.metrics), len(jl.eval)) == (20, 4)
    wb = read_any_run(S.wandb_csv(tmp_path / "verl_wandb.csv", [{"_step": s, **S.verl_data(s, val=s % 5 == 0)}
                                                                for s in STEPS]))
    assert wb.provenance["trainer"] == "verl" and (len(wb.metrics), len(wb.eval)) == (20, 4)
    assert _by_step(wb)[10]["reward"] == pytest.approx(0.2)


def test_prose_saying_step_is_no_record(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("".join(f"(Worker pid=1) ValueError: step 0 - extract action failed from: Thought: {i}\n"
                           for i in range(5)) + S.verl_console_line(1, S.verl_data(1)) + "\n")
    assert len(read_any_run(log).metrics) == 1


@pytest.mark.parametrize("ppo", [False, True])
def test_openrlhf_wandb_and_tensorboard(tmp_path, ppo):
    rows = S.openrlhf_rows(STEPS, ppo=ppo, eval_every=5)
    wb = read_any_run(S.wandb_csv(tmp_path / "orl.csv", rows, "train/global_step"))
    tb_dir = S.write_openrlhf_tensorboard(tmp_path / "tb", STEPS, ppo=ppo, eval_every=5)
    tb = read_any_run(tmp_path / "tb")  # use_tensorboard's folder: the one run under it is found
    one = read_any_run(next(tb_dir.glob("*tfevents*")))
    for run in (wb, tb, one):
        assert run.provenance["trainer"] == "openrlhf" and (len(run.metrics), len(run.eval)) == (20, 4)
        m = _by_step(run)[10]
        assert m["reward"] == pytest.approx(0.4) and m["kl"] == pytest.approx(0.01)
        assert m["completion_length"] == pytest.approx(410.0) and m["completion_clipped_ratio"] == pytest.approx(0.05)
        assert m["entropy"] == pytest.approx(0.65) and ("value_loss" in m) == ppo
        assert run.eval[0]["accuracy"] == pytest.approx(0.35)
        assert run.provenance["keys"]["learning_rate"]["value"] == pytest.approx(5e-7)


def test_tensorboard_without_the_package_one_line(tmp_path):
    S.write_openrlhf_tensorboard(tmp_path / "tb", STEPS)
    code = ("import sys; sys.modules['tensorboard'] = None\n"  # the package absent: its import fails
            "from mechdiag.cli import main; main(['recommend', sys.argv[1]])")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tb")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "mechdiag[trackers]" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_logs_one_line_exit_2(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.log").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "trainer_state.json").write_text('{"log_history": [{"step": 1, "lo')
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "trainer_state.json").write_text(json.dumps({"log_history": [3, "x", {"step": "?"}]}))
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1.host").write_bytes(b"\x00garbage" * 10)
    runner = CliRunner()
    for bad in ("empty.jsonl", "binary.log", "torn", "odd", "tb"):
        for cmd in (["recommend"], ["watch", "--once"], ["report", "--out", str(tmp_path / "r.html")]):
            res = runner.invoke(main, [cmd[0], str(tmp_path / bad), *cmd[1:]])
            assert res.exit_code == 2 and res.exception is None or isinstance(res.exception, SystemExit), \
                (bad, cmd, res.output)
            assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, (bad, cmd)
    assert not (tmp_path / "r.html").exists()


# ---- advice never starts from a value the run did not have ------------------------------------------------
def _changes_read(run) -> list[str]:
    """The keys recommend changes that the run did not hold as read values (must be none)."""
    keys = (run.provenance or {}).get("keys", {})
    return [c.key for c in recommend([run]).changes
            if (keys.get(c.key) or keys.get(c.key.split(".", 1)[0]) or {}).get("how") != "read"]


def test_no_change_from_a_value_the_run_did_not_have(data_dir, tmp_path):
    runs = [read_any_run(p) for p in sorted((data_dir / "reallogs").iterdir()) if p.is_dir()]
    runs += [read_any_run(S.write_trl_state(tmp_path / v, S.trl_history(v, STEPS, FUNCS))) for v in S.TRL_VERSIONS]
    runs.append(read_any_run(S.write_verl_console(tmp_path / "v.log", STEPS, val_every=5)))
    runs.append(read_any_run(S.wandb_csv(tmp_path / "o.csv", S.openrlhf_rows(STEPS, eval_every=5),
                                         "train/global_step")))
    assert len(runs) == len([p for p in (data_dir / "reallogs").iterdir() if p.is_dir()]) + 6
    for run in runs:
        assert _changes_read(run) == [], run.path


def test_a_run_with_no_config_gets_advice_from_its_logs(tmp_path):
    # every completion cut at the cap: truncation fires, but the cap is only seen in the log
    hist = [{**h, "completions/clipped_ratio": 0.9, "completions/max_length": 384.0}
            for h in S.trl_history("0.23", STEPS, FUNCS) if "loss" in h]
    run = read_any_run(S.write_trl_state(tmp_path, hist))
    assert {e["how"] for e in run.provenance["keys"].values()} == {"inferred"}  # no config file at all
    rec = recommend([run])
    assert "truncation" in [f.rule for f in rec.findings] and rec.changes == []
    reason = next(f.reason for f in rec.findings if f.rule == "truncation")
    assert "raise max_completion_length above the observed 384" in reason


def test_refined_settings_in_each_trainers_terms():
    changes = [Change("beta", 0.001, 0.0001), Change("learning_rate", 1e-6, 1e-5), Change("seed", 1, 2)]
    cfg = C.from_dict({})
    verl = own_terms_text("verl", changes, cfg)
    assert "actor_rollout_ref.actor.kl_loss_coef=0.0001" in verl and "actor_rollout_ref.actor.optim.lr=1e-05" in verl
    orl = own_terms_text("openrlhf", changes, cfg)
    assert "--init_kl_coef 0.0001" in orl and "--actor_learning_rate 1e-05" in orl and "# seed" in orl
    trl = own_terms_text("unsloth", changes, cfg)
    assert "beta=0.0001" in trl and "learning_rate=1e-05" in trl and "GRPOConfig" in trl
    assert own_terms_text("custom", changes, cfg) is None


def test_verl_run_held_still_gets_verl_overrides(tmp_path):
    """A verl PPO run whose logged kl coefficient (read) is huge: KL stays ~0 and validation stays flat while the
    groups differ; held_still lowers the coefficient, given as a verl override beside --out."""
    lines = [S.verl_console_line(s, {"critic/score/mean": 0.3, "critic/score/max": 1.0, "critic/kl": 1e-4,
                                     "critic/kl_coeff": 5.0, "actor/entropy": 0.8, "actor/grad_norm": 0.2,
                                     "response_length/mean": 100.0, "response_length/max": 300.0,
                                     "response_length/clip_ratio": 0.0,
                                     **({"val-core/gsm8k/acc/mean@1": 0.3} if s % 5 == 0 else {})})
             for s in range(0, 21)]
    log = tmp_path / "ppo.log"
    log.write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(main, ["recommend", str(log), "--out", str(tmp_path / "refined.yaml")])
    assert res.exit_code == 0, res.output
    assert "held_still" in res.output
    side = (tmp_path / "refined.verl.txt").read_text()
    assert "algorithm.kl_ctrl.kl_coef=0.01" in side and "as verl settings" in res.output  # PPO's in-reward KL
    assert C.load(tmp_path / "refined.yaml").beta == 0.01


def test_user_error_not_traceback_for_non_dict_history(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [[1, 2], None]}))
    with pytest.raises(UserError):
        recommend([read_any_run(tmp_path)])


# ---- signals used where they decide -----------------------------------------------------------------------
def _alerts(run):
    from mechdiag import alerts

    return {a.alert: a for a in alerts.check(run.metrics, run.eval, run.displacement,
                                            run.provenance["max_reward"]["value"])}


def test_grad_norm_zero_feeds_no_update(tmp_path):
    def hist(zero):
        return [{**h, "grad_norm": 0.0 if zero(h["step"]) else 0.4} for h in
                S.trl_history("0.23", STEPS, FUNCS) if "loss" in h]
    stuck = read_any_run(S.write_trl_state(tmp_path / "stuck", hist(lambda s: s > 5)))
    fine = read_any_run(S.write_trl_state(tmp_path / "fine", hist(lambda s: s % 4 == 0)))  # scattered zeros
    assert "grad_norm exactly 0 on 10 logged steps" in _alerts(stuck)["no_update"].evidence
    assert "no_update" not in _alerts(fine)


def test_terminated_length_and_max_length_feed_truncation(tmp_path):
    def hist(ended):  # a TRL log without clipped_ratio: a step whose completions all hit the cap ends none
        return [{k: v for k, v in {**h, "completions/mean_terminated_length": ended(h["step"])}.items()
                 if k != "completions/clipped_ratio"} for h in S.trl_history("0.23", STEPS, FUNCS) if "loss" in h]
    cut = read_any_run(S.write_trl_state(tmp_path / "cut", hist(lambda s: 0.0 if s > 8 else 50.0)))
    ok = read_any_run(S.write_trl_state(tmp_path / "ok", hist(lambda s: 50.0)))
    ev = _alerts(cut)["truncation"].evidence
    assert "the longest completion is 256 tokens" in ev and "those that ended average 0" in ev
    assert "truncation" not in _alerts(ok)
    assert cut.provenance["keys"]["max_completion_tokens"]["value"] == 256  # the cap the advice names


def test_per_function_std_names_the_reward_with_the_signal(tmp_path):
    def hist(with_std):
        out = []
        for h in S.trl_history("0.23", STEPS, {"judge": (lambda s: 0.1 + 0.2 * (s % 2), lambda s: 0.05),
                                               "fmt": (lambda s: 0.3 - 0.2 * (s % 2), lambda s: 0.0)}):
            if "loss" in h:
                h = {**h, "frac_reward_zero_std": 0.8}
                out.append(h if with_std else {k: v for k, v in h.items() if not k.endswith("/std")})
        return out
    signal = recommend([read_any_run(S.write_trl_state(tmp_path / "std", hist(True)))])
    plain = recommend([read_any_run(S.write_trl_state(tmp_path / "nostd", hist(False)))])
    low = {f.rule: f for f in signal.findings}["low_diversity"]
    assert "the signal left is in judge (std 0.05, tail)" in low.evidence
    assert "signal left" not in {f.rule: f for f in plain.findings}["low_diversity"].evidence


def test_report_shows_a_foreign_runs_refined_settings_in_its_own_names(data_dir, tmp_path):
    out = tmp_path / "r.html"
    res = CliRunner().invoke(main, ["report", str(data_dir / "reallogs" / "aaipl-minesweeper"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "max_completion_length: 128 -&gt; 192" in page  # GRPOConfig's name, from the run's own 128
    assert "name_or_path" not in page and "bundled" not in page  # none of mechdiag's placeholders


def test_tensorboard_events_of_a_trl_run(tmp_path):
    """HF's TensorBoardCallback under output_dir/runs/DATE: train/<TRL key>, eval/<key>, and the run summary
    (train/train_runtime) at the last step; the output_dir is read before its first checkpoint."""
    from torch.utils.tensorboard import SummaryWriter

    hist = S.trl_history("0.23", STEPS, FUNCS, eval_every=5)
    w = SummaryWriter(log_dir=str(tmp_path / "out" / "runs" / "Jun01_host"))
    for h in hist:
        for k, v in h.items():
            if k not in ("step", "epoch") and isinstance(v, float):
                w.add_scalar(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}", v, h["step"])
    w.close()
    run = read_any_run(tmp_path / "out")
    assert run.provenance["trainer"] == "trl" and (len(run.metrics), len(run.eval)) == (20, 4)
    m = _by_step(run)[20]
    assert m["reward"] == pytest.approx(1.0) and m["reward/correct"] == pytest.approx(0.5)  # float32 in events
    assert m["completion_length"] == pytest.approx(120.0) and "trl/train_runtime" not in m


def test_every_form_through_recommend_report_watch(tmp_path):
    forms = [S.write_trl_state(tmp_path / "gz", S.trl_history("0.14", STEPS, FUNCS), gz=True),
             S.wandb_csv(tmp_path / "trl.csv", S.wandb_trl_rows(S.trl_history("1.16", STEPS, FUNCS, eval_every=5)),
                         "train/global_step"),
             S.write_verl_console(tmp_path / "v.log.gz", STEPS, "3f", crlf=True, torn=True, gz=True, val_every=5),
             S.wandb_csv(tmp_path / "orl.csv", S.openrlhf_rows(STEPS, eval_every=5), "train/global_step",
                         run_name="orl"),
             S.write_openrlhf_tensorboard(tmp_path / "tb", STEPS, ppo=True, eval_every=5)]
    runner = CliRunner()
    for i, form in enumerate(forms):
        for cmd in (["recommend", str(form), "--out", str(tmp_path / f"r{i}.yaml")], ["watch", str(form), "--once"],
                    ["report", str(form), "--out", str(tmp_path / f"r{i}.html")]):
            res = runner.invoke(main, cmd)
            assert res.exit_code == 0, (cmd, res.output)
        assert (tmp_path / f"r{i}.html").stat().st_size > 0


def test_console_log_with_a_long_preamble(tmp_path):
    """Ray/vLLM start-up and the config dump before step 1 (verl-gui-cursor's first step line is 225 kB in)."""
    log = tmp_path / "train.log"
    text = "".join(f"(TaskRunner pid=7) config line {i}: " + "x" * 200 + "\n" for i in range(5000))  # ~1.1 MB
    log.write_text(text + "".join(S.verl_console_line(s, S.verl_data(s)) + "\n" for s in STEPS))
    assert len(read_any_run(log).metrics) == 20
    assert len(read_any_run(tmp_path).metrics) == 20  # found in its folder too
