"""Plotly figures of a report, one function per figure; each returns None when its runs hold no data.

Numbers are rounded to 4 significant digits and long series binned to at most MAX_POINTS points, so a long
run's page stays small. No model-written text ever goes into a figure (plotly renders pseudo-HTML).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mechdiag.config import ALL_MODULES
from mechdiag.metrics import (
    EVAL_SIGNALS,
    TRAIN_SIGNALS,
    group_norms,
    last_step,
    mean_std,
    series,
    update_mass,
    wdisp,
)
from mechdiag.run import STREAMS, Group

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22"]
MAX_POINTS = 400
MAX_SLIDER_STEPS = 40



@dataclass
class Coloured(Group):
    """A group as the report draws it: one colour for its runs (seeds as mean and band)."""

    color: str = PALETTE[0]


def coloured(groups: list[Group]) -> list[Coloured]:
    return [Coloured(g.label, g.runs, PALETTE[i % len(PALETTE)]) for i, g in enumerate(groups)]


_FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=12, color="#222")
_AXIS = dict(gridcolor="#eee", zerolinecolor="#ccc", linecolor="#999", showline=True, ticks="outside")


def _r(v):
    """Round to 4 significant digits; non-finite -> None (a gap)."""
    if v is None:
        return None
    v = float(v)
    if not math.isfinite(v):
        return None
    return float(f"{v:.4g}")


def _num(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _safe(text: str) -> str:
    """Labels shown by plotly: drop the characters of its pseudo-HTML."""
    return str(text).replace("<", "").replace(">", "").replace("&", "+")


def _layout(fig: go.Figure, height: int, **kw) -> go.Figure:
    top = 95
    fig.update_layout(template="none", height=height, font=_FONT, paper_bgcolor="white", plot_bgcolor="white",
                      margin=dict(l=60, r=20, t=top, b=45), hovermode="closest",
                      legend=dict(orientation="h", yanchor="bottom", y=1 + 40 / (height - top - 45), x=0), **kw)
    fig.update_xaxes(**_AXIS)
    fig.update_yaxes(**_AXIS)
    return fig


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def seed_band(series: list[dict[float, float]]) -> tuple[list, list, list, list]:
    """Mean and mean +- std over seeds at each step (std 0 where one seed), binned to MAX_POINTS."""
    by_step: dict[float, list[float]] = defaultdict(list)
    for s in series:
        for step, v in s.items():
            by_step[step].append(v)
    steps = sorted(by_step)
    mean, std = [], []
    for st in steps:
        m, sd = mean_std(by_step[st])
        mean.append(m)
        std.append(sd or 0.0)
    if len(steps) > MAX_POINTS:  # bin-average consecutive steps
        n, k = len(steps), MAX_POINTS
        bins = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        steps = [sum(steps[a:b]) / (b - a) for a, b in bins]
        mean = [sum(mean[a:b]) / (b - a) for a, b in bins]
        std = [sum(std[a:b]) / (b - a) for a, b in bins]
    lo = [m - s for m, s in zip(mean, std, strict=True)]
    hi = [m + s for m, s in zip(mean, std, strict=True)]
    return [_r(x) for x in steps], [_r(x) for x in mean], [_r(x) for x in lo], [_r(x) for x in hi]


def _series(records: list[dict], key: str) -> dict[int, float]:
    return dict(series(records, key))


def _small_multiples(groups: list[Group], panels: list[tuple[str, str, str]], cols: int,
                     height_per_row: int) -> go.Figure:
    """One panel per (stream, key, title): runs as colours, seeds as mean line and +-1 std band."""
    rows = max(1, math.ceil(len(panels) / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[t for _, _, t in panels], horizontal_spacing=0.07,
                        vertical_spacing=min(0.16, 0.32 / rows))
    in_legend: set[int] = set()
    for i, (stream, key, _) in enumerate(panels):
        row, col = i // cols + 1, i % cols + 1
        drawn = False
        for gi, g in enumerate(groups):
            series = [s for s in (_series(r.read(stream), key) for r in g.runs) if s]
            if not series:
                continue
            drawn = True
            x, mean, lo, hi = seed_band(series)
            name = _safe(g.label)
            if len(series) > 1:
                fig.add_trace(go.Scatter(x=x + x[::-1], y=hi + lo[::-1], fill="toself", mode="lines",
                                         line=dict(width=0), fillcolor=_rgba(g.color, 0.2), hoverinfo="skip",
                                         showlegend=False, legendgroup=f"g{gi}"), row=row, col=col)
            fig.add_trace(go.Scatter(x=x, y=mean, mode="lines+markers" if len(x) < 30 else "lines",
                                     line=dict(color=g.color, width=1.6), marker=dict(size=4),
                                     name=f"{name} (n={len(series)} seed{'s' * (len(series) > 1)})",
                                     legendgroup=f"g{gi}", showlegend=gi not in in_legend,
                                     hovertemplate=f"{name}<br>step %{{x}}<br>%{{y:.4g}}<extra></extra>"),
                          row=row, col=col)
            in_legend.add(gi)
        if not drawn:
            # row/col: plotly picks this panel's axes (hand-built "x{i+1}" names drift from the grid's)
            fig.add_annotation(text="not recorded", showarrow=False, font=dict(color="#999"),
                               xref="x domain", yref="y domain", x=0.5, y=0.5, row=row, col=col)
    fig.update_xaxes(title_text="step", row=rows)
    return _layout(fig, 140 + height_per_row * rows)


def training_dynamics(groups: list[Group]) -> go.Figure | None:
    """The study's eight signals as small multiples (2 x 4, its Figure 1)."""
    if not any(r.has("metrics") or r.has("eval") for g in groups for r in g.runs):
        return None
    panels = [("metrics", k, t) for k, t in TRAIN_SIGNALS] + [("eval", k, t) for k, t in EVAL_SIGNALS]
    return _small_multiples(groups, panels, cols=4, height_per_row=210)


