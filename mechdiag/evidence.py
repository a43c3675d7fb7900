"""What the doctor's rules read (mechdiag.recommend): one config's runs pooled into per-step train and eval
signals, their head/tail windows, the update mass per layer and module, the causal shares `attribute` recorded,
the sampled completions, and how the run holds each config key (a foreign run's provenance)."""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

from mechdiag.config import Config
from mechdiag.metrics import causal_shares, last_step, max_reward, update_mass, update_mass_size_normalised
from mechdiag.metrics import is_number as _num
from mechdiag.run import Run, base_eval, final_eval
from mechdiag.tasks import reward_weights

WINDOW_FRAC = 0.25  # "head" = first quarter of the train records, "tail" = last quarter
MIN_POINTS = 4  # fewer train records than this: trend rules stay silent
KL_NEGATIVE_SHARE = 0.25  # a logged kl below -KL_NEGATIVE_EPS on this share of records is a signed estimate...
KL_NEGATIVE_EPS = 1e-6  # ...(k1, a mean log-ratio), not a KL: rounding leaves a true KL at most this far under 0


# ---- pooled signals ----------------------------------------------------------------------------------------
def _pool(streams: list[list[dict]]) -> dict[int, dict[str, float]]:
    """Per step, the mean over runs of every numeric key."""
    acc: dict[int, dict[str, list[float]]] = {}
    for rows in streams:
        for r in rows:
            if not _num(r.get("step")):
                continue
            slot = acc.setdefault(int(r["step"]), {})
            for k, v in r.items():
                if k != "step" and _num(v):
                    slot.setdefault(k, []).append(float(v))
    return {s: {k: sum(v) / len(v) for k, v in d.items()} for s, d in sorted(acc.items())}


def _mean_dicts(dicts: list[dict]) -> dict:
    dicts = [d for d in dicts if d]
    keys = {k for d in dicts for k in d}
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


