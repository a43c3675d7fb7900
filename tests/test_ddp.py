"""`mechdiag train --backend trl` with two real processes (torchrun, DDP over gloo on CPU): rank 1 must not read
the files rank 0 writes, both ranks end together with exit 0, and one complete run directory is left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tests.conftest import tiny_train_flags


def test_two_process_trl_run_ends_cleanly_on_every_rank(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           "-m", "mechdiag", "train", "--backend", "trl", "--out", str(out),
           *tiny_train_flags("max_steps=2", "eval_every=0", "eval_n=4")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "[rank1]" in log and "[rank0]" in log, "expected two DDP ranks"  # c10 prefixes each rank's warnings
    assert log.count("base accuracy") == 1  # rank 0 alone reads summary.json and prints the line
    summary = json.loads((out / "summary.json").read_text())
    assert "base_accuracy" in summary and "final_accuracy" in summary
    assert (out / "final" / "adapter_model.safetensors").exists()
    assert [p.name for p in out.glob("summary*.json")] == ["summary.json"]