OTHER_TRAIN = [("frac_zero_std", "groups with zero reward std"), ("entropy", "train entropy"),
               ("completion_length", "train completion length"), ("reward_std", "reward std"),
               ("policy_clip_fraction", "policy clip fraction"), ("grad_norm", "grad norm"), ("loss", "loss"),
               ("lr", "learning rate"), ("tokens_per_s", "tokens / s"),
               ("frac_groups_all_correct", "groups all correct"), ("frac_groups_all_wrong", "groups all wrong"),
               ("frac_groups_shaping_only", "groups shaping only"),
               ("completion_length_max", "longest completion"), ("completion_length_min", "shortest completion"),
               ("terminated_length", "length of completions that ended"),
               ("filter_too_bad_ratio", "filtered: groups all wrong"),
               ("filter_too_good_ratio", "filtered: groups all correct"), ("kl_coef", "KL coefficient")]
OTHER_EVAL = [("forget_kl", "forget KL to base (off-task)")]


def other_signals(groups: list[Group]) -> go.Figure | None:
    """Every other recorded signal: reward components first, then the canonical extras that exist (forget_kl
    from eval.jsonl last)."""
    keys: dict[str, None] = {}
    for g in groups:
        for r in g.runs:
            for rec in r.read("metrics")[:50]:
                keys.update((k, None) for k in rec)
    comps = [(k, f"reward: {_safe(k.split('/', 1)[1])}") for k in keys if k.startswith("reward/")][:8]
    comps += [(k, f"reward std: {_safe(k.split('/', 1)[1])}") for k in keys if k.startswith("reward_std/")][:4]
    panels = [("metrics", k, t) for k, t in comps + [kt for kt in OTHER_TRAIN if kt[0] in keys]]
    evals = [("eval", k, t) for k, t in OTHER_EVAL if any(_series(r.read("eval"), k) for g in groups for r in g.runs)]
    panels = [p for p in panels if any(_series(r.read("metrics"), p[1]) for g in groups for r in g.runs)]
    panels = panels[:24 - len(evals)] + evals
    if not panels:
        return None
    fig = _small_multiples(groups, panels, cols=4, height_per_row=190)
    keys = [k for _, k, _ in panels]
    if "policy_clip_fraction" in keys and clip_is_zero_by_construction(groups):
        i = keys.index("policy_clip_fraction")
        fig.add_annotation(text="0 by construction: num_iterations = 1, so the<br>ratio is exactly 1 and "
                                "nothing is clipped", showarrow=False, font=dict(color="#666", size=10),
                           xref="x domain", yref="y domain", x=0.5, y=0.8, row=i // 4 + 1, col=i % 4 + 1)
    return fig


def user_signals(groups: list[Group]) -> list[tuple[str, go.Figure]]:
    """Per user signal (a stream outside the built-in ones, signals/NAME.jsonl): its numeric keys over steps."""
    out = []
    for name in sorted({n for g in groups for r in g.runs for n in r.streams if n not in STREAMS}):
        keys = dict.fromkeys(k for g in groups for r in g.runs for rec in r.read(name) for k in rec if k != "step")
        panels = [(name, k, _safe(k)) for k in keys if any(_series(r.read(name), k) for g in groups for r in g.runs)]
        if panels:
            out.append((name, _small_multiples(groups, panels[:16], cols=4, height_per_row=190)))
    return out


def clip_is_zero_by_construction(groups: list[Group]) -> bool:
    """Every run updates once per rollout (num_iterations = 1) and recorded a clip fraction of exactly 0."""
    runs = [r for g in groups for r in g.runs]
    values = [v for r in runs for v in _series(r.read("metrics"), "policy_clip_fraction").values()]
    iters = [(r.config or {}).get("num_iterations", 1) for r in runs]
    return bool(values) and all(v == 0 for v in values) and all(n == 1 for n in iters)


def _module_order(modules) -> list[str]:
    known = [m for m in ALL_MODULES if m in modules]
    return known + sorted(m for m in modules if m not in ALL_MODULES)


def _pooled(run, key, parts: bool = False) -> dict:
    """key -> WDisp (metrics.wdisp) of the run's displacement rows with that key that carry both norms (parts: a
    fused tensor's parts too, for per-module cells)."""
    rows = [r for r in run.read("displacement") if _num(r.get("ref_fro")) is not None]
    return {k: wdisp(d, ref) for k, (d, ref) in group_norms(rows, key, parts).items() if ref > 0}


def _cell(rec) -> tuple | None:
    step, layer, module = _num(rec.get("step")), _num(rec.get("layer")), rec.get("module")
    return None if step is None or layer is None or module is None else (step, int(layer), str(module))


def _layer(rec) -> tuple | None:
    step, layer = _num(rec.get("step")), _num(rec.get("layer"))
    return None if step is None or layer is None else (step, int(layer))


def _seed_mean(per_run: list[dict]) -> dict:
    """step -> rest of the key -> mean over the runs that have it."""
    acc: dict = defaultdict(lambda: defaultdict(list))
    for values in per_run:
        for (step, *rest), v in values.items():
            acc[step][rest[0] if len(rest) == 1 else tuple(rest)].append(v)
    return {s: {k: sum(v) / len(v) for k, v in d.items()} for s, d in acc.items()}


def _disp_cells(group: Group) -> dict[float, dict[tuple[int, str], float]]:
    """step -> (layer, module) -> relative displacement, averaged over the group's seeds. A cell holding several
    tensors (weight and bias) pools them (metrics.wdisp); rel_fro alone is a fallback."""
    per_run = []
    for run in group.runs:
        cells, rel = _pooled(run, _cell, parts=True), defaultdict(list)
        for rec in run.read("displacement"):
            k = _cell(rec)
            if k is not None and k not in cells and _num(rec.get("rel_fro")) is not None and \
                    None in (_num(rec.get("ref_fro")), _num(rec.get("delta_fro"))):
                rel[k].append(_num(rec["rel_fro"]))
        per_run.append({**cells, **{k: sum(v) / len(v) for k, v in rel.items()}})
    return _seed_mean(per_run)


def _thin(steps: list, k: int) -> list:
    """At most k of the sorted steps, evenly spread, always keeping the first and the last."""
    if len(steps) <= k:
        return steps
    return [steps[i] for i in sorted({round(i * (len(steps) - 1) / (k - 1)) for i in range(k)})]


def _layer_by_step(group: Group) -> dict[float, dict[int, float]]:
    """step -> layer -> pooled displacement (metrics.wdisp) of the layer's tensors, averaged over the seeds (a fused
    tensor's parts left out: its whole tensor is counted already)."""
    return _seed_mean([_pooled(run, _layer) for run in group.runs])


def _cell_heatmap(z, modules, layers, name: str, fmt: str, zmax=None, x: float = 1.0) -> go.Heatmap:
    """One layers x modules heatmap trace (the report's weight cells), colour bar at x."""
    return go.Heatmap(z=z, x=modules, y=layers, colorscale="Viridis", zmin=0, zmax=zmax,
                      colorbar=dict(title=dict(text=name, side="right"), thickness=10, x=x, len=0.9),
                      hovertemplate=f"layer %{{y}} %{{x}}<br>{name} = %{{z:{fmt}}}<extra></extra>",
                      xgap=1, ygap=1)


def weight_heatmap(group: Group) -> go.Figure | None:
    """Left: ||dW||_F / ||W||_F, layers x modules, with a slider over the recorded steps.
    Right: each layer's pooled displacement over all recorded steps (how it grew)."""
    cells = _disp_cells(group)
    if not cells:
        return None
    steps = _thin(sorted(cells), MAX_SLIDER_STEPS)
    layers = sorted({lay for s in steps for lay, _ in cells[s]})
    modules = _module_order({m for s in steps for _, m in cells[s]})
    zmax = max(v for s in steps for v in cells[s].values()) or 1.0

    def z(step):
        return [[_r(cells[step].get((lay, m))) for m in modules] for lay in layers]

    growth = _layer_by_step(group)
    gsteps = _thin(sorted(growth), 2 * MAX_SLIDER_STEPS)
    two = len(gsteps) > 1
    fig = make_subplots(rows=1, cols=2 if two else 1, column_widths=[0.55, 0.45] if two else None,
                        horizontal_spacing=0.14, subplot_titles=None)
    last = steps[-1]
    fig.add_trace(_cell_heatmap(z(last), modules, layers, "||dW||/||W||", ".3g", zmax=_r(zmax),
                                x=0.5 if two else 1.0), row=1, col=1)
    if two:
        gz = [[_r(growth[s].get(lay)) for s in gsteps] for lay in layers]
        fig.add_trace(go.Heatmap(z=gz, x=[_r(s) for s in gsteps], y=layers, colorscale="Viridis", zmin=0,
                                 colorbar=dict(title=dict(text="layer WDisp", side="right"), thickness=10, len=0.9),
                                 hovertemplate="layer %{y} step %{x}<br>WDisp = %{z:.3g}<extra></extra>",
                                 ygap=1), row=1, col=2)
        fig.update_xaxes(title_text="step", row=1, col=2)
        fig.update_yaxes(autorange="reversed", row=1, col=2, **LAYER_TICKS)
    label = _safe(group.label)
    title = f"{label}: weight displacement at step {{}}" + (" (left) and per layer over steps (right)" if two else "")
    if len(steps) > 1:
        fig.update_layout(sliders=[dict(
            active=len(steps) - 1, currentvalue=dict(prefix="step "), pad=dict(t=40), len=0.5 if two else 1.0,
            steps=[dict(label=f"{s:g}", method="update",
                        args=[{"z": [z(s)]}, {"title.text": title.format(f"{s:g}")}, [0]]) for s in steps])])
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=1, **LAYER_TICKS)
    fig.update_xaxes(title_text="module", showgrid=False, row=1, col=1)
    return _layout(fig, max(320, 60 + 18 * len(layers)) + (90 if len(steps) > 1 else 0),
                   title=dict(text=title.format(f"{last:g}"), x=0, font=dict(size=13)))


