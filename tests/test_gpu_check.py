"""bench/gpu_check.sh, the prepared GPU check, run as `--dry-run` (the same sequence on the CPU at tiny shapes of
both models): every case runs or says why not, and the results file and the docs snippet are written whole."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoConfig

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["gpu"].startswith("none")
    assert result["group_size"] == 4 and result["completion_tokens"] == 16
    for name, layers in (("0.5B", 1), ("1.5B", 2)):  # the two models, built with the real vocabulary's tokenizer
        cfg = AutoConfig.from_pretrained(result["models"][name])
        assert cfg.num_hidden_layers == layers and cfg.vocab_size == 4096 and cfg.tie_word_embeddings
    cases = {(c["model"], c["case"]): c for c in result["cases"]}
    want = {(m, c) for m in ("0.5B", "1.5B") for c in ("native", "trl", "trl-vllm")}
    assert set(cases) == want | {("0.5B", "native-merged"), ("0.5B", "shift"), ("0.5B", "displacement")}
    for key in want | {("0.5B", "native-merged")}:
        c = cases[key]
        if key[1] == "trl-vllm" and importlib.util.find_spec("vllm") is None:
            assert c["skipped"] == "vllm is not importable in this environment"
            continue
        assert "skipped" not in c, c
        assert c["steps"] == 1 and c["s_per_step"] > 0 and c["completion_tokens_per_s"] > 0
        assert c["displacement_steps"] == [1]  # recorded at the last step whatever the period
        assert c["peak_gpu_bytes"] is None and c["peak_rss_bytes"] > 0  # no GPU in a dry run
    assert cases[("0.5B", "native-merged")]["memory"]["sampler_bytes"] > 0
    native = cases[("1.5B", "native")]["memory"]
    assert native["predicted_peak_bytes"] > native["weights_bytes"]  # the memory model ran at the step
    assert cases[("0.5B", "shift")]["wall_s"] > 0 and cases[("0.5B", "displacement")]["wall_s"] > 0
    snippet = (out / "benchmarks_snippet.md").read_text()
    assert result["date"] in snippet and "| 1.5B | trl |" in snippet and "bench/gpu_check.sh" in snippet
    assert "| 0.5B | trl-vllm |" in snippet
