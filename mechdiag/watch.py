"""`mechdiag watch RUN`: a live terminal view of a run while it is written (native, `--backend trl`, a TRL
output_dir holding MechdiagCallback's mechdiag/ folder, or any run the readers take: a TRL/Unsloth output_dir,
a verl log, an OpenRLHF/custom metrics log, re-read at each refresh): the eight signals' latest values with
sparklines, the group outcomes and forget_kl where recorded, and the alerts of mechdiag.alerts."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from mechdiag import alerts as A
from mechdiag import config as C
from mechdiag.integrations.readers import locate, read_any_run
from mechdiag.metrics import EVAL_SIGNALS, TRAIN_SIGNALS, max_reward, series
from mechdiag.run import RunDir, callback_run, resolve_run
from mechdiag.tasks import reward_weights

SPARK = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 30
FLAT = 1e-8
EXTRA = [("metrics", "frac_zero_std", "groups with zero std"), ("metrics", "frac_groups_all_correct", "  all correct"),
         ("metrics", "frac_groups_all_wrong", "  all wrong"),
         ("metrics", "frac_groups_shaping_only", "groups shaping only"), ("eval", "forget_kl", "forget KL to base")]


@dataclass
class State:
    metrics: list[dict]
    evals: list[dict]
    alerts: list[A.Alert]
    finished: bool
    user: dict[str, list[dict]] = field(default_factory=dict)  # user signals' streams (signals/NAME.jsonl)


def read_state(run: RunDir) -> State:
    ceiling = max_reward(reward_weights(C.load(run.config_path))) if run.config_path.exists() else 1.0
    metrics, evals, disp = run.read("metrics"), run.read("eval"), run.read("displacement")
    return State(metrics, evals, A.check(metrics, evals, disp, ceiling), run.summary_path.exists(),
                 {name: run.read(name) for name in run.user_streams()})


def read_foreign_state(path) -> State:
    """Another trainer's run, read anew: its own maximum reward; finished when its log holds its last step."""
    run = read_any_run(path)
    own = (run.provenance or {}).get("max_reward") or {}
    ceiling = own.get("value") or 1.0
    steps = [m["step"] for m in run.metrics if isinstance(m.get("step"), int)]
    planned = (run.provenance or {}).get("keys", {}).get("max_steps", {}).get("value")
    finished = bool(planned and steps and max(steps) >= planned)
    return State(run.metrics, run.eval, A.check(run.metrics, run.eval, run.displacement, ceiling), finished)


def sparkline(values: list[float], width: int = SPARK_POINTS) -> str:
    """The whole run in at most `width` characters (each the mean of its share of the points), not its last
    `width` points: a rise from 0.14 to 0.87 that then holds must not draw as flat noise."""
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) > width:
        cuts = [round(i * len(vals) / width) for i in range(width + 1)]
        vals = [math.fsum(vals[a:b]) / (b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo <= FLAT * max(1.0, abs(hi)):  # float noise around a constant (a KL of +-1e-9) draws flat
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / (hi - lo) * len(SPARK)))] for v in vals)


def rows(state: State) -> list[tuple[str, str, str, str]]:
    """(signal, latest value, its step, sparkline) for the eight signals, then the extras that were recorded."""
    panels = [("metrics", k, t) for k, t in TRAIN_SIGNALS] + [("eval", k, t) for k, t in EVAL_SIGNALS]
    out = []
    for i, (stream, key, title) in enumerate(panels + EXTRA):
        pts = series(state.metrics if stream == "metrics" else state.evals, key)
        if i >= len(panels) and not pts:
            continue
        latest = f"{pts[-1][1]:.4g}" if pts else "-"
        out.append((title, latest, str(pts[-1][0]) if pts else "-", sparkline([v for _, v in pts])))
    return out + user_rows(state)


def user_rows(state: State) -> list[tuple[str, str, str, str]]:
    """(NAME/key, latest value, its step, sparkline) for each numeric key of each user signal's stream."""
    out = []
    for name, recs in state.user.items():
        for key in dict.fromkeys(k for r in recs for k in r if k != "step"):
            if pts := series(recs, key):
                out.append((f"{name}/{key}", f"{pts[-1][1]:.4g}", str(pts[-1][0]), sparkline([v for _, v in pts])))
    return out


def render(run: RunDir, state: State):
    last = state.metrics[-1]["step"] if state.metrics else 0
    sig = Table(title=f"{run.path}  step {last}{'  (finished)' if state.finished else ''}", title_justify="left")
    for col in ("signal", "latest", "step", "trend"):
        sig.add_column(col, justify="right" if col in ("latest", "step") else "left")
    for r in rows(state):
        sig.add_row(*r)
    if not state.alerts:
        return Group(sig, "alerts: none")
    al = Table(title="alerts", title_justify="left")
    for col in ("alert", "step", "evidence"):
        al.add_column(col, overflow="fold")
    for a in state.alerts:
        al.add_row(f"[bold red]{a.alert}[/]", str(a.step), a.evidence)
    return Group(sig, al)


def watch(path, once: bool = False, fmt: str = "table", interval: float = 2.0, echo=print) -> State:
    """Show the run at `path` (once, or live until its summary.json appears); returns the last state."""
    if locate(path) is not None and callback_run(path) is None:
        label = SimpleNamespace(path=path)

        def reread() -> State:
            return read_foreign_state(path)
    else:
        label = resolve_run(path)

        def reread() -> State:
            return read_state(label)
    run = label
    state = reread()
    if fmt == "json":
        shown: set = set()
        while True:
            for a in state.alerts:
                if a.alert not in shown:
                    shown.add(a.alert)
                    echo(json.dumps(a.to_dict()))
            for title, latest, step, _ in user_rows(state):
                if (title, step) not in shown:  # a user signal's latest value, once per step
                    shown.add((title, step))
                    echo(json.dumps({"signal": title, "latest": float(latest), "step": int(step)}))
            if once or state.finished:
                return state
            time.sleep(interval)
            state = reread()
    console = Console()
    if once:
        console.print(render(run, state))
        return state
    with Live(render(run, state), console=console, refresh_per_second=4) as live:
        while not state.finished:
            time.sleep(interval)
            state = reread()
            live.update(render(run, state))
    return state
