"""mechdiag's signals in the user's tracker (report_to), read back by each tracker's own reader: TensorBoard's
EventAccumulator, W&B's offline transaction log (.wandb, parsed with wandb's own protobuf Record), MLflow's
MlflowClient on the local file store, Trackio's local SQLite store through its own SQLiteStorage. The values must
equal the run directory's records, on the native trainer and on TRL's GRPOTrainer."""

from __future__ import annotations

import json
import math
import struct
import uuid
from pathlib import Path

import pytest
import torch

from mechdiag import config as C
from mechdiag import trackers as T
from mechdiag.recorder import Alerts, Recorder, StepRecord, TrainMetrics
from mechdiag.run import RunDir
from mechdiag.train.trainer import train
from tests.helpers import assert_bad_input
from tests.test_train import small
from tests.test_user_signals import RewardGap

torch.set_num_threads(1)
SITE = "0.q_proj"  # a layer x module every run below adapts


# ---- each tracker's own reader -------------------------------------------------------------------------------
def tensorboard_scalars(folder) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, tuple[int, int]]]]:
    """({tag: {step: value}}, {image tag: {step: (height, width)}}) of every event file under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars, images = {}, {}
    for f in sorted(Path(folder).rglob("events.out.tfevents.*")):
        ea = EventAccumulator(str(f), size_guidance={"scalars": 0, "images": 0})
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in ea.Scalars(tag)})
        for tag in ea.Tags()["images"]:
            images.setdefault(tag, {}).update({e.step: (e.height, e.width) for e in ea.Images(tag)})
    return scalars, images


def wandb_records(path):
    """The records of one offline run's .wandb file: wandb's record framing (a 7-byte ":W&B" header, 32 KiB blocks
    of chunks, each with a 7-byte header) around wandb's own protobuf Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_history(folder) -> dict[int, dict]:
    """{step: {key: value}} over every offline run file under `folder` (a resumed run adds one)."""
    out: dict[int, dict] = {}
    for path in sorted(Path(folder).rglob("run-*.wandb")):
        for rec in wandb_records(path):
            if rec.HasField("history"):
                row: dict = {}
                for i in rec.history.item:  # a media value (a table) is nested: key, then its fields
                    *keys, last = list(i.nested_key) or [i.key]
                    node = row
                    for k in keys:
                        node = node.setdefault(k, {})
                    node[last] = json.loads(i.value_json)
                out.setdefault(row.get("_step", rec.history.step.num), {}).update(row)
    return out


def wandb_run_ids(folder) -> list[str]:
    return [rec.run.run_id for path in sorted(Path(folder).rglob("run-*.wandb")) for rec in wandb_records(path)
            if rec.HasField("run")]


def mlflow_run(folder):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(Path(folder).resolve() / "mlruns").as_uri())
    exp = client.get_experiment_by_name("mechdiag")
    (run,) = client.search_runs([exp.experiment_id])
    return client, run.info.run_id


def mlflow_series(client, run_id, key) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, T.mlflow_key(key))}


@pytest.fixture
def trackio_project(monkeypatch):
    """A project of its own in Trackio's local store, deleted afterwards."""
    import trackio

    name = f"mechdiag-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TRACKIO_PROJECT", name)
    yield name
    trackio.delete_project(name, force=True)


def trackio_logs(project, run) -> dict[int, dict]:
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[int, dict] = {}
    for row in SQLiteStorage.get_logs(project, run):
        out.setdefault(row["step"], {}).update(row)
    return out


# ---- the expected values, from the run directory --------------------------------------------------------------
def expected(run: RunDir) -> dict[str, dict[int, float]]:
    """{namespaced key: {step: value}} that every tracker must hold: reward, a reward component, the held-out
    accuracy, one site's rel_fro, the user signal's gap."""
    want: dict[str, dict[int, float]] = {}
    for m in run.read("metrics"):
        want.setdefault("mechdiag/metrics/reward", {})[m["step"]] = m["reward"]
        want.setdefault("mechdiag/metrics/reward/correctness", {})[m["step"]] = m["reward/correctness"]
    for e in run.read("eval"):
        want.setdefault("mechdiag/eval/accuracy", {})[e["step"]] = e["accuracy"]
    for r in run.read("displacement"):
        if f"{r['layer']}.{r['module']}" == SITE:
            want.setdefault(f"mechdiag/displacement/{SITE}/rel_fro", {})[r["step"]] = r["rel_fro"]
    for r in run.read("reward_gap"):
        if "gap" in r:
            want.setdefault("mechdiag/reward_gap/gap", {})[r["step"]] = r["gap"]
    return want


