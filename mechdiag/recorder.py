"""The one recorder both trainers drive (the native Trainer directly, TRL through MechdiagCallback).

A `Recorder` holds the run directory and a list of signals, and turns six events into records:

    start()                                   after setup (a resumed run's records already on disk)
    train(record)                             a step: its StepRecord (the rollout and what the updates did)
    weights(step, model, last)                the policy after a step's updates (model: the PEFT model or None)
    save(step, path)                          a checkpoint is complete
    eval(step, model, tokenizer, ...)         a held-out evaluation; returns the eval record
    end(step, model, tokenizer, summary)      once, after the last step; returns summary.json (Summary)

Both trainers only produce StepRecords; every per-step number is computed here from the record, once (a new one:
a Signal whose on_train reads the record). Each `Signal` has one job: its `on_*` methods COMPUTE (on every rank
under a sharded model) and return the records of its stream or add keys to the eval record; `write` runs on the
writer rank only. A user's signal is a Signal subclass named in the config (record.signals,
"package.module:Class") or passed to MechdiagCallback(signals=[...]); its stream is signals/NAME.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.request
from dataclasses import asdict, dataclass, field

from mechdiag import atomic, tasks
from mechdiag.alerts import CRITICAL, NAMES, Watcher
from mechdiag.config import load_object, save
from mechdiag.displacement import lora_rows
from mechdiag.distributed import inference_mode
from mechdiag.errors import UserError
from mechdiag.generate import generate, greedy, step_seed
from mechdiag.metrics import is_number, max_reward, pass_at_k
from mechdiag.outcomes import CORRECTNESS, group_stats
from mechdiag.probes.shift import shift_inmemory
from mechdiag.run import RunDir


@dataclass
class Update:
    """What one step's updates did, as the trainer measured it (None: not measured)."""

    loss: float | None = None
    kl: float | None = None  # k3 of the sampling policy against the reference, token mean over the rollout
    entropy: float | None = None  # token mean over the rollout
    clip_fraction_low: float | None = None
    clip_fraction_high: float | None = None
    policy_clip_fraction: float | None = None
    grad_norm: float | None = None
    update_norm: float | None = None  # ||theta_after - theta_before|| of the trainable parameters over the step
    entropy_coef: float | None = None  # the entropy bonus's coefficient after the updates (adaptive controller)
    lr: float | None = None
    step_time: float | None = None
    rollout_time: float | None = None
    skipped_updates: int | None = None


@dataclass
class StepRecord:
    """One training step as both trainers hand it to the recorder: its rollout, one entry per completion (empty
    when the trainer saw none), and what its updates did. `extra`: what a trainer logged beyond these fields, in
    canonical keys (a computed value of the same name wins)."""

    step: int
    group_ids: list = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)  # name -> unweighted values
    weights: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)  # the weighted total (NaN: unscorable)
    lengths: list[int] | None = None  # completion tokens, EOS counted
    truncated: list[bool] | None = None  # no EOS within the budget
    texts: list[str] | None = None
    prompts: list[str] | None = None
    example_ids: list | None = None
    advantages: list[float] | None = None
    update: Update = field(default_factory=Update)
    extra: dict = field(default_factory=dict)


def _mean(xs) -> float:
    xs = [float(x) for x in xs if is_number(x)]
    return math.fsum(xs) / len(xs) if xs else math.nan


def step_metrics(r: StepRecord) -> dict:
    """metrics.jsonl's record of a step, computed from its StepRecord: the one definition of each per-step signal."""
    out = dict(r.extra)
    if r.rewards:
        ok = [float(x) for x in r.rewards if is_number(x)]
        out["reward"] = _mean(ok)
        if len(ok) > 1:
            out["reward_std"] = math.sqrt(math.fsum((x - out["reward"]) ** 2 for x in ok) / (len(ok) - 1))
        out.update(group_stats(r.rewards, r.group_ids, r.components.get(CORRECTNESS)))
        out.update({f"reward/{k}": _mean(v) for k, v in r.components.items()})
    if r.lengths:
        out["completion_length"] = _mean(r.lengths)
        if r.update.step_time:
            out["tokens_per_s"] = sum(r.lengths) / r.update.step_time
    if r.truncated:
        out["completion_clipped_ratio"] = _mean([float(x) for x in r.truncated])
    out.update({k: v for k, v in asdict(r.update).items() if v is not None})
    return out