GEOMETRY_KEYS = ("subspace_overlap", "intruders")


def _geometry_cells(group: Group) -> tuple[dict[str, dict[tuple[int, str], float]], list[int], float | None]:
    """key -> (layer, module) -> subspace_overlap / intruders at each run's last step whose rows carry them
    (the trainers compute them at the final step), averaged over seeds; the overlap k values; that step."""
    acc: dict[str, dict[tuple[int, str], list[float]]] = {k: defaultdict(list) for k in GEOMETRY_KEYS}
    ks, steps = set(), []
    for run in group.runs:
        rows = [r for r in run.read("displacement") if _num(r.get("subspace_overlap")) is not None
                and _num(r.get("step")) is not None and _num(r.get("layer")) is not None]
        if not rows:
            continue
        step = max(_num(r["step"]) for r in rows)
        steps.append(step)
        for r in (r for r in rows if _num(r["step"]) == step):
            for key in GEOMETRY_KEYS:
                if _num(r.get(key)) is not None:
                    acc[key][(int(_num(r["layer"])), str(r.get("module")))].append(_num(r[key]))
            if _num(r.get("overlap_k")) is not None:
                ks.add(int(_num(r["overlap_k"])))
    cells = {k: {c: sum(v) / len(v) for c, v in d.items()} for k, d in acc.items()}
    return cells, sorted(ks), (max(steps) if steps else None)