def test_native_run_reaches_every_tracker(stories260k, tmp_path, trackio_project):
    cfg = C.load(None, small(stories260k, "max_steps=2", "save_every=0", "record.displacement_every=1",
                             "report_to=[tensorboard,wandb,mlflow,trackio]",
                             "record.signals=[tests.test_user_signals:RewardGap]"))
    run = train(cfg, tmp_path / "run")
    want = expected(run)
    assert set(want["mechdiag/metrics/reward"]) == {1, 2} and set(want["mechdiag/eval/accuracy"]) == {0, 2}
    assert set(want[f"mechdiag/displacement/{SITE}/rel_fro"]) == {1, 2}
    assert want[f"mechdiag/displacement/{SITE}/rel_fro"][2] > 0
    layers = {r["layer"] for r in run.read("displacement")}
    modules = {r["module"] for r in run.read("displacement")}

    tb, images = tensorboard_scalars(run.path / "tensorboard")
    for key, series in want.items():  # TensorBoard stores float32
        assert set(tb[key]) == set(series), key
        for step, v in series.items():
            assert tb[key][step] == pytest.approx(v, rel=1e-6, abs=1e-30), (key, step)
    assert images[T.HEATMAP] == {s: (12 * len(layers), 12 * len(modules)) for s in (1, 2)}

    wb = wandb_history(run.path / "wandb")
    for key, series in want.items():  # W&B: JSON doubles, exact
        assert {s: wb[s][key] for s in series} == series, key
    table = wb[2][T.HEATMAP]
    assert table["_type"] == "table-file" and table["nrows"] == len(run.read("displacement")) // 2

    client, run_id = mlflow_run(run.path)
    for key, series in want.items():
        assert mlflow_series(client, run_id, key) == series, key
    assert client.get_run(run_id).data.params["group_size"] == "4"
    table = json.loads(Path(client.download_artifacts(run_id, "displacement/step_000002.json", str(tmp_path)))
                       .read_text())
    cell = [r for r in table["data"] if r[:2] == [0, "q_proj"]]
    assert table["columns"] == ["layer", "module", "rel_fro"]
    assert [r[2] for r in cell] == [pytest.approx(want[f"mechdiag/displacement/{SITE}/rel_fro"][2], rel=1e-8)]

    tr = trackio_logs(trackio_project, "run")
    for key, series in want.items():
        assert {s: tr[s][key] for s in series} == series, key
    assert T.HEATMAP in tr[2]


def test_resumed_run_continues_its_tracker_runs(stories260k, tmp_path, trackio_project):
    """A run stopped after step 1 and resumed: W&B continues the run of the same id, MLflow and Trackio the run of
    the same name; together they hold every step once."""
    from trackio.sqlite_storage import SQLiteStorage

    sets = small(stories260k, "max_steps=2", "save_every=1", "warmup_ratio=0", "report_to=[wandb,mlflow,trackio]")
    with pytest.warns(UserWarning, match="max_time_s"):
        train(C.load(None, [*sets, "max_time_s=1e-9"]), tmp_path / "run")
    run = train(C.load(None, sets), tmp_path / "run", resume=True)
    reward = {m["step"]: m["reward"] for m in run.read("metrics")}
    assert set(reward) == {1, 2}

    ids = wandb_run_ids(run.path / "wandb")
    assert len(ids) == 2 and len(set(ids)) == 1  # two offline files, one W&B run
    wb = wandb_history(run.path / "wandb")
    assert {s: wb[s]["mechdiag/metrics/reward"] for s in reward} == reward
    client, run_id = mlflow_run(run.path)  # exactly one MLflow run
    assert mlflow_series(client, run_id, "mechdiag/metrics/reward") == reward
    assert SQLiteStorage.get_runs(trackio_project) == ["run"]
    tr = trackio_logs(trackio_project, "run")
    assert {s: tr[s]["mechdiag/metrics/reward"] for s in reward} == reward


def test_alerts_reach_the_tracker(tmp_path):
    """The real recorder with the real Alerts: a zero_std run (every group all-equal) fires once, and the alert
    goes to TensorBoard at the step it fired, with the steps' metrics."""
    cfg = C.load(None, [])
    run = RunDir(tmp_path / "run", create=True)
    sink = T.Trackers(["tensorboard"], run.path, {})
    rec = Recorder(run, [TrainMetrics(), Alerts(cfg), T.Report(sink)])
    rec.start()
    for step in range(1, 8):
        rec.train(StepRecord(step, extra={"reward": 0.1 * step, "frac_zero_std": 0.9}))
    rec.end(7, None, None)
    fired = rec.find(Alerts).watcher.fired
    assert list(fired) == ["zero_std"]
    tb, _ = tensorboard_scalars(run.path / "tensorboard")
    assert tb["mechdiag/alerts/zero_std"] == {fired["zero_std"].step: 1.0}
    assert tb["mechdiag/metrics/reward"] == {s: pytest.approx(0.1 * s) for s in range(1, 8)}


