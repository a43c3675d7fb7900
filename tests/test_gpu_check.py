"""bench/gpu_check.sh, the prepared GPU check, run as `--dry-run` (the same sequence on the bundled model on the
CPU): every case runs and the results file and the docs snippet are written whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["gpu"].startswith("none")
    cases = {c["case"]: c for c in result["cases"]}
    assert set(cases) == {"native", "native-merged", "native-adapter", "trl", "shift", "displacement"}
    for name in ("native", "native-merged", "native-adapter", "trl"):
        c = cases[name]
        assert c["steps"] == 1 and c["s_per_step"] > 0 and c["completion_tokens_per_s"] > 0
        assert c["displacement_steps"] == [1]  # recorded at the last step whatever the period
    assert cases["native-merged"]["memory"]["sampler_bytes"] > 0
    assert cases["native-adapter"]["memory"]["sampler_bytes"] == 0
    snippet = (out / "benchmarks_snippet.md").read_text()
    assert result["date"] in snippet and "| trl |" in snippet and "bench/gpu_check.sh" in snippet