def geometry_heatmap(group: Group) -> tuple[go.Figure, list[int]] | None:
    """subspace_overlap (left) and intruders (right), layers x modules, from the rows that carry them; with the
    overlap k values. None when no row does."""
    cells, ks, step = _geometry_cells(group)
    if not cells["subspace_overlap"]:
        return None
    keys = set(cells["subspace_overlap"]) | set(cells["intruders"])
    layers = sorted({lay for lay, _ in keys})
    modules = _module_order({m for _, m in keys})
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.16, subplot_titles=list(GEOMETRY_KEYS))
    for col, (key, fmt, zmax, x) in enumerate((("subspace_overlap", ".3g", 1.0, 0.42),
                                               ("intruders", ".2g", None, 1.0)), start=1):
        z = [[_r(cells[key].get((lay, m))) for m in modules] for lay in layers]
        fig.add_trace(_cell_heatmap(z, modules, layers, key, fmt, zmax=zmax, x=x), row=1, col=col)
        fig.update_yaxes(title_text="layer" if col == 1 else None, autorange="reversed", row=1, col=col,
                         **LAYER_TICKS)
        fig.update_xaxes(title_text="module", showgrid=False, row=1, col=col)
    title = f"{_safe(group.label)}: update geometry at step {step:g}"
    return _layout(fig, max(320, 60 + 18 * len(layers)), title=dict(text=title, x=0, font=dict(size=13))), ks