def test_scalars_name_each_site_and_leave_text_out():
    rows = [{"step": 3, "name": "model.layers.1.mlp.up_proj.weight", "layer": 1, "module": "up_proj",
             "ref_fro": 2.0, "delta_fro": 0.5, "rel_fro": 0.25}]
    assert T.scalars("displacement", rows) == {"mechdiag/displacement/1.up_proj/rel_fro": 0.25,
                                               "mechdiag/displacement/1.up_proj/delta_fro": 0.5}
    assert T.scalars("eval", [{"step": 1, "accuracy": 0.5, "pass@4": 0.75, "note": "x", "bad": math.nan}]) == \
        {"mechdiag/eval/accuracy": 0.5, "mechdiag/eval/pass@4": 0.75}
    assert T.scalars("samples", [{"step": 1, "reward": 1.0}]) == {}
    assert T.mlflow_key("mechdiag/metrics/reward/correctness") == "mechdiag/metrics/reward.correctness"
    assert T.mlflow_key("mechdiag/eval/pass@4") == "mechdiag/eval/pass_4"
    img = T.heatmap_image([[0.0, 1.0], [math.nan, 0.5]], cell=2)
    assert img.shape == (4, 4, 3) and img[0, 0].tolist() == [255, 255, 255] and img[2, 0].tolist() == [160] * 3


def test_bad_report_to(stories260k, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mechdiag.cli import main

    def cli(*args):
        r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        from types import SimpleNamespace

        return SimpleNamespace(returncode=r.exit_code, stdout=r.stdout, stderr=r.stderr)

    base = [a for s in small(stories260k, "max_steps=1") for a in ("--set", s)]
    proc = cli("train", "--out", tmp_path / "a", *base, "--set", "report_to=[tensorbord]")
    assert_bad_input(proc)
    assert "report_to" in proc.stderr and not (tmp_path / "a").exists()
    monkeypatch.setitem(T.LIBRARY, "wandb", "wandb_not_installed_here")  # as on a machine without the extra
    proc = cli("train", "--out", tmp_path / "b", *base, "--set", "report_to=[wandb]")
    assert_bad_input(proc)
    assert "mechdiag[trackers]" in proc.stderr and "wandb" in proc.stderr and not (tmp_path / "b").exists()


# ---- TRL's GRPOTrainer: the same signals through its report_to callbacks ---------------------------------------
def test_trl_callback_reaches_tensorboard(stories260k, tmp_path, monkeypatch):
    """A user's GRPOTrainer with report_to=["tensorboard"] and MechdiagCallback attached: TensorBoard holds TRL's
    own logs and, at the same steps, mechdiag's displacement per layer x module, its heatmap and a user signal,
    equal to the run directory's records (the last step's user signal arrives after TRL's last log)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from mechdiag.integrations.trl import MechdiagCallback
    from tests.test_trl import _length, _letter_a

    steps, out = 3, tmp_path / "out"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    tok = AutoTokenizer.from_pretrained(stories260k)
    tok.pad_token_id = 0
    data = Dataset.from_list([{"prompt": f"Once upon a time, story {i}"} for i in range(16)])
    args = GRPOConfig(output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, logging_steps=1, save_strategy="no", bf16=False, use_cpu=True,
                      learning_rate=5e-3, log_completions=True, num_completions_to_print=0, report_to=["tensorboard"],
                      seed=3, reward_weights=[1.0, 0.5])
    cb = MechdiagCallback(displacement_every=1, signals=[RewardGap()])
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(stories260k), reward_funcs=[_letter_a, _length],
                          args=args, train_dataset=data, processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"), callbacks=[cb])
    cb.attach(trainer)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("MechdiagCallback") < names.index("TensorBoardCallback")
    trainer.train()

    run = RunDir(out / "mechdiag")
    tb, images = tensorboard_scalars(tmp_path / "tb")
    metrics = run.read("metrics")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert tb["train/reward"] == {m["step"]: pytest.approx(m["reward"], rel=1e-6) for m in metrics}  # TRL's own
    disp = {(r["step"], f"{r['layer']}.{r['module']}"): r["rel_fro"] for r in run.read("displacement")}
    assert {s for s, _ in disp} == set(range(1, steps + 1))
    for (step, site), v in disp.items():
        assert tb[f"train/mechdiag/displacement/{site}/rel_fro"][step] == pytest.approx(v, rel=1e-6, abs=1e-30)
    assert disp[(steps, SITE)] > 0
    gaps = {r["step"]: r["gap"] for r in run.read("reward_gap") if "gap" in r}
    assert set(gaps) == set(range(1, steps + 1))
    assert tb["train/mechdiag/reward_gap/gap"] == {s: pytest.approx(g, rel=1e-6, abs=1e-30) for s, g in gaps.items()}
    n_layers = len({site.split(".")[0] for _, site in disp})
    assert images[T.HEATMAP] == {s: (12 * n_layers, 12 * 2) for s in range(1, steps + 1)}
    assert not any(k.startswith("train/mechdiag/metrics/") for k in tb)  # TRL logs its metrics itself


def test_trl_callback_without_attach_warns(stories260k, tmp_path, monkeypatch):
    """Not attached, the callback cannot reach the report_to callbacks: it says so, and records the run
    directory as ever; TensorBoard has TRL's own logs only."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from mechdiag.integrations.trl import MechdiagCallback
    from tests.test_trl import _letter_a

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    tok = AutoTokenizer.from_pretrained(stories260k)
    tok.pad_token_id = 0
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, logging_steps=1, save_strategy="no", bf16=False,
                      use_cpu=True, report_to=["tensorboard"], seed=3)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(stories260k), reward_funcs=[_letter_a],
                          args=args, train_dataset=Dataset.from_list([{"prompt": "Once upon a time"}] * 4),
                          processing_class=tok, callbacks=[MechdiagCallback(displacement_every=1)])
    with pytest.warns(UserWarning, match=r"attach\(trainer\)"):
        trainer.train()
    assert [m["step"] for m in RunDir(tmp_path / "out" / "mechdiag").read("metrics")] == [1]
    tb, _ = tensorboard_scalars(tmp_path / "tb")
    assert "train/reward" in tb and not any("mechdiag" in k for k in tb)