class Signal:
    """One signal. `stream`: the run-directory stream its records go to (a user signal: its `name`). on_train
    reads the step's StepRecord; rec.latest holds the records the signals before it gave at this event
    (rec.latest["metrics"][0]: the step's computed metrics)."""

    stream: str | None = None
    name: str | None = None

    def on_start(self, rec: Recorder) -> None: ...
    def on_train(self, rec: Recorder, step: int, record: StepRecord) -> list | None: ...
    def on_weights(self, rec: Recorder, step: int, model, last: bool) -> list | None: ...
    def on_eval(self, rec: Recorder, step: int, record: dict, ctx: dict) -> list | None: ...
    def on_save(self, rec: Recorder, step: int, path) -> None: ...
    def on_end(self, rec: Recorder, step: int, ctx: dict) -> list | None: ...

    def write(self, run: RunDir, records: list) -> None:
        """Writer rank only."""
        run.append(self.stream or self.name, records)


class Recorder:
    def __init__(self, run: RunDir | None, signals: list[Signal], writer: bool = True, engine=None):
        # engine: a mechdiag.distributed.Engine when every rank computes (a sharded model); run None off the writer
        self.run, self.signals, self.writer, self.engine = run, list(signals), writer, engine
        for s in self.signals:
            if writer and getattr(s, "stream", None) is None and getattr(s, "name", None):
                run.register(s.name)
        self.latest: dict[str, list] = {}  # this event's records per stream, for signals that read others'

    def _emit(self, event: str, *args) -> None:
        self.latest = {}
        for s in self.signals:
            fn = getattr(s, event, None)  # a hook (train.hooks) may have any subset of the events
            out = fn(self, *args) if fn is not None else None
            if out:  # a hook returns none (or is a Signal subclass, with `write`)
                self.latest[getattr(s, "stream", None) or getattr(s, "name", None)] = out
                if self.writer:
                    s.write(self.run, out)

    def write_config(self, cfg, header: str) -> None:
        """config.yaml: the config as it runs (reward weights, LoRA targets resolved); the writer rank's."""
        if self.writer:
            save(cfg, self.run.config_path, header=header)

    def start(self) -> None:
        self._emit("on_start")

    def train(self, record: StepRecord) -> dict:
        """Record a step; returns its computed metrics (metrics.jsonl's record)."""
        self._emit("on_train", record.step, record)
        return (self.latest.get("metrics") or [{}])[0]

    def weights(self, step: int, model, last: bool = False) -> None:
        self._emit("on_weights", step, model, last)

    def eval(self, step: int, model, tokenizer, metrics: dict | None = None, sampler=None, ref_model=None) -> dict:
        record = {"step": step, **(metrics or {})}
        self._emit("on_eval", step, record, {"model": model, "tokenizer": tokenizer, "sampler": sampler or model,
                                             "ref_model": ref_model})
        return record

    def save(self, step: int, path) -> None:
        """A checkpoint at `step` is complete (the native trainer's)."""
        self._emit("on_save", step, path)

    def end(self, step: int, model, tokenizer, summary: dict | None = None) -> dict:
        """The last event; `summary`: what the trainer adds to summary.json (wall time, memory, source...)."""
        self._emit("on_end", step, {"model": model, "tokenizer": tokenizer, "summary": summary or {}})
        return (self.latest.get("summary") or [{}])[0]

    def find(self, kind: type):
        return next((s for s in self.signals if isinstance(s, kind)), None)

    @property
    def stop(self):
        """The alert that halts the run (record.halt_on), or None: trainers check it once per step."""
        halt = self.find(Halt)
        return None if halt is None else halt.stop


# ---- the built-in signals ------------------------------------------------------------------------------------
class TrainMetrics(Signal):
    """metrics.jsonl: one record per step (step_metrics)."""

    stream = "metrics"

    def on_train(self, rec, step, record):
        return [{"step": step, **step_metrics(record)}]


class Samples(Signal):
    """samples.jsonl: the rollout's completions every `every` steps (where the record holds their texts)."""

    stream = "samples"

    def __init__(self, every: int):
        self.every = every

    def on_train(self, rec, step, r):
        if not (r.texts and self.every and step % self.every == 0):
            return None
        num = lambda xs: [x if is_number(x) else None for x in xs]  # noqa: E731 - NaN: unscorable
        cols = {"group": r.group_ids, "example_id": r.example_ids, "prompt": r.prompts, "completion": r.texts,
                "reward": num(r.rewards), "advantage": r.advantages, "truncated": r.truncated, "length": r.lengths,
                **{f"reward/{k}": num(v) for k, v in r.components.items()}}
        cols = {k: v for k, v in cols.items() if v is not None}
        return [{"step": step, "split": "train", **{k: v[i] for k, v in cols.items()}} for i in range(len(r.texts))]