def _wdisp_by_step(run) -> dict[float, float]:
    """metrics.wdisp over all recorded tensors, per step."""
    return _pooled(run, lambda rec: _num(rec.get("step")))


def _module_mass(run) -> dict[str, float]:
    """Update mass per module type at the last recorded step (mechdiag.metrics.update_mass)."""
    return update_mass(last_step(run.read("displacement")), "module", parts=True)


def displacement_dynamics(groups: list[Group]) -> go.Figure | None:
    """Left: total WDisp over steps (seeds as band). Right: module-wise update mass at the last step."""
    have = [g for g in groups if any(r.has("displacement") for r in g.runs)]
    if not have:
        return None
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.1,
                        subplot_titles=["total weight displacement WDisp", "module-wise update mass (last step)"])
    modules = _module_order({m for g in have for r in g.runs for m in _module_mass(r)})
    for g in have:
        name = _safe(g.label)
        series = [s for s in (_wdisp_by_step(r) for r in g.runs) if s]
        if series:
            x, mean, lo, hi = seed_band(series)
            if len(series) > 1:
                fig.add_trace(go.Scatter(x=x + x[::-1], y=hi + lo[::-1], fill="toself", mode="lines",
                                         line=dict(width=0), fillcolor=_rgba(g.color, 0.2), hoverinfo="skip",
                                         showlegend=False), row=1, col=1)
            fig.add_trace(go.Scatter(x=x, y=mean, mode="lines+markers", line=dict(color=g.color), name=name,
                                     legendgroup=name, marker=dict(size=4),
                                     hovertemplate=f"{name}<br>step %{{x}}<br>WDisp %{{y:.4g}}<extra></extra>"),
                          row=1, col=1)
        masses = [_module_mass(r) for r in g.runs]
        masses = [m for m in masses if m]
        if masses:
            share = [_r(sum(m.get(mod, 0.0) for m in masses) / len(masses)) for mod in modules]
            fig.add_trace(go.Bar(x=modules, y=share, marker_color=g.color, name=name, legendgroup=name,
                                 showlegend=not series,
                                 hovertemplate=f"{name}<br>%{{x}}: %{{y:.1%}}<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return _layout(fig, 360, barmode="group")


# Layers are whole numbers: ticks only on integers (plotly's auto ticks put 0.5s on a 2-5 layer axis).
LAYER_TICKS = dict(tick0=0, dtick=1, tickformat="d")

SHIFT_PANELS = [("shift", "activation shift (relative L2)"), ("increment", "block increment shift"),
                ("logit_kl", "logit-lens KL"), ("cos_dist", "cosine distance")]


def activation_shift(groups: list[Group]) -> go.Figure | None:
    """Shift per layer at each run's last shift step, with its bootstrap interval; one line per seed."""
    runs = [(g, r) for g in groups for r in g.runs if r.has("shift")]
    if not runs:
        return None
    last_rows = {}
    for _, r in runs:
        rows = [x for x in r.read("shift") if _num(x.get("layer")) is not None]
        steps = [_num(x.get("step")) for x in rows if _num(x.get("step")) is not None]
        last = max(steps) if steps else None
        last_rows[id(r)] = sorted((x for x in rows if _num(x.get("step")) == last),
                                  key=lambda x: float(x["layer"])), last
    keys = [(k, t) for k, t in SHIFT_PANELS
            if any(_num(x.get(k)) is not None for rows, _ in last_rows.values() for x in rows)][:3]
    if not keys:
        return None
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=[t for _, t in keys], horizontal_spacing=0.08)
    dashes = ["solid", "dash", "dot", "dashdot"]
    for col, (key, _) in enumerate(keys, start=1):
        seen = set()
        for g, r in runs:
            rows, last = last_rows[id(r)]
            pts = [(float(x["layer"]), _num(x.get(key)), x) for x in rows if _num(x.get(key)) is not None]
            if not pts:
                continue
            k = g.runs.index(r)
            name = _safe(f"{g.label} seed {r.seed}" if r.seed is not None else f"{g.label} {r.name}")
            err = None
            if key == "shift" and all(_num(x.get("ci_low")) is not None and _num(x.get("ci_high")) is not None
                                      for _, _, x in pts):
                err = dict(type="data", symmetric=False, thickness=1, width=3, color=g.color,
                           array=[_r(max(0.0, _num(x["ci_high"]) - v)) for _, v, x in pts],
                           arrayminus=[_r(max(0.0, v - _num(x["ci_low"]))) for _, v, x in pts])
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[_r(p[1]) for p in pts], error_y=err,
                                     mode="lines+markers", line=dict(color=g.color, dash=dashes[k % 4], width=1.5),
                                     marker=dict(size=5), name=name, legendgroup=name,
                                     showlegend=col == 1 and name not in seen,
                                     hovertemplate=f"{name}<br>step {last:g}<br>layer %{{x}}: "
                                                   "%{y:.4g}<extra></extra>"),
                          row=1, col=col)
            seen.add(name)
        fig.update_xaxes(title_text="layer", row=1, col=col, **LAYER_TICKS)
    return _layout(fig, 380)