def test_backend_trl_reaches_every_tracker(stories260k, tmp_path, trackio_project):
    """`mechdiag train --backend trl` with report_to all four: TRL's own callbacks write into the run directory
    (W&B offline, MLflow's file store) and carry mechdiag's held-out eval and displacement at their steps."""
    from click.testing import CliRunner
    from trackio.sqlite_storage import SQLiteStorage

    from mechdiag.cli import main
    from tests.test_trl import _small

    out = tmp_path / "run"
    sets = _small(stories260k, "record.displacement_every=1", "save_every=0", "eval_every=0",
                  "report_to=[tensorboard,wandb,mlflow,trackio]")
    r = CliRunner().invoke(main, ["train", "--backend", "trl", "--out", str(out), "--max-steps", "2",
                                  *[a for s in sets for a in ("--set", s)]], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr[-2000:]
    run = RunDir(out)
    want = {"mechdiag/eval/accuracy": {e["step"]: e["accuracy"] for e in run.read("eval")},
            f"mechdiag/displacement/{SITE}/rel_fro": {d["step"]: d["rel_fro"] for d in run.read("displacement")
                                                      if f"{d['layer']}.{d['module']}" == SITE}}
    assert set(want["mechdiag/eval/accuracy"]) == {0, 2}
    assert set(want[f"mechdiag/displacement/{SITE}/rel_fro"]) == {1, 2}
    reward = {m["step"]: m["reward"] for m in run.read("metrics")}

    tb, images = tensorboard_scalars(out / "tensorboard")
    for key, series in want.items():
        assert tb[f"train/{key}"] == {s: pytest.approx(v, rel=1e-6, abs=1e-30) for s, v in series.items()}, key
    assert tb["train/reward"] == {s: pytest.approx(v, rel=1e-6) for s, v in reward.items()}
    assert set(images[T.HEATMAP]) == {1, 2}

    wb = wandb_history(out / "wandb")  # W&B's x axis here is train/global_step, the step TRL logged at
    rows = list(wb.values())
    for key, series in want.items():
        got = {row["train/global_step"]: row[f"train/{key}"] for row in rows if f"train/{key}" in row}
        assert got == series, key
    assert {row["train/global_step"] for row in rows if T.HEATMAP in row} == {1, 2}

    client, run_id = mlflow_run(out)
    for key, series in want.items():
        assert {m.step: m.value for m in client.get_metric_history(run_id, key)} == series, key
    assert {m.step for m in client.get_metric_history(run_id, "reward")} == {1, 2}

    (name,) = SQLiteStorage.get_runs(trackio_project)
    logs = SQLiteStorage.get_logs(trackio_project, name)
    for key, series in want.items():
        got = {row["train/global_step"]: row[f"train/{key}"] for row in logs if f"train/{key}" in row}
        assert got == series, key