class Displacement(Signal):
    """displacement.jsonl: every `every` steps and after the last one, rel_fro per layer x module of the effective
    LoRA weights against the base; the last step's rows also carry the update geometry (subspace_overlap,
    intruders: one pass over each base weight), replacing that step's plain rows when the run stopped early at a
    recorded step."""

    stream = "displacement"

    def __init__(self, every: int, final_geometry: bool = True):
        self.every, self.final_geometry = every, final_geometry
        self.step = self.geometry_step = -1
        self._replace = False

    def _rows(self, rec: Recorder, step: int, model, geometry: bool) -> list:
        self._replace = geometry and self.step == step
        self.step = step
        if geometry:
            self.geometry_step = step
        return [{"step": step, **r} for r in lora_rows(model, geometry=geometry, engine=rec.engine)]

    def on_weights(self, rec, step, model, last):
        if model is not None and self.every and step % self.every == 0:
            return self._rows(rec, step, model, last and self.final_geometry)
        return None

    def on_end(self, rec, step, ctx):
        model = ctx["model"]
        if model is None or not self.every:
            return None
        if self.step != step or (self.final_geometry and self.geometry_step != step):
            return self._rows(rec, step, model, self.final_geometry)
        return None

    def write(self, run, records):
        if self._replace:
            run.replace_step(self.stream, records[0]["step"], records)
        else:
            run.append(self.stream, records)


class HeldOut(Signal):
    """The trainer's held-out evaluation, a plain object both trainers call: greedy accuracy, eval reward,
    entropy, completion length (generate.greedy, one pass) and pass@k on the config's fixed held-out problems;
    its first 16 completions go to samples.jsonl."""

    stream = "samples"

    def __init__(self, cfg, task, examples: list, prompts: list[str]):
        self.cfg, self.task, self.examples, self.prompts = cfg, task, examples, prompts

    @classmethod
    def from_config(cls, cfg, tokenizer, task=None) -> HeldOut:
        task = task or tasks.get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
        examples = task.examples(cfg.task.eval_split, n=cfg.eval_n, seed=0)
        return cls(cfg, task, examples, [task.prompt(ex, tokenizer) for ex in examples])

    def evaluate(self, model, tokenizer, step: int, batch_size: int = 256) -> tuple[dict, list]:
        out, scored = heldout_eval(model, tokenizer, self.task, self.examples, self.prompts, self.cfg, batch_size)
        out.update(self.pass_at_k(model, tokenizer, step))
        return out, [{"step": step, "split": "eval", "example_id": ex.id, "prompt": prompt, "completion": smp.text,
                      "correct": ok, "reward": r}
                     for ex, prompt, (smp, ok, r) in zip(self.examples, self.prompts, scored[:16], strict=False)]

    def pass_at_k(self, model, tokenizer, step: int) -> dict:
        cfg = self.cfg
        n = cfg.eval_samples
        if n == 1:  # pass@k only from sampled completions; greedy accuracy is `accuracy`, never pass@1
            return {}
        groups = generate(model, tokenizer, self.prompts, n=n, temperature=cfg.temperature, top_p=cfg.top_p,
                          max_new_tokens=cfg.max_completion_tokens, seed=step_seed(cfg.seed, step, 3),
                          batch_size=256, max_prompt_tokens=cfg.max_prompt_tokens)
        cs = [sum(bool(self.task.correct(s.text, ex)) for s in g) for g, ex in zip(groups, self.examples, strict=True)]
        return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in cs) / len(cs) for k in cfg.pass_k if k <= n}

    def on_eval(self, rec, step, record, ctx):
        metrics, samples = self.evaluate(ctx["sampler"], ctx["tokenizer"], step)
        record.update(metrics)
        return samples


@inference_mode
def heldout_eval(model, tokenizer, task, examples: list, prompts: list[str], cfg, batch_size: int = 256):
    """The trainer's held-out numbers from the one greedy pass (generate.greedy): accuracy, eval reward, entropy
    and completion length of `model` on `examples`, and per problem (Sample, correct, reward). `mechdiag attribute`
    scores with it too, so its reference rows equal summary.json exactly."""
    was = model.training
    model.eval()
    try:
        done, ent_sum, ent_n = greedy(model, tokenizer, prompts, cfg.max_completion_tokens, cfg.max_prompt_tokens,
                                      batch_size)
    finally:
        model.train(was)
    scored = [(smp, bool(task.correct(smp.text, ex)), task.reward(smp.text, ex, tasks.reward_weights(cfg))[0])
              for smp, ex in zip(done, examples, strict=True)]
    n = len(scored)
    out = {"accuracy": sum(ok for _, ok, _ in scored) / n, "eval_reward": sum(r for _, _, r in scored) / n,
           "entropy": ent_sum / max(ent_n, 1), "completion_length": sum(s.length for s in done) / n}
    return out, scored