@dataclass
class Signals:
    """What the rules read: one config and the pooled records of its runs."""

    cfg: Config
    runs: list[str]
    train: dict[int, dict[str, float]]
    eval: dict[int, dict[str, float]]
    layer_mass: dict[int, float]  # displacement share per layer, last recorded step
    module_mass: dict[str, float]  # size-normalised displacement share per module type, last recorded step
    shift: dict[int, dict[str, float]]  # per layer: shift (and increment) at the last recorded step
    base: dict[str, float]
    final: dict[str, float]
    n_layers: int | None
    samples: list[dict] = field(default_factory=list)  # sampled completions of the runs (train split first)
    # causal share per "layer" and per "module" recorded by `mechdiag attribute --save`, mean over runs ({} if none)
    causal: dict[str, dict] = field(default_factory=dict)
    provenance: dict | None = None  # a foreign run's account of its config (run.Run.provenance); None: all read
    modules: list[str] = field(default_factory=list)  # every module the displacement names, fused parts included
    raw: list[list[dict]] = field(default_factory=list)  # each run's train records as written (NaN kept as null)
    min_points: int = MIN_POINTS  # the fewest records a head/tail window is read from (few_points lowers it)
    ending: dict = field(default_factory=dict)  # how a printed log ended (logs.log_ending: its error, planned steps)

    def __post_init__(self):
        """A logged "kl" negative on KL_NEGATIVE_SHARE of its records is not a KL to the reference (k3 and verl's
        low_var_kl are never negative; a mean log-ratio, k1, is): it is kept as kl_signed, which no rule reads as
        drift, and cannot_judge names it."""
        vals = [d["kl"] for d in self.train.values() if "kl" in d]
        if vals and sum(v < -KL_NEGATIVE_EPS for v in vals) >= KL_NEGATIVE_SHARE * len(vals):
            for d in self.train.values():
                if "kl" in d:
                    d["kl_signed"] = d.pop("kl")

    @contextmanager
    def few_points(self, n: int):
        """Windows read from as few as `n` records inside the block (recommend.diagnose's level rules on a short
        run: the head is the first record, the tail the last)."""
        before, self.min_points = self.min_points, n
        try:
            yield self
        finally:
            self.min_points = before

    @classmethod
    def from_runs(cls, runs: list[Run]) -> Signals:
        cfg = runs[0].cfg
        # the layer and module rules steer LoRA: read the tensors it adapts (not norms or embeddings)
        adapted = {m.rsplit(".", 1)[-1] for m in cfg.lora.target_modules}  # as the run recorded them (resolved)
        disp = [[row for row in last_step(r.displacement) if str(row.get("module")).rsplit(".", 1)[-1]
                 in adapted] for r in runs]
        shift_rows = [last_step(r.shift) for r in runs]
        layers = [int(r["layer"]) for rows in disp + shift_rows for r in rows if _num(r.get("layer"))]
        by_layer = [[{**r, "step": r["layer"]} for r in rows if _num(r.get("layer"))] for rows in shift_rows]
        return cls(
            cfg=cfg, runs=[str(r.path) for r in runs],
            train=_pool([r.metrics for r in runs]), eval=_pool([r.eval for r in runs]),
            layer_mass={int(k): v for k, v in _mean_dicts([update_mass(rows, "layer") for rows in disp]).items()},
            module_mass=_mean_dicts([update_mass_size_normalised(rows, "module") for rows in disp]),
            shift=_pool(by_layer), base=_mean_dicts([base_eval(r) for r in runs]),
            final=_mean_dicts([final_eval(r) for r in runs]),
            n_layers=max(layers) + 1 if layers else None,
            samples=sorted((x for r in runs for x in r.samples if isinstance(x, dict)),
                           key=lambda x: x.get("split") != "train"),
            causal={by: _mean_dicts([causal_shares(r.read("attribution"), by) for r in runs])
                    for by in ("layer", "module")},
            provenance=runs[0].provenance,
            raw=[r.metrics for r in runs],
            ending=dict((runs[0].summary.get("read") or {}).get("ended") or {}),
            modules=list(dict.fromkeys(str(row["module"]) for r in runs for row in last_step(r.displacement)
                                       if str(row.get("part_of") or row.get("module")).rsplit(".", 1)[-1]
                                       in adapted)))

    def series(self, key: str, stream: str = "train") -> tuple[list[int], list[float]]:
        src = self.train if stream == "train" else self.eval
        pts = [(s, d[key]) for s, d in src.items() if key in d]
        return [p[0] for p in pts], [p[1] for p in pts]

    def window(self, key: str, which: str) -> tuple[float, str] | None:
        """Mean of `key` over the head or tail window of the train records, with its step range."""
        steps, vals = self.series(key)
        if len(vals) < self.min_points:
            return None
        k = max(1, round(len(vals) * WINDOW_FRAC))
        sl = slice(0, k) if which == "head" else slice(len(vals) - k, len(vals)) if which == "tail" else \
            slice(k, 2 * k)  # "second": the second quarter
        s, v = steps[sl], vals[sl]
        return sum(v) / len(v), f"steps {s[0]}-{s[-1]}"

    def window_gain(self, key: str) -> tuple[float, float, float, str] | None:
        """(head mean, tail mean, two standard errors of their difference, step ranges) of `key` over the train
        records: a tail under head + noise did not rise beyond what its own step-to-step spread could make. The
        spread is read from successive differences (von Neumann: var = mean((x[i+1] - x[i])^2) / 2), which a trend
        inside a window does not inflate. None with fewer than two records in a window."""
        steps, vals = self.series(key)
        k = round(len(vals) * WINDOW_FRAC)
        if k < 2:
            return None
        mh, mt = sum(vals[:k]) / k, sum(vals[-k:]) / k
        var = math.fsum((b - a) ** 2 for a, b in itertools.pairwise(vals)) / (2 * (len(vals) - 1))
        return mh, mt, 2 * math.sqrt(2 * var / k), f"steps {steps[0]}-{steps[k - 1]} -> {steps[-k]}-{steps[-1]}"

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def max_reward(self) -> float:
        """The run's own best total reward: a foreign run's from its reward functions as logged (provenance),
        a mechdiag run's from its reward weights. A bound for sizes, never a level: levels use reward_scale."""
        own = (self.provenance or {}).get("max_reward") or {}
        return float(own["value"]) if _num(own.get("value")) and own["value"] > 0 else \
            max_reward(reward_weights(self.cfg))

    def reward_scale(self) -> tuple[float, float, str] | None:
        """(low, high, how it is known) of one completion's total reward, the scale levels are judged on: declared
        (a mechdiag run's reward weights: 0 to their best total), or observed per completion (the sampled
        completions' rewards, a logged batch maximum and minimum). None when only batch means are logged: a mean's
        own range says nothing about where the reward could go (a flat 0.7 is not "saturated", -3 is not "0")."""
        if self.provenance is None:
            return 0.0, max_reward(reward_weights(self.cfg)), "declared by the reward weights"
        rewards = [float(x["reward"]) for x in self.samples if _num(x.get("reward"))]
        if len(rewards) >= 2 * MIN_POINTS and max(rewards) > min(rewards):
            return min(rewards), max(rewards), f"observed over {len(rewards)} sampled completions"
        _, hi = self.series("reward_max_batch")
        _, lo = self.series("reward_min_batch")
        if hi and lo and max(hi) > min(lo):
            return min(lo), max(hi), "observed batch minimum and maximum"
        _, means = self.series("reward")
        if hi and means and min(means) >= 0 and max(hi) > 0:  # no negative mean: the floor is 0 or above it
            return 0.0, max(hi), "observed batch maximum, floor 0 (no mean below it)"
        return None

    def reward_level(self, value: float) -> float | None:
        """Where `value` sits on the reward's own scale (0 = its lowest, 1 = its highest); None without a scale."""
        scale = self.reward_scale()
        if scale is None or scale[1] <= scale[0]:
            return None
        return (value - scale[0]) / (scale[1] - scale[0])

    @property
    def reward_span(self) -> float:
        """The size a reward change is measured against: the scale's width, else the largest |mean| logged (a
        bound for a change's size, never a level)."""
        scale = self.reward_scale()
        if scale is not None and scale[1] > scale[0]:
            return scale[1] - scale[0]
        _, vals = self.series("reward")
        return max([abs(v) for v in vals] + [1e-9])

    def value(self, key: str):
        """The config value of `key` when the run shows it (read or inferred), else None: never a default stated
        as the run's."""
        held = self.known(key)
        if held is None:
            return None
        if self.provenance is not None and "value" in held and key in (self.provenance.get("keys") or {}):
            return held["value"]
        obj = self.cfg
        for part in key.split("."):
            obj = getattr(obj, part, None)
        return obj

    def nonfinite(self, key: str) -> list[int]:
        """Steps at which the trainer logged `key` as NaN or inf (kept as null by the readers)."""
        return sorted({int(r["step"]) for rows in self.raw for r in rows
                       if _num(r.get("step")) and key in r and r[key] is None})

    def logged(self, key: str) -> list[int]:
        """Steps at which `key` was logged at all (a number, NaN or inf)."""
        return sorted({int(r["step"]) for rows in self.raw for r in rows if _num(r.get("step")) and key in r})

    def onset(self, key: str, past) -> int | None:
        """The first step from which `past(value)` holds for the rest of the run (or at the last record)."""
        steps, vals = self.series(key)
        first = None
        for st, v in zip(steps, vals, strict=True):
            if past(v):
                first = st if first is None else first
            else:
                first = None
        return first

    def rollouts_per_step(self) -> int | None:
        """Completions sampled per optimizer step, when the run shows both factors."""
        n, g = self.value("prompts_per_step"), self.value("group_size")
        return int(n) * int(g) if _num(n) and _num(g) else None

    def cost(self, onset: int | None) -> dict:
        """What a finding has cost so far: steps since its onset and, where frac_zero_std is logged, the rollouts
        spent on groups whose rewards were all equal (zero advantage: no gradient) since then."""
        if not self.train:
            return {}
        last = max(self.train)
        start = onset if onset is not None else min(self.train)
        out: dict = {"steps_since_onset": last - start}
        prev, share_steps, steps = None, 0.0, 0
        for st, d in self.train.items():
            gap = st - prev if prev is not None else 1
            prev = st
            if st >= start and "frac_zero_std" in d:
                share_steps += d["frac_zero_std"] * gap
                steps += gap
        if steps:
            out["zero_advantage_share"] = round(share_steps / steps, 4)
            per = self.rollouts_per_step()
            if per:
                out["rollouts_wasted"] = int(round(share_steps * per))
        return out

    def known(self, key: str) -> dict | None:
        """How the run holds config key `key`: {"how": "read"} for a mechdiag run, its provenance entry for a
        foreign run, None when the run does not show it."""
        if self.provenance is None:
            return {"how": "read"}
        keys = self.provenance.get("keys") or {}
        return keys.get(key) or keys.get(key.split(".", 1)[0])

    def sampled_pass_k(self) -> tuple[str, list[int], list[float]] | None:
        """(key, steps, values) of the largest recorded pass@k with k > 1: only sampled completions give it."""
        keys = {k for d in self.eval.values() for k in d if k.startswith("pass@") and k[5:].isdigit()
                and int(k[5:]) > 1}
        if not keys:
            return None
        key = max(keys, key=lambda k: int(k[5:]))
        return (key, *self.series(key, "eval"))

    @property
    def start_label(self) -> str:
        """What the first accuracy of a trend is: "base" only for an eval at step 0 (run.base_eval)."""
        if "accuracy" in self.base:
            return "base"
        steps, _ = self.series("accuracy", "eval")
        return f"first eval (step {steps[0]})" if steps else "start"

    def gain_noise(self, a: float, b: float) -> float:
        """Two standard errors of the difference of two held-out accuracies a and b (binomial at their mean, each
        over the eval's problems of every pooled run): a gain under it cannot be told from the eval's sampling noise.
        0 where the problem count is not known (a foreign run)."""
        n = (self.cfg.eval_n or 0) * len(self.runs) if self.provenance is None else 0
        if n <= 0:
            return 0.0
        p = min(max((a + b) / 2, 1 / n), 1 - 1 / n)
        return 2 * math.sqrt(2 * p * (1 - p) / n)

    def accuracy_trend(self) -> tuple[float, float, float] | None:
        """(best so far including base, final, base) eval accuracy, or None without two points."""
        _, acc = self.series("accuracy", "eval")
        base = self.base.get("accuracy", acc[0] if acc else None)
        final = self.final.get("accuracy", acc[-1] if acc else None)
        if base is None or final is None or (len(acc) < 2 and "accuracy" not in self.base):
            return None
        return max([base, *acc]), final, base
