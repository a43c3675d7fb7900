"""Two real processes (torchrun, gloo on CPU) under each engine: DDP, FSDP1 (use_orig_params True and False), FSDP2,
DeepSpeed ZeRO-2 and ZeRO-3, with LoRA via peft, as MechdiagCallback in a user's own TRL script
(tests/engine_script.py), and under FSDP1, FSDP2 and ZeRO-3 also as `mechdiag train --backend trl`. Each run: world
size 2 seen from inside, exit 0 on every rank within the timeout, one summary.json naming the engine, the recorded
displacement equal to `mechdiag displacement` on the saved adapter, shift and eval records (held-out accuracy,
forget_kl) present."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mechdiag.run import RunDir
from tests.conftest import tiny_train_flags
from tests.engines import ACCELERATE, ENGINES, NAMES, trl_flags

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 400  # s; subprocess.TimeoutExpired fails the test: a hang is a failure
# hot sampling and a large step: the 2-step run's rewards differ within groups, so the LoRA factors leave B = 0
CLI_FLAGS = ("max_steps=2", "eval_every=0", "eval_n=4", "lora.r=4", "temperature=2.0", "learning_rate=0.05",
             "group_size=4")


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _check_run(run: RunDir, adapter: Path, engine: str, cli) -> None:
    summary = run.summary()
    assert summary["engine"] == NAMES.get(engine, engine) and summary["world_size"] == 2
    assert "unavailable" not in summary  # every figure is computed under every engine here
    assert "final_accuracy" in summary and "base_accuracy" in summary
    evals = run.read("eval")
    assert [e["step"] for e in evals] == [0, summary["steps"]]
    assert run.read("shift") and {r["step"] for r in run.read("shift")} == {summary["steps"]}
    rows = [r for r in run.read("displacement") if r["step"] == summary["steps"]]
    proc = cli("displacement", "bundled", str(adapter), "--format", "json", "--spectral")
    assert proc.returncode == 0, proc.stderr
    offline = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows and len(rows) == len({r["name"] for r in rows})  # one writer: each row once
    for r in rows:
        assert r["delta_fro"] > 0
        for col in ("ref_fro", "delta_fro", "rel_fro", "subspace_overlap"):
            assert abs(r[col] - offline[r["name"]][col]) <= 1e-6 * abs(offline[r["name"]][col]), (r["name"], col)
        assert r["intruders"] == offline[r["name"]]["intruders"]


def _one_summary(root: Path) -> None:
    assert len(list(root.rglob("summary.json"))) == 1
    assert not list(root.rglob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_callback_in_a_users_script(engine, tmp_path, cli):
    out = tmp_path / "trl"
    _torchrun("-m", "tests.engine_script", engine, str(out), cwd=tmp_path)
    ranks = sorted((json.loads(p.read_text()) for p in (out / "ranks").glob("*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]  # each rank's own file
    for r in ranks:  # the engine accelerate really ran, not DDP in its place
        assert (r["distributed_type"], r["fsdp_version"], r["zero_stage"]) == ACCELERATE[engine]
    _check_run(RunDir(out / "mechdiag"), out / "final", engine, cli)
    _one_summary(out)
    first = json.loads((out / "mechdiag" / "displacement.jsonl").read_text().splitlines()[0])
    last = RunDir(out / "mechdiag").read("displacement")[-1]
    assert first["step"] == 1 and last["step"] == 2


@pytest.mark.slow
# one FSDP1, FSDP2 and ZeRO-3 (DDP: tests/test_ddp.py); ZeRO-2 and FSDP1's flat parameters run the same callback
# through the user's script above (the suite's time)
@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2", "zero3"])
def test_mechdiag_train_backend_trl(engine, tmp_path, cli):
    out = tmp_path / "run"
    proc = _torchrun("-m", "tests.engines", engine, "train", "--backend", "trl", "--out", str(out),
                     *tiny_train_flags(*CLI_FLAGS), *trl_flags(engine),
                     cwd=tmp_path)
    assert proc.stdout.count("base accuracy") + proc.stderr.count("base accuracy") == 1  # the writer alone
    _check_run(RunDir(out), out / "final", engine, cli)
    _one_summary(out)


@pytest.mark.parametrize("engine", ENGINES)
def test_accelerate_config_files_name_the_tested_engines(engine):
    """examples/accelerate/ENGINE.yaml (the files docs/trl.md tells GPU users to launch with), read by accelerate's own
    parser, ask for the engine the CPU tests run."""
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO / "examples" / "accelerate" / f"{engine}.yaml"))
    dist, fsdp_version, zero_stage = ACCELERATE[engine]
    assert cfg.distributed_type.value == {"DistributedType.MULTI_CPU": "MULTI_GPU"}.get(dist, dist.split(".")[1])
    assert cfg.fsdp_config.get("fsdp_version") == fsdp_version
    assert cfg.deepspeed_config.get("zero_stage") == zero_stage
    if fsdp_version == 1:
        assert cfg.fsdp_config["fsdp_use_orig_params"] == (engine == "fsdp1")
    assert cfg.num_processes > 1 and not cfg.use_cpu


def test_one_process_is_the_single_engine_and_wrapper_names_are_cleaned():
    """Without a process group the recorder keeps its one-process path (Engine not sharded); the engines' wrapper
    segments never reach a row name."""
    from mechdiag import models
    from mechdiag.distributed import Engine, clean_name

    model, _ = models.load_model_and_tokenizer("bundled", "float32")
    eng = Engine.of(model)
    assert (eng.name, eng.sharded, eng.world_size) == ("single", False, 1)
    wrapped = "_fsdp_wrapped_module.base_model.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp"
    assert clean_name(wrapped) == "base_model.model.layers.0.mlp"