class Forget(Signal):
    """forget_kl in the eval record (probes.forget.ForgetProbe; the base: ref_model, else the adapter disabled)."""

    def __init__(self, probe):
        self.probe = probe

    def on_eval(self, rec, step, record, ctx):
        if ctx["model"] is not None:
            record["forget_kl"] = self.probe.kl(ctx["model"], ctx["ref_model"])


class EvalRecords(Signal):
    """eval.jsonl: one record per evaluation (after the signals that fill it)."""

    stream = "eval"

    def __init__(self):
        self.records: list[dict] = []

    def on_start(self, rec):
        self.records = rec.run.read("eval") if rec.run is not None else []  # a resumed run's, base eval included

    def on_eval(self, rec, step, record, ctx):
        self.records.append(record)
        return [record]


class Summary(Signal):
    """summary.json, composed once at the end: the run (config), its steps, the base and final held-out numbers
    (the eval records: step 0 and the last) and what the trainer adds (ctx["summary"])."""

    stream = "summary"

    def __init__(self, cfg):
        self.cfg = cfg

    def on_end(self, rec, step, ctx):
        cfg = self.cfg
        heldout = rec.find(HeldOut)  # the problems it really has (a task may hold fewer than eval_n)
        out = {"steps": step, "seed": cfg.seed, "model": cfg.model.name_or_path, "task": cfg.task.name,
               "eval_n": len(heldout.examples) if heldout is not None else cfg.eval_n}
        evals = [e for e in rec.find(EvalRecords).records if "accuracy" in e]
        if evals:
            out.update(final_accuracy=evals[-1]["accuracy"], final_eval_reward=evals[-1].get("eval_reward"))
            base = next((e for e in evals if e["step"] == 0), None)
            if base is not None:
                out.update(base_accuracy=base["accuracy"], base_eval_reward=base.get("eval_reward"),
                           accuracy_gain=evals[-1]["accuracy"] - base["accuracy"])
        return [{k: v for k, v in {**out, **ctx["summary"]}.items() if v is not None}]  # None: the trainer's "unknown"

    def write(self, run, records):
        run.write_summary(records[0])


class Shift(Signal):
    """shift.jsonl: at each evaluation after the base one (and after the last step), the activation shift per
    layer on held-out prompts."""

    stream = "shift"

    def __init__(self, prompts: list[str], batch_size: int):
        self.prompts, self.batch_size, self.step = list(prompts), batch_size, -1

    def _rows(self, step, model, tokenizer):
        if not self.prompts or step == 0 or model is None or step == self.step:
            return None
        self.step = step
        rows = shift_inmemory(model, tokenizer, self.prompts, batch_size=self.batch_size, step=step)
        return [{**r, "step": step} for r in rows]

    def on_eval(self, rec, step, record, ctx):
        return self._rows(step, ctx["model"], ctx["tokenizer"])

    def on_end(self, rec, step, ctx):
        return self._rows(step, ctx["model"], ctx["tokenizer"])


class Alerts(Signal):
    """Live alerts (mechdiag.alerts), each printed once when it first fires, after the signals of its event;
    a resumed run's records are history, already announced."""

    def __init__(self, cfg):
        self.watcher = Watcher(max_reward(tasks.reward_weights(cfg)))
        self.new: list = []  # the alerts this event fired first (trackers.Report reads them)

    def on_start(self, rec):
        run = rec.run
        self.watcher.update(run.read("metrics"), run.read("eval"), run.read("displacement"), announce=False)

    def _update(self, rec):
        self.new = self.watcher.update(rec.latest.get("metrics", ()), rec.latest.get("eval", ()),
                                       rec.latest.get("displacement", ()))

    def on_train(self, rec, step, record):
        self._update(rec)

    def on_weights(self, rec, step, model, last):
        self._update(rec)

    def on_eval(self, rec, step, record, ctx):
        self._update(rec)

    def on_end(self, rec, step, ctx):
        self._update(rec)


