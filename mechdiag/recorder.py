"""The one recorder both trainers drive (train.hooks.Recording for the native trainer, MechdiagCallback for TRL).

A `Recorder` holds the run directory and a list of signals, and turns five events into records:

    start()                                   after setup (a resumed run's records already on disk)
    train(step, metrics, rollout)             a step's metrics (rollout: a native Rollout or ready sample rows)
    weights(step, model, last)                the policy after a step's updates (model: the PEFT model or None)
    eval(step, model, tokenizer, ...)         a held-out evaluation; returns the eval record
    end(step, model, tokenizer)               once, after the last step

Each `Signal` has one job. Its `on_*` methods COMPUTE (they may run on every rank: a collective belongs there)
and return the records of its stream, or add keys to the eval record; `write` runs on the writer rank only.
A user's signal is a Signal subclass named in the config (record.signals, "package.module:Class") or passed to
MechdiagCallback(signals=[...]); its records go to the run directory's stream of its `name` (signals/NAME.jsonl).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import urllib.request

from mechdiag import atomic, tasks
from mechdiag.alerts import CRITICAL, NAMES, Watcher
from mechdiag.displacement import lora_rows
from mechdiag.distributed import inference_mode
from mechdiag.errors import UserError
from mechdiag.generate import generate, greedy, step_seed
from mechdiag.metrics import max_reward, pass_at_k
from mechdiag.probes.shift import shift_inmemory
from mechdiag.run import RunDir


class Signal:
    """One signal. `stream`: the run-directory stream its records go to (a user signal: its `name`)."""

    stream: str | None = None
    name: str | None = None

    def on_start(self, rec: Recorder) -> None: ...
    def on_train(self, rec: Recorder, step: int, metrics: dict, rollout) -> list | None: ...
    def on_weights(self, rec: Recorder, step: int, model, last: bool) -> list | None: ...
    def on_eval(self, rec: Recorder, step: int, record: dict, ctx: dict) -> list | None: ...
    def on_end(self, rec: Recorder, step: int, ctx: dict) -> list | None: ...

    def write(self, run: RunDir, records: list) -> None:
        """Writer rank only."""
        run.append(self.stream or self.name, records)


class Recorder:
    def __init__(self, run: RunDir | None, signals: list[Signal], writer: bool = True, engine=None):
        # engine: a mechdiag.distributed.Engine when every rank computes (a sharded model); run None off the writer
        self.run, self.signals, self.writer, self.engine = run, list(signals), writer, engine
        for s in self.signals:
            if writer and s.stream is None and s.name:
                run.register(s.name)
        self.latest: dict[str, list] = {}  # this event's records per stream, for signals that read others'

    def _emit(self, event: str, *args) -> None:
        self.latest = {}
        for s in self.signals:
            out = getattr(s, event)(self, *args)
            if out:
                self.latest[s.stream or s.name] = out
                if self.writer:
                    s.write(self.run, out)

    def start(self) -> None:
        for s in self.signals:
            s.on_start(self)

    def train(self, step: int, metrics: dict, rollout=None) -> None:
        self._emit("on_train", step, metrics, rollout)

    def weights(self, step: int, model, last: bool = False) -> None:
        self._emit("on_weights", step, model, last)

    def eval(self, step: int, model, tokenizer, metrics: dict | None = None, sampler=None, ref_model=None) -> dict:
        record = {"step": step, **(metrics or {})}
        self._emit("on_eval", step, record, {"model": model, "tokenizer": tokenizer, "sampler": sampler or model,
                                             "ref_model": ref_model})
        return record

    def end(self, step: int, model, tokenizer) -> None:
        self._emit("on_end", step, {"model": model, "tokenizer": tokenizer})

    def find(self, kind: type):
        return next((s for s in self.signals if isinstance(s, kind)), None)

    @property
    def stop(self):
        """The alert that halts the run (record.halt_on), or None: trainers check it once per step."""
        halt = self.find(Halt)
        return None if halt is None else halt.stop


# ---- the built-in signals ------------------------------------------------------------------------------------
class TrainMetrics(Signal):
    """metrics.jsonl: one record per step."""

    stream = "metrics"

    def on_train(self, rec, step, metrics, rollout):
        return [{"step": step, **metrics}]


class Samples(Signal):
    """samples.jsonl: the rollout's completions every `every` steps, with group ids (native: from the Rollout;
    TRL: the rows of its completions parquet, given ready)."""

    stream = "samples"

    def __init__(self, every: int):
        self.every = every

    def on_train(self, rec, step, metrics, rollout):
        if isinstance(rollout, list):
            return rollout
        if rollout is not None and self.every and step % self.every == 0:
            return sample_records(step, rollout)
        return None


def sample_records(step: int, r) -> list[dict]:
    comps = {k: v.tolist() for k, v in r.components.items()}
    rewards, adv, trunc = r.rewards.tolist(), r.advantages.tolist(), r.truncated.tolist()
    lengths = r.completion_mask.sum(-1).tolist()
    return [{"step": step, "split": "train", "group": r.group_ids[i], "example_id": r.example_ids[i],
             "prompt": r.prompts[i], "completion": r.texts[i], "reward": rewards[i], "advantage": adv[i],
             "truncated": trunc[i], "length": lengths[i], **{f"reward/{k}": v[i] for k, v in comps.items()}}
            for i in range(len(r.texts))]


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
    def from_config(cls, cfg, tokenizer) -> HeldOut:
        task = tasks.get_task(cfg.task.name, cfg.task.path, **cfg.task.options)
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

    def on_eval(self, rec, step, record, ctx):
        self.records.append(record)
        return [record]


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

    def on_train(self, rec, step, metrics, rollout):
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

    def on_train(self, rec, step, metrics, rollout):
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
    if ":" not in spec:
        raise UserError(f"signal {spec!r}: use the form package.module:Class")
    mod_name, attr = spec.split(":", 1)
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except ImportError as e:
        raise UserError(f"signal {spec!r}: cannot import {mod_name} ({e})") from None
    except AttributeError:
        raise UserError(f"signal {spec!r}: {mod_name} has no attribute {attr}") from None
    sig = factory()
    if not isinstance(sig, Signal) or not sig.name or not sig.name.isidentifier():
        raise UserError(f"signal {spec!r}: must give a mechdiag.recorder.Signal with a name (an identifier)")
    return sig


def signals(cfg, tokenizer, heldout: HeldOut | None, lora: bool, forget=None, shift_prompts=None,
            shift_batch_size: int = 64, extra: list | None = None) -> list[Signal]:
    """The signal set of a config, in the order they run; the same for both trainers."""
    rec = cfg.record
    out: list[Signal] = [TrainMetrics(), Samples(rec.samples_every)]
    if lora:
        out.append(Displacement(rec.displacement_every, rec.final_geometry))
    if heldout is not None:
        out.append(heldout)
    if forget is not None:
        out.append(Forget(forget))
    out.append(EvalRecords())
    if rec.shift_at_eval and lora and shift_prompts:
        out.append(Shift(shift_prompts[:rec.shift_n], min(len(shift_prompts[:rec.shift_n]), shift_batch_size)))
    out += [user_signal(s) for s in rec.signals] + list(extra or [])
    out.append(Alerts(cfg))
    if rec.halt_on or rec.alert_hook:
        out.append(Halt(cfg))
    return out
