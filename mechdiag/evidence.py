"""What the doctor's rules read (mechdiag.recommend): one config's runs pooled into per-step train and eval
signals, their head/tail windows, the update mass per layer and module, the causal shares `attribute` recorded,
the sampled completions, and how the run holds each config key (a foreign run's provenance)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mechdiag.config import Config
from mechdiag.metrics import causal_shares, last_step, max_reward, update_mass, update_mass_size_normalised
from mechdiag.metrics import is_number as _num
from mechdiag.run import Run, base_eval, final_eval
from mechdiag.tasks import reward_weights

WINDOW_FRAC = 0.25  # "head" = first quarter of the train records, "tail" = last quarter
MIN_POINTS = 4  # fewer train records than this: trend rules stay silent


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

    @classmethod
    def from_runs(cls, runs: list[Run]) -> Signals:
        cfg = runs[0].cfg
        # the layer and module rules steer LoRA: read the tensors it adapts (not norms or embeddings)
        adapted = set(cfg.lora.target_modules)
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
        if len(vals) < MIN_POINTS:
            return None
        k = max(1, round(len(vals) * WINDOW_FRAC))
        sl = slice(0, k) if which == "head" else slice(len(vals) - k, len(vals)) if which == "tail" else \
            slice(k, 2 * k)  # "second": the second quarter
        s, v = steps[sl], vals[sl]
        return sum(v) / len(v), f"steps {s[0]}-{s[-1]}"

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def max_reward(self) -> float:
        """The run's own best total reward: a foreign run's from its reward functions as logged (provenance),
        a mechdiag run's from its reward weights."""
        own = (self.provenance or {}).get("max_reward") or {}
        return float(own["value"]) if _num(own.get("value")) and own["value"] > 0 else \
            max_reward(reward_weights(self.cfg))

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

    def accuracy_trend(self) -> tuple[float, float, float] | None:
        """(best so far including base, final, base) eval accuracy, or None without two points."""
        _, acc = self.series("accuracy", "eval")
        base = self.base.get("accuracy", acc[0] if acc else None)
        final = self.final.get("accuracy", acc[-1] if acc else None)
        if base is None or final is None or (len(acc) < 2 and "accuracy" not in self.base):
            return None
        return max([base, *acc]), final, base