class Halt(Signal):
    """Auto-halt and the alert hook (record.halt_on, record.alert_hook). Runs after Alerts and reads the alerts an
    event fired first: each goes to the hook; the first one named in halt_on sets `stop`, and RUN/halt.json says
    which alert, at which step, and where to resume: the step of the best held-out accuracy so far, whose adapter
    (or model) RUN/best/ keeps (step 0: the base model, nothing to keep)."""

    HOOK_TIMEOUT_S = 30

    def __init__(self, cfg):
        names = set()
        for n in cfg.record.halt_on:
            if n not in (*NAMES, "critical"):
                raise UserError(f"record.halt_on: unknown alert {n!r}; known: critical, {', '.join(NAMES)}")
            names |= set(CRITICAL) if n == "critical" else {n}
        self.halt_on, self.hook = names, cfg.record.alert_hook
        self.stop = None
        self.best: tuple[float, int] | None = None  # (held-out accuracy, step)

    def _alerts(self, rec):
        alerts = rec.find(Alerts)
        for a in alerts.new if alerts is not None else ():
            if rec.writer and self.hook:
                self._call_hook(rec, a)
            if self.stop is None and a.alert in self.halt_on:
                self.stop = a
                if rec.writer:
                    best = self.best or (None, 0)
                    atomic.write_json(rec.run.path / "halt.json", {
                        **a.to_dict(), "halted_at": a.step, "resume_step": best[1], "best_accuracy": best[0],
                        "best": "best" if best[1] else None})
                print(f"mechdiag: halting at step {a.step} on {a.alert} (record.halt_on); best held-out accuracy "
                      f"at step {(self.best or (None, 0))[1]}", file=sys.stderr, flush=True)

    def _call_hook(self, rec, alert) -> None:
        body = json.dumps({**alert.to_dict(), "run": str(rec.run.path)})
        try:
            if self.hook.startswith(("http://", "https://")):
                req = urllib.request.Request(self.hook, body.encode(), {"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=self.HOOK_TIMEOUT_S).close()
            else:
                subprocess.run(["/bin/sh", "-c", self.hook], input=body, text=True, timeout=self.HOOK_TIMEOUT_S,
                               check=True, env={**os.environ, "MECHDIAG_ALERT": alert.alert,
                                                "MECHDIAG_ALERT_STEP": str(alert.step)})
        except (OSError, subprocess.SubprocessError) as e:  # a failing hook is reported, never stops training
            print(f"mechdiag: alert hook failed on {alert.alert}: {e}", file=sys.stderr, flush=True)

    def on_train(self, rec, step, record):
        self._alerts(rec)

    def on_weights(self, rec, step, model, last):
        self._alerts(rec)

    def on_eval(self, rec, step, record, ctx):
        self._alerts(rec)
        acc = record.get("accuracy")
        if not isinstance(acc, (int, float)) or (self.best is not None and acc <= self.best[0]):
            return
        self.best = (float(acc), step)
        if step and rec.writer and self.halt_on and ctx.get("model") is not None:
            rec.run.write_folder(rec.run.path / "best", ctx["model"].save_pretrained)
            atomic.write_json(rec.run.path / "best" / "best.json", {"step": step, "accuracy": float(acc)})

    def on_end(self, rec, step, ctx):
        self._alerts(rec)


def user_signal(spec: str) -> Signal:
    """The Signal named by "package.module:Class" (called with no arguments); a UserError when it cannot be."""
    sig = load_object(spec, "signal", "Class")()
    if not isinstance(sig, Signal) or not sig.name or not sig.name.isidentifier():
        raise UserError(f"signal {spec!r}: must give a mechdiag.recorder.Signal with a name (an identifier)")
    return sig


def signals(cfg, evaluate: Signal | None = None, lora: bool = True, forget=None, shift_prompts=None,
            shift_batch_size: int = 64, extra: list | None = None, writer: bool = True) -> list[Signal]:
    """The signal set of a config, in the order they run; the same for both trainers, their differences options:
    `evaluate` the held-out evaluation (HeldOut, or a user's), `forget` the forget probe, `shift_prompts` the
    activation-shift prompts (None: off), `extra` signals passed in code; alerts
    (and Halt, for record.halt_on / alert_hook) run on the writer only."""
    rec = cfg.record
    out: list[Signal] = [TrainMetrics(), Samples(rec.samples_every)]
    if lora:
        out.append(Displacement(rec.displacement_every, rec.final_geometry))
    out += [s for s in (evaluate, forget and Forget(forget)) if s is not None] + [EvalRecords()]
    if lora and shift_prompts:
        out.append(Shift(shift_prompts, min(len(shift_prompts), shift_batch_size)))
    out += [user_signal(s) for s in rec.signals] + list(extra or [])
    alerts = [Alerts(cfg), *([Halt(cfg)] if rec.halt_on or rec.alert_hook else [])] if writer else []
    return out + alerts + [Summary(cfg)]
