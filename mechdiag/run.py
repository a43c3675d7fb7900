"""The run directory: the one contract between train, recommend, report and the readers of other trainers.

    RUN/config.yaml        the resolved design lambda
    RUN/metrics.jsonl      one record per train step   (canonical train keys, "step")
    RUN/eval.jsonl         one record per eval         (accuracy, eval_reward, entropy, completion_length, pass@k)
    RUN/samples.jsonl      rollouts and eval completions, with group ids
    RUN/displacement.jsonl rows: step, name, layer, module, ref_fro, delta_fro, rel_fro
    RUN/shift.jsonl        rows: step, layer, shift, ci_low, ci_high, cos_dist, increment, logit_kl
    RUN/eval_benchmarks.jsonl  rows of `mechdiag eval`
    RUN/attribution.jsonl  rows of `mechdiag attribute --save` (mechdiag.attribute.COLUMNS)
    RUN/checkpoints/step-N/, RUN/final/, RUN/summary.json
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mechdiag import atomic
from mechdiag.errors import UserError

STREAMS = ("metrics", "eval", "samples", "displacement", "shift", "eval_benchmarks", "attribution")


@dataclass
class RunDir:
    path: Path

    def __init__(self, path: str | os.PathLike, create: bool = False):
        self.path = Path(path)
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise UserError(f"run directory not found: {self.path}")

    # ---- streams -------------------------------------------------------------------------------------
    def stream(self, name: str) -> Path:
        if name not in STREAMS:
            raise ValueError(f"unknown stream {name!r}")
        return self.path / f"{name}.jsonl"

    def append(self, name: str, records: list[dict] | dict, fsync: bool = False) -> None:
        if isinstance(records, dict):
            records = [records]
        atomic.append_jsonl(self.stream(name), records, fsync=fsync)

    def read(self, name: str) -> list[dict]:
        try:
            return atomic.read_jsonl(self.stream(name))
        except ValueError as e:
            raise UserError(f"corrupt {self.stream(name)}: {e}") from None

    def frame(self, name: str):
        import pandas as pd

        return pd.DataFrame(self.read(name))

    def drop_after(self, step: int) -> None:
        """On resume: forget every record past the last checkpointed step, so each step appears once."""
        kept = {}
        for name in STREAMS:  # read (and check) every stream before rewriting any: a corrupt one changes nothing
            if self.stream(name).exists():
                kept[name] = [r for r in self.read(name) if r.get("step", -1) <= step]
        for name, records in kept.items():
            atomic.write_text(self.stream(name), "".join(atomic.dumps(r) + "\n" for r in records))

    # ---- files ---------------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def final(self) -> Path:
        return self.path / "final"

    def checkpoint_steps(self) -> list[int]:
        if not self.checkpoints.is_dir():
            return []
        steps = []
        for p in self.checkpoints.iterdir():
            if p.name.startswith("step-") and (p / "COMPLETE").exists():
                steps.append(int(p.name.split("-", 1)[1]))
        return sorted(steps)

    def write_summary(self, summary: dict) -> None:
        atomic.write_json(self.summary_path, summary)

    def summary(self) -> dict:
        import json

        if not self.summary_path.exists():
            return {}
        try:
            return json.loads(self.summary_path.read_text())
        except ValueError as e:
            raise UserError(f"corrupt {self.summary_path}: {e}") from None
