"""The clinic: is `recommend`'s advice proven by re-running it?

Sick starts of distinct classes (and healthy starts) train at one small, equal budget on two seeds. For each:
  named     does `recommend` (both seeds pooled) name the class: a finding whose change moves the class's own
            key the right way (learning_rate down for an lr far too high, ...); `step` is the first eval step at
            which recommend on the records so far already names it
  doctor    one round: the refined config, trained again on the same seeds and budget
  random    one random single-knob change (knob and direction drawn from the case name), same seeds and budget
  search    Optuna TPE given the same number of training runs as the doctor: its trial 0 is the sick config
            (the doctor's sick runs), trial 1 is TPE's proposal; the better of the two is its answer
"Cured" = the arm's mean held-out accuracy beats the sick runs' by at least 2 standard errors (binomial SE of
each seed's accuracy on the eval_n held-out problems, combined over the 2 seeds and the two arms). A healthy start
passes when recommend changes nothing, or its change is not worse by 2 SE.

Injected collapses: the healthy config with its learning rate multiplied at a step (a hook on the optimizer's
schedule); evals every 2 steps. `lead` = the first eval step at which held-out accuracy is 2 SE below its peak so
far, minus the step of the first live alert (mechdiag.alerts) at or after the injection. A step's alerts fire from
its record, before that step's eval runs: lead 0 is an alert printed before the eval that shows the drop. A shock
(x40 at one step) does its damage in that one update, so no signal can come earlier; a ramp (x2 per step) builds up.

    python bench/clinic.py --out bench/_work/clinic                         # every case, both testbeds
    python bench/clinic.py --out bench/_work/clinic --cases lr_low healthy  # some cases
    python bench/clinic.py --out bench/_work/clinic --table                 # the table of what is done

Runs are resumable (a finished run directory is kept). Results: OUT/clinic.json and the markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mechdiag import atomic  # noqa: E402
from mechdiag import config as configlib  # noqa: E402

SEEDS = (42, 3407)
# the smallest budget that still separates sick from cured by 2 SE on the embedded default (docs/benchmarks.md)
BUDGET = ["max_steps=12", "prompts_per_step=8", "group_size=8", "eval_n=200", "eval_every=6", "threads=1",
          "save_every=0", "max_time_s=null", "record.shift_at_eval=false", "record.final_geometry=false",
          "record.samples_every=6", "record.displacement_every=6"]
TESTBEDS = {"base": "bundled", "deep": "bundled:deep"}
FORMAT_HEAVY = ("rewards.weights={correctness: 0.1, xml_count: 1.0, numeric: 1.0, format: 1.0, "
                "reasoning_nonempty: 0.5, answer_nonempty: 0.5}")

LORA_NARROW_KEYS = {"lora.r": "up", "lora.layers": "any", "lora.target_modules": "any"}


@dataclass
class Case:
    name: str
    klass: str  # the class of sickness ("healthy" for none)
    testbed: str  # key of TESTBEDS
    overrides: list[str]
    keys: dict[str, str] = field(default_factory=dict)  # config key -> "up" / "down" / "any": what names the class
    ref: str = ""  # the healthy case it is sick against (default: its testbed's first healthy case)


CASES = [
    Case("healthy", "healthy", "base", []),
    Case("healthy_beta", "healthy", "base", ["beta=0.005", "temperature=0.8"]),
    Case("lr_low", "lr far too low", "base", ["learning_rate=2e-5"], {"learning_rate": "up"}),
    Case("lr_high", "lr far too high", "base", ["learning_rate=4e-2"], {"learning_rate": "down"}),
    Case("beta_high", "beta far too high", "base", ["beta=2.0"], {"beta": "down"}),
    Case("beta_mid", "beta far too high", "base", ["beta=0.5"], {"beta": "down"}),
    Case("temp_low", "temperature too low", "base", ["temperature=0.1"], {"temperature": "up"}),
    Case("budget_short", "budget too short", "base", ["max_completion_tokens=14"], {"max_completion_tokens": "up"}),
    Case("group_small", "group too small", "base", ["group_size=2", "prompts_per_step=8"], {"group_size": "up"}),
    # several updates per rollout: sick against the same start with the working clip
    Case("healthy_iter4", "healthy", "base", ["num_iterations=4"]),
    Case("clip_tight", "clip too tight", "base", ["num_iterations=4", "epsilon=0.0002"],
         {"epsilon": "up", "epsilon_high": "up"}, ref="healthy_iter4"),
    Case("temp_high", "temperature too high", "base", ["temperature=2.0"], {"temperature": "down"}),
    Case("lora_small", "LoRA too small / wrong place", "base",
         ["lora.r=1", "lora.layers=[0]", "lora.target_modules=[q_proj]"], LORA_NARROW_KEYS),
    Case("reward_format", "reward pays format over correctness", "base", [FORMAT_HEAVY, "scale_rewards=none"],
         {"rewards.weights": "any"}),
    Case("loss_length", "loss type that biases length", "base", ["loss_type=dr_grpo", "max_completion_tokens=192"],
         {"loss_type": "any"}),
    Case("deep_healthy", "healthy", "deep", []),
    Case("deep_lr_high", "lr far too high", "deep", ["learning_rate=4e-2"], {"learning_rate": "down"}),
    Case("deep_lora_place", "LoRA too small / wrong place", "deep",
         ["lora.r=1", "lora.layers=[7]", "lora.target_modules=[q_proj]"], LORA_NARROW_KEYS),
]
COLLAPSES = [  # (testbed, inject at step, learning-rate factor, ramp); each on both seeds
    ("base", 6, 40.0, False), ("base", 8, 100.0, False), ("deep", 6, 40.0, False),
    ("base", 6, 2.0, True), ("deep", 6, 2.0, True),  # x2 more at every step from 6: a collapse that builds up
]
# written after the rules, never used to size them: other testbed, other settings of the same classes
HELDOUT_CASES = [
    Case("deep_healthy", "healthy", "deep", []),
    Case("deep_temp_high", "temperature too high", "deep", ["temperature=1.7"], {"temperature": "down"}),
    Case("deep_healthy_iter2", "healthy", "deep", ["num_iterations=2"]),
    Case("deep_clip_tight", "clip too tight", "deep", ["num_iterations=2", "epsilon=0.001"],
         {"epsilon": "up", "epsilon_high": "up"}, ref="deep_healthy_iter2"),
    Case("deep_group_small", "group too small", "deep", ["group_size=2", "prompts_per_step=16"], {"group_size": "up"}),
]
HELDOUT_COLLAPSES = [("deep", 9, 10.0, False), ("base", 5, 1.7, True)]
# written 2026-12-07 before any was trained: milder and other magnitudes of the same classes, on both testbeds
MAGNITUDE_CASES = [
    Case("healthy", "healthy", "base", []),
    Case("healthy_iter4", "healthy", "base", ["num_iterations=4"]),
    Case("deep_healthy", "healthy", "deep", []),
    Case("lr_low10", "lr far too low", "base", ["learning_rate=1e-4"], {"learning_rate": "up"}),
    Case("lr_high8", "lr far too high", "base", ["learning_rate=8e-3"], {"learning_rate": "down"}),
    Case("beta_1", "beta far too high", "base", ["beta=1.0"], {"beta": "down"}),
    Case("temp_03", "temperature too low", "base", ["temperature=0.3"], {"temperature": "up"}),
    Case("budget_20", "budget too short", "base", ["max_completion_tokens=20"], {"max_completion_tokens": "up"}),
    Case("group_3", "group too small", "base", ["group_size=3", "prompts_per_step=8"], {"group_size": "up"}),
    Case("clip_005", "clip too tight", "base", ["num_iterations=4", "epsilon=0.005"],
         {"epsilon": "up", "epsilon_high": "up"}, ref="healthy_iter4"),
    Case("lora_v", "LoRA too small / wrong place", "base", ["lora.r=2", "lora.target_modules=[v_proj]"],
         LORA_NARROW_KEYS),
    Case("reward_format3", "reward pays format over correctness", "base",
         ["rewards.weights={correctness: 0.3, xml_count: 1.0, numeric: 1.0, format: 1.0}"], {"rewards.weights": "any"}),
    Case("deep_lr_low", "lr far too low", "deep", ["learning_rate=5e-5"], {"learning_rate": "up"}),
    Case("deep_beta_high", "beta far too high", "deep", ["beta=1.0"], {"beta": "down"}),
    Case("deep_budget_short", "budget too short", "deep", ["max_completion_tokens=16"],
         {"max_completion_tokens": "up"}),
    Case("deep_temp_low", "temperature too low", "deep", ["temperature=0.2"], {"temperature": "up"}),
]
COLLAPSE_BUDGET = ["max_steps=16", "eval_every=2", "eval_n=100"]

# the random arm: one knob, one direction (x or / the factor; temperature +- 0.4)
KNOBS = ["learning_rate", "beta", "temperature", "max_completion_tokens", "group_size", "epsilon", "lora.r"]


# ---- configs ------------------------------------------------------------------------------------------------
def case_cfg(case: Case, seed: int, extra: list[str] = ()) -> configlib.Config:
    return configlib.load(None, [f"model.name_or_path={TESTBEDS[case.testbed]}", *BUDGET, *case.overrides,
                                 *extra, f"seed={seed}"])


def with_seed(cfg: configlib.Config, seed: int) -> configlib.Config:
    data = cfg.model_dump(mode="json")
    data["seed"] = seed
    return configlib.from_dict(data)


def _get(data: dict, key: str):
    for p in key.split("."):
        data = data[p]
    return data


def _put(data: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        data = data[p]
    data[parts[-1]] = value


def set_keys(cfg: configlib.Config, values: dict) -> configlib.Config:
    data = cfg.model_dump(mode="json")
    for k, v in values.items():
        _put(data, k, v)
    return configlib.from_dict(data)


def random_knob(case: Case, cfg: configlib.Config) -> dict:
    """One knob and one direction, drawn from the case's name (so a rerun draws the same)."""
    rng = random.Random(zlib.crc32(case.name.encode()))
    data = cfg.model_dump(mode="json")
    knob, up = rng.choice(KNOBS), rng.random() < 0.5
    old = _get(data, knob)
    if knob == "learning_rate":
        new = min(1.0, old * 10) if up else old / 10
    elif knob == "beta":
        new = (old * 10 if old else 0.01) if up else old / 10
    elif knob == "temperature":
        new = round(min(5.0, old + 0.4) if up else max(0.1, old - 0.4), 3)
    elif knob == "max_completion_tokens":
        new = old * 2 if up else max(8, old // 2)
    elif knob == "group_size":  # the rollouts per step stay the same
        new = old * 2 if up else max(2, old // 2)
        return {"group_size": new, "prompts_per_step": max(1, data["group_size"] * data["prompts_per_step"] // new)}
    elif knob == "epsilon":
        new = min(1.0, old * 2) if up else old / 2
    else:  # lora.r
        new = old * 4 if up else max(1, old // 4)
    return {knob: new}


def search_space(trial, rollouts: int) -> dict:
    """The black box's space: every numeric knob the doctor may turn (reward weights, layers, modules and loss type
    are not searched)."""
    g = trial.suggest_categorical("group_size", [2, 4, 8, 16])
    beta = trial.suggest_float("beta", 1e-4, 4.0, log=True)
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-1, log=True),
            "beta": 0.0 if beta < 1e-3 else beta,
            "temperature": trial.suggest_float("temperature", 0.2, 1.5),
            "max_completion_tokens": trial.suggest_int("max_completion_tokens", 8, 96),
            "group_size": g, "prompts_per_step": max(1, rollouts // g),
            "epsilon": trial.suggest_float("epsilon", 0.005, 0.4, log=True),
            "lora.r": trial.suggest_categorical("lora.r", [1, 2, 4, 8, 16, 32])}


def sick_params(cfg: configlib.Config) -> dict:
    return {"group_size": cfg.group_size, "beta": max(cfg.beta, 1e-4), "learning_rate": cfg.learning_rate,
            "temperature": cfg.temperature, "max_completion_tokens": cfg.max_completion_tokens,
            "epsilon": cfg.epsilon, "lora.r": cfg.lora.r}


# ---- training (in worker processes) --------------------------------------------------------------------------
class Collapse:
    """Multiplies the learning rate by `factor` from step `at` on (the schedule's base rates, so it holds); with
    `ramp`, by `factor` again at every later step (a collapse that builds up over steps). A hook
    on the recorder's protocol (train.hooks), given its trainer once built."""

    def __init__(self, at: int, factor: float, ramp: bool = False):
        self.at, self.factor, self.ramp, self.trainer = at, factor, ramp, None

    def on_weights(self, rec, step, model, last):
        trainer = self.trainer
        # after step at-1's updates: before step `at`'s (a ramp: again after each later step, compounding)
        if step == self.at - 1 or (self.ramp and step >= self.at - 1):
            trainer.sched.base_lrs = [b * self.factor for b in trainer.sched.base_lrs]
            for g, b in zip(trainer.opt.param_groups, trainer.sched.base_lrs, strict=True):
                g["lr"] = b * trainer.sched.lr_lambdas[0](trainer.sched.last_epoch)
            trainer.sched._last_lr = [g["lr"] for g in trainer.opt.param_groups]  # what the step records


def done(cfg_data: dict, out: Path) -> bool:
    """A finished run of this very config (a run of an older recommendation is trained again)."""
    from mechdiag.tasks import resolve_rewards  # noqa: PLC0415

    if not (out / "summary.json").exists():
        return False
    return configlib.load(out / "config.yaml") == resolve_rewards(configlib.from_dict(cfg_data))


def _train(job: tuple) -> str:
    cfg_data, out, collapse = job
    out = Path(out)
    if done(cfg_data, out):
        return str(out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mechdiag.train.trainer import Trainer  # noqa: PLC0415 - torch, in the worker only

    shutil.rmtree(out, ignore_errors=True)
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        hook = Collapse(*collapse) if collapse else None
        trainer = Trainer(configlib.from_dict(cfg_data), out, extra_hooks=[hook] if hook else None)
        if hook is not None:
            hook.trainer = trainer
        trainer.fit()
    return str(out)


NO_TRAIN = False  # --measure: read what is trained, train nothing


def train_all(jobs: list[tuple], n_jobs: int, log) -> None:
    todo = [j for j in jobs if not done(j[0], Path(j[1]))]
    if not todo or NO_TRAIN:
        return
    log(f"training {len(todo)} runs ({n_jobs} at a time)")
    if n_jobs <= 1:
        for j in todo:
            log(f"  {_train(j)}")
        return
    with ProcessPoolExecutor(n_jobs) as pool:
        for path in pool.map(_train, todo):
            log(f"  {path}")


# ---- measuring -------------------------------------------------------------------------------------------------
def accuracy(run_dir: Path) -> tuple[float, int]:
    s = json.loads((run_dir / "summary.json").read_text())
    return float(s["final_accuracy"]), int(s["eval_n"])


def arm_stats(dirs: list[Path]) -> dict:
    """Mean held-out accuracy over seeds and its standard error (binomial per seed, combined)."""
    accs = [accuracy(d) for d in dirs]
    mean = sum(a for a, _ in accs) / len(accs)
    # binomial SE with one success and one failure added (Agresti-Coull-like): 0 of n is not certainty
    se = math.sqrt(sum(p * (1 - p) / (n + 2) for p in ((a * n + 1) / (n + 2) for a, n in accs)
                       for n in [accs[0][1]])) / len(accs)
    return {"accuracy": round(mean, 4), "se": round(se, 4), "seeds": [round(a, 4) for a, _ in accs]}


def beats(arm: dict, ref: dict, k: float = 2.0) -> bool:
    """arm's mean accuracy above ref's by at least k standard errors of the difference."""
    se = math.hypot(arm["se"], ref["se"])
    return arm["accuracy"] - ref["accuracy"] >= k * max(se, 1e-9)


def not_worse(arm: dict, ref: dict, k: float = 2.0) -> bool:
    return ref["accuracy"] - arm["accuracy"] < k * max(math.hypot(arm["se"], ref["se"]), 1e-9)


def _moves(change: dict, keys: dict[str, str]) -> bool:
    direction = keys.get(change["key"])
    if direction is None:
        return False
    old, new = change["old"], change["new"]
    if direction == "any" or not all(isinstance(x, (int, float)) for x in (old, new)):
        return old != new
    return new > old if direction == "up" else new < old


def names_class(rec, keys: dict[str, str]) -> list[str]:
    """The rules whose changes move the class's own key the right way."""
    return sorted({c.rule for c in rec.changes if _moves(c.record(), keys)})


def prefix(run, step: int):
    """The run as it stood after `step`: every stream cut there, no final summary."""
    from mechdiag.run import Run  # noqa: PLC0415

    streams = {k: [r for r in v if not isinstance(r.get("step"), int) or r["step"] <= step]
               for k, v in run.streams.items()}
    return Run(run.path, run.config, streams, {}, [], run.source)


def first_named_step(runs, keys) -> int | None:
    """The first eval step at which recommend on the records so far names the class."""
    from mechdiag.recommend import recommend  # noqa: PLC0415

    steps = sorted({r["step"] for r in runs[0].eval if isinstance(r.get("step"), int) and r["step"] > 0})
    for s in steps:
        if names_class(recommend([prefix(r, s) for r in runs]), keys):
            return s
    return None


def two_se_drop(evals: list[dict], n: int) -> int | None:
    """First eval step whose accuracy is 2 SE below the peak so far."""
    peak = None
    for r in sorted(evals, key=lambda r: r["step"]):
        a = r["accuracy"]
        if peak is not None and a < peak - 2 * math.sqrt(max(peak * (1 - peak), 1e-6) / n):
            return r["step"]
        peak = a if peak is None else max(peak, a)
    return None


# ---- the clinic --------------------------------------------------------------------------------------------------
def run_cases(cases: list[Case], out: Path, n_jobs: int, log, seeds=SEEDS, doctor: bool = True,
              arm_seeds=None, train_arms=("doctor", "random", "search"), train_sick: bool = True) -> list[dict]:
    """Train every arm of every case (finished runs are kept) and measure them. arm_seeds: the seeds of the random
    and search arms (default: all; fewer when CPU is short, compared against the sick runs of the same seeds)."""
    arm_seeds = tuple(arm_seeds or seeds)
    from mechdiag.recommend import recommend  # noqa: PLC0415
    from mechdiag.run import load_run  # noqa: PLC0415

    sick = {c.name: [out / c.name / f"sick-{s}" for s in seeds] for c in cases}
    if train_sick:
        train_all([(case_cfg(c, s).model_dump(mode="json"), d, None) for c in cases
                   for s, d in zip(seeds, sick[c.name], strict=True)], n_jobs, log)
    arms, jobs = {}, []
    for c in cases:
        runs = [load_run(d) for d in sick[c.name]]
        rec = recommend(runs)
        cfg0 = case_cfg(c, seeds[0])
        knob = random_knob(c, cfg0)
        sick_acc = arm_stats([out / c.name / f"sick-{s}" for s in arm_seeds])
        # TPE's space holds the usual values only (group 2-16 in powers of 2): proposed only when trained
        search = search_proposal(c, cfg0, sick_acc["accuracy"], arm_seeds) if "search" in train_arms else {}
        arms[c.name] = {"rec": rec, "knob": knob, "search": search}
        plans = [("random", set_keys(cfg0, knob)), ("search", set_keys(cfg0, search))]
        if rec.changes and doctor:
            plans.append(("doctor", rec.cfg))
        for arm, cfg in plans:
            if arm not in train_arms:
                continue
            for s in (seeds if arm == "doctor" else arm_seeds):
                jobs.append((with_seed(cfg, s).model_dump(mode="json"), out / c.name / f"{arm}-{s}", None))
    train_all(jobs, n_jobs, log)
    rows = []
    for c in cases:
        a = arms[c.name]
        rec = a["rec"]
        ref = arm_stats(sick[c.name])
        row = {"case": c.name, "class": c.klass, "testbed": c.testbed, "start": " ".join(c.overrides) or "default",
               "ref": c.ref,
               "sick": ref, "findings": [f.rule for f in rec.findings],
               "changes": "; ".join(str(x) for x in rec.changes) or "none"}
        if c.keys:
            named = names_class(rec, c.keys)
            row["named"] = named
            row["named_step"] = first_named_step([load_run(d) for d in sick[c.name]], c.keys) if named else None
        for arm, desc in (("doctor", row["changes"]),
                          ("random", ", ".join(f"{k}={v}" for k, v in a["knob"].items())),
                          ("search", ", ".join(f"{k}={_fmt(v)}" for k, v in a["search"].items()))):
            arm_ref = ref if arm == "doctor" else arm_stats([out / c.name / f"sick-{s}" for s in arm_seeds])
            dirs = [out / c.name / f"{arm}-{s}" for s in (seeds if arm == "doctor" else arm_seeds)]
            if arm == "doctor" and not rec.changes:
                stats = dict(ref)
            elif (arm == "doctor" and not doctor) or not all((d / "summary.json").exists() for d in dirs):
                row[arm] = {**ref, "change": desc, "cured": False, "pending": True}
                continue
            else:
                stats = arm_stats(dirs)
            if arm == "search" and stats["accuracy"] < arm_ref["accuracy"]:  # its answer: the better of its trials
                stats = {**arm_ref, "kept_sick": True}
            row[arm] = {**stats, "change": desc, "n_seeds": len(dirs),
                        "cured": beats(stats, arm_ref) if c.keys else not_worse(stats, arm_ref)}
        rows.append(row)
    return rows


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def search_proposal(case: Case, cfg0, sick_acc: float, seeds) -> dict:
    """Optuna TPE's trial 1 after trial 0 = the sick config with its measured accuracy (the budget: two configs
    on the doctor's seeds)."""
    import optuna  # noqa: PLC0415 - the clinic extra

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rollouts = cfg0.group_size * cfg0.prompts_per_step
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=zlib.crc32(case.name.encode())))
    study.enqueue_trial(sick_params(cfg0))
    t0 = study.ask()
    search_space(t0, rollouts)
    study.tell(t0, sick_acc)
    t1 = study.ask()
    return search_space(t1, rollouts)


def run_collapses(out: Path, n_jobs: int, log, seeds=SEEDS, which=None) -> list[dict]:
    from mechdiag.alerts import check  # noqa: PLC0415
    from mechdiag.evidence import Signals  # noqa: PLC0415
    from mechdiag.run import load_run  # noqa: PLC0415

    todo = [c for c in COLLAPSES if which is None or c[0] in which]
    jobs, dirs = [], {}
    for testbed, at, factor, ramp in todo:
        base = Case("collapse", "collapse", testbed, COLLAPSE_BUDGET)
        for s in seeds:
            d = out / f"collapse-{testbed}-at{at}-x{factor:g}{'-ramp' if ramp else ''}" / f"seed-{s}"
            dirs[(testbed, at, factor, ramp, s)] = d
            jobs.append((case_cfg(base, s).model_dump(mode="json"), d, (at, factor, ramp)))
    train_all(jobs, n_jobs, log)
    rows = []
    for (testbed, at, factor, ramp, s), d in dirs.items():
        if not (d / "summary.json").exists():
            continue
        run = load_run(d)
        n = int(run.summary.get("eval_n", 300))
        drop = two_se_drop(run.eval, n)
        alerts = check(run.metrics, run.eval, run.displacement, Signals.from_runs([run]).max_reward)
        before = [a for a in alerts if a.step < at]
        after = sorted((a for a in alerts if a.step >= at), key=lambda a: a.step)
        first = after[0] if after else None
        rows.append({"testbed": testbed, "inject_step": at, "lr_factor": factor, "ramp": ramp, "seed": s,
                     "drop_step": drop,
                     "alert": first.alert if first else None, "alert_step": first.step if first else None,
                     "lead": (drop - first.step) if first and drop is not None else None,
                     "false_alarms": [a.alert for a in before]})
    return rows


# ---- the table ---------------------------------------------------------------------------------------------------
def _acc(x: dict) -> str:
    return f"{x['accuracy']:.3f} ± {x['se']:.3f}"


def table(result: dict) -> str:
    lines = ["| case | class | start | sick | named (rule, step) | doctor's change | doctor | random knob | random | "
             "search (TPE) | search |", "|" + "---|" * 11]
    for r in result.get("cases", []):
        named = "-" if "named" not in r else ((", ".join(r["named"]) + f" @ {r['named_step']}") if r["named"]
                                              else "**no**")
        ok = "cured" if r["class"] != "healthy" else "not worse"
        cell = {arm: "pending" if r[arm].get("pending") else
                f"{_acc(r[arm])} {'(' + ok + ')' if r[arm]['cured'] else ''}".strip()
                for arm in ("doctor", "random", "search")}
        lines.append(f"| {r['case']} | {r['class']} | `{r['start']}` | {_acc(r['sick'])} | {named} | "
                     f"{r['doctor']['change']} | {cell['doctor']} | {r['random']['change']} | {cell['random']} | "
                     f"{r['search']['change']} | {cell['search']} |")
    healthy = [r for r in result.get("cases", []) if r["class"] == "healthy"]
    ref = {r["case"]: r["sick"] for r in healthy}
    for r in healthy:
        ref.setdefault(r["testbed"], r["sick"])
    starts = [r for r in result.get("cases", []) if r["class"] != "healthy"]
    sick = [r for r in starts if (r.get("ref") or r["testbed"]) in ref and
            beats(ref[r.get("ref") or r["testbed"]], r["sick"])]
    mild = [r["case"] for r in starts if r not in sick]
    if starts:
        def count(rs, arm):
            done = [r for r in rs if not r[arm].get("pending")]
            return f"{sum(r[arm]['cured'] for r in done)}/{len(done)}"
        lines.append("")
        lines.append(f"Sick (its healthy start beats it by 2 SE): {len(sick)} of {len(starts)} starts"
                     + (f"; not sick at this budget: {', '.join(mild)}" if mild else "") + ". On the sick ones: "
                     f"named {sum(bool(r['named']) for r in sick)}/{len(sick)}; cured by the doctor "
                     f"{count(sick, 'doctor')}, the random knob {count(sick, 'random')}, the search "
                     f"{count(sick, 'search')} (arms still training are left out). Starts that are not sick: "
                     f"quiet {sum(r['changes'] == 'none' for r in starts if r['case'] in mild)}/{len(mild)}. "
                     f"Healthy starts unchanged or not worse: {sum(r['doctor']['cured'] for r in healthy)}/"
                     f"{len(healthy)} (quiet: {sum(r['changes'] == 'none' for r in healthy)}/{len(healthy)}).")
    col = result.get("collapses", [])
    if col:
        lines += ["", "| testbed | injected (step, lr x) | seed | accuracy 2 SE below peak at | first alert | lead "
                  "(steps) | alerts before injection |", "|---|---|---|---|---|---|---|"]
        for c in col:
            how = f"x{c['lr_factor']:g} per step" if c.get("ramp") else f"x{c['lr_factor']:g}"
            lines.append(f"| {c['testbed']} | {c['inject_step']}, {how} | {c['seed']} | "
                         f"{c['drop_step']} | {c['alert']} @ {c['alert_step']} | {c['lead']} | "
                         f"{', '.join(c['false_alarms']) or 'none'} |")
        # a step's alerts fire from its record, before that step's eval: lead 0 is an alert before the drop shows
        led = [c for c in col if c["lead"] is not None and c["lead"] >= 0 and not c["false_alarms"]]
        lines += ["", f"The first alert comes before the eval that shows the drop, with no alert before the "
                      f"injection, on {len(led)}/{len(col)} collapses (lead >= 1 step on "
                      f"{sum(c['lead'] >= 1 for c in led)})."]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--no-collapse", action="store_true")
    ap.add_argument("--no-doctor", action="store_true", help="train the sick, random and search arms only")
    ap.add_argument("--train-arms", nargs="*", default=["doctor", "random", "search"],
                    help="the arms this process trains (the others are read when present); with --no-sick, two "
                         "processes can share OUT")
    ap.add_argument("--no-sick", action="store_true", help="do not train sick runs (another process does)")
    ap.add_argument("--measure", action="store_true", help="train nothing: measure the runs already in OUT")
    ap.add_argument("--jobs", type=int, default=1, help="runs trained at once (processes)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--arm-seeds", type=int, nargs="+", default=None,
                    help="seeds of the random and search arms (default: --seeds)")
    ap.add_argument("--collapse-testbeds", nargs="*", default=None, help="testbeds of the injected collapses")
    ap.add_argument("--table", action="store_true", help="print the table of OUT/clinic.json and stop")
    ap.add_argument("--set", action="append", default=[], help="budget override for every run (KEY=VALUE)")
    ap.add_argument("--heldout", action="store_true",
                    help="the held-out starts and collapses (written after the rules), the doctor's arm only")
    ap.add_argument("--magnitudes", action="store_true",
                    help="other magnitudes of the same classes (written before they were trained), the doctor's "
                         "arm only, no collapses")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.table:
        print(table(json.loads((out / "clinic.json").read_text())))
        return {}
    BUDGET.extend(args.set)
    global NO_TRAIN
    NO_TRAIN = args.measure
    out.mkdir(parents=True, exist_ok=True)
    if args.heldout:
        CASES[:], COLLAPSES[:], args.train_arms = HELDOUT_CASES, HELDOUT_COLLAPSES, ["doctor"]
    if args.magnitudes:
        CASES[:], COLLAPSES[:], args.train_arms, args.no_collapse = MAGNITUDE_CASES, [], ["doctor"], True
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    path = out / "clinic.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    rows = run_cases(cases, out, args.jobs, log, tuple(args.seeds), doctor=not args.no_doctor,
                     arm_seeds=args.arm_seeds, train_arms=args.train_arms, train_sick=not args.no_sick)
    keep = [r for r in old.get("cases", []) if r["case"] not in {c.name for c in cases}]
    result = {"budget": BUDGET, "seeds": args.seeds, "cases": keep + rows, "collapses": old.get("collapses", [])}
    if not args.no_collapse:
        result["collapses"] = run_collapses(out, args.jobs, log, tuple(args.seeds),
                                            args.collapse_testbeds or {c.testbed for c in cases} or None)
    atomic.write_text(path, json.dumps(result, indent=1))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
