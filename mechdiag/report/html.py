"""The report page: one self-contained HTML file (plotly.js inlined once, nothing fetched at view time).

Every string that comes from a run (completions, prompts, labels, config values, findings) goes through
`esc`; figures are JSON in <script type="application/json"> blocks with `<`, `>` and `&` escaped, drawn by
one nonce'd script. A Content-Security-Policy forbids any other script, inline handler or network fetch, so a
hostile completion is shown as text and can never run, and the page fails loudly instead of fetching.
The page writes its render state on <html>: data-figures (expected), data-rendered (drawn) and
data-report-status ("ok" once all figures are drawn, "error" on any script error).
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import re
import secrets
from collections import defaultdict
from dataclasses import dataclass, field

from mechdiag.atomic import clean_json
from mechdiag.config import to_yaml
from mechdiag.metrics import attribution_reference, causal_shares, change, mean_std, metric_order, rank_correlation
from mechdiag.report import figures as F
from mechdiag.run import Group, Run, base_eval, final_eval, varying_keys

MAX_COMPLETION_CHARS = 3000
MAX_PAIRS = 6
MAX_ROLLOUTS = 8


@dataclass
class Shown:
    """A finding as the page shows it, whatever the recommender's own class looks like."""

    rule: str
    symptom: str
    evidence: str
    change: str
    confidence: float | None
    reason: str = ""
    when: str = ""  # onset and cost so far (mechdiag.recommend.Finding.onset / .cost)


@dataclass
class Advice:
    findings: list[Shown] = field(default_factory=list)
    note: str = ""  # shown where there is no finding
    refined_yaml: str | None = None  # the refined config, when the recommender returns one
    refined_label: str = "refined config.yaml (train it with <code>mechdiag train refined.yaml</code>)"


def _shown(f) -> Shown:
    change = getattr(f, "change", None)
    if change is None:  # mechdiag.recommend: a list of Change(key, old, new)
        change = "; ".join(str(c) for c in getattr(f, "changes", None) or []) or "none (advice only)"
    ev = getattr(f, "evidence", "")
    return Shown(rule=str(getattr(f, "rule", "")), symptom=str(getattr(f, "symptom", "")),
                 evidence=ev if isinstance(ev, str) else json.dumps(ev, default=str, ensure_ascii=False),
                 change=str(change), confidence=getattr(f, "confidence", None), reason=str(getattr(f, "reason", "")),
                 when=_when(getattr(f, "onset", None), getattr(f, "cost", None) or {}))


def _when(onset, cost: dict) -> str:
    """"since step N; K steps; S% of groups zero-advantage (R rollouts)": a finding's onset and cost so far."""
    parts = [f"since step {onset}"] if onset is not None else []
    if "steps_since_onset" in cost and onset is not None:
        parts.append(f"{cost['steps_since_onset']} steps so far")
    if "zero_advantage_share" in cost:
        wasted = f", {cost['rollouts_wasted']} rollouts" if "rollouts_wasted" in cost else ""
        parts.append(f"{cost['zero_advantage_share']:.0%} of groups with zero advantage{wasted}")
    return "; ".join(parts)


def advice_from(result) -> Advice:
    """Findings (and the refined config) from what recommend returned: a Recommendation or a list of findings."""
    findings = getattr(result, "findings", result)
    advice = Advice([_shown(f) for f in findings or []], "No recommendation: no rule fired on these runs.")
    cfg = getattr(result, "cfg", None)
    prov = getattr(result, "provenance", None)
    if isinstance(prov, dict):  # a foreign run: only the settings that change, in its trainer's names
        fields = prov.get("fields") or {}
        lines = [f"{fields.get(c.key, c.key)}: {_show_value(c.old)} -> {_show_value(c.new)}"
                 for c in getattr(result, "changes", [])]
        advice.refined_yaml = "\n".join(lines) or None
        advice.refined_label = (f"refined settings, in {esc(prov.get('trainer', 'the trainer'))}'s own names "
                                "(<code>mechdiag recommend RUN --out refined.yaml</code> writes them beside it)")
    elif cfg is not None and hasattr(cfg, "model_dump"):
        advice.refined_yaml = to_yaml(cfg, getattr(result, "header", "") or "")
    return advice


def _show_value(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


_SURROGATE = re.compile("[\ud800-\udfff]")


def esc(value) -> str:
    """HTML-escape any value; lone surrogates (valid in JSON, not in UTF-8) become U+FFFD."""
    text = "" if value is None else str(value)
    text = _SURROGATE.sub("\ufffd", text)
    return html.escape(text, quote=True)


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return "–"
        if isinstance(v, int):
            return str(v)
        return f"{v:.{digits}g}"
    return esc(v)


def _delta_class(metric: str, delta: float | None, base) -> str:
    return {1: "up", -1: "down"}.get(change(metric, delta, base), "")


def _pm(mean, std) -> str:
    return _fmt(mean) if std is None else f"{_fmt(mean)} <span class=pm>± {_fmt(std, 2)}</span>"


def _missing(what: str, runs: list[Run] | None = None) -> str:
    who = f" ({', '.join(esc(r.name) for r in runs)})" if runs else ""
    return f"<p class=missing>{what}{who}.</p>"


def _lacking(groups: list[Group], stream: str) -> list[Run]:
    return [r for g in groups for r in g.runs if not r.has(stream)]


# ---- figures ------------------------------------------------------------------------------------------------
class _Figures:
    """Collect figures as JSON blocks; the page script draws every block into the div before it."""

    def __init__(self):
        self.n = 0

    def embed(self, fig) -> str:
        self.n += 1
        spec = fig.to_plotly_json()
        spec = clean_json({"data": spec.get("data", []), "layout": spec.get("layout", {})})  # NaN -> null
        text = json.dumps(spec, default=_json_default, allow_nan=False, separators=(",", ":"))
        text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        return (f'<div class=fig id="fig-{self.n}"></div>'
                f'<script type="application/json" class=fig-data data-target="fig-{self.n}">{text}</script>')


def _json_default(o):
    if hasattr(o, "tolist"):
        return clean_json(o.tolist())
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ---- sections -----------------------------------------------------------------------------------------------
def _config_cell(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return ",".join(map(str, node)) if isinstance(node, list) else node


RUN_COLUMNS = [("seed", "seed"), ("learning_rate", "lr"), ("beta", "β"), ("epsilon", "ε"),
               ("epsilon_high", "ε high"), ("group_size", "G"), ("temperature", "temp"), ("lora.r", "r"),
               ("lora.alpha", "α"), ("lora.target_modules", "modules"), ("lora.layers", "layers")]


def _held_cell(run: Run, key: str) -> str:
    """A config value as the run holds it: a foreign run's value only when read from it or inferred from its
    logs (marked, with the evidence on hover), else unknown; never mechdiag's placeholder."""
    prov = run.provenance
    if prov is None:
        return f"<td>{_fmt(_config_cell(run.config, key))}</td>"
    e = (prov.get("keys") or {}).get(key)
    if e is None:
        return "<td class=note title='not in the run'>?</td>"
    v = e.get("value")
    v = ",".join(map(str, v)) if isinstance(v, list) else v
    if e.get("how") == "inferred":
        mark = "≥" if e.get("bound") == ">=" else "≈"
        return f"<td title='{esc(e.get('evidence'))}'>{mark}{_fmt(v)}</td>"
    return f"<td title='read from {esc(e.get('evidence'))}'>{_fmt(v)}</td>"


def sandbox_of(run: Run) -> str:
    """The sandbox mode the run's model code ran under: summary.json's, else its eval records' ('–': unknown)."""
    if isinstance(run.summary.get("sandbox"), str):
        return run.summary["sandbox"]
    modes = dict.fromkeys(str(r["sandbox"]) for r in run.read("eval_benchmarks") if "sandbox" in r)
    return ", ".join(modes) or "–"


def section_runs(groups: list[Group]) -> str:
    runs = [r for g in groups for r in g.runs]
    differ = varying_keys(runs) if len(runs) > 1 else []
    columns = RUN_COLUMNS + [(k, k) for k in differ if k not in dict(RUN_COLUMNS)]
    head = "".join(f"<th{' class=diff' if k in differ else ''}>{esc(t)}</th>" for k, t in columns)
    rows = []
    for g in groups:
        for r in g.runs:
            steps = [x.get("step") for x in r.read("metrics") if isinstance(x.get("step"), (int, float))]
            cells = "".join(_held_cell(r, k) for k, _ in columns)
            src = f" <span class=tag>{esc(r.source)}</span>" if r.source != "mechdiag" else ""
            rows.append(f"<tr><td><span class=sw style='background:{g.color}'></span>{esc(g.label)}</td>"
                        f"<td class=path title='{esc(r.path)}'>{esc(r.name)}{src}</td>"
                        f"<td>{_fmt(max(steps) if steps else None)}</td><td>{esc(sandbox_of(r))}</td>"
                        f"{cells}</tr>")
    note = (f"<p class=note>highlighted: config keys that differ between runs ({esc(', '.join(differ))})</p>"
            if differ else "")
    return (f"<div class=scroll><table class=runs><tr><th>run</th><th>directory</th><th>steps</th>"
            "<th title='isolation of model code: bwrap, landlock, guard-only, none (no code ran)'>sandbox</th>"
            f"{head}</tr>"
            + "".join(rows) + "</table></div>" + note)


def _base_final(run: Run) -> tuple[dict, dict, str]:
    """Base and final eval numbers (mechdiag.run.base_eval / final_eval) and where they come from."""
    src = "summary.json" if any(k.startswith(("base_", "final_")) for k in run.summary) else "eval.jsonl"
    base, final = base_eval(run), final_eval(run)
    return base, final, src if base or final else ""


def section_summary(groups: list[Group], advice) -> str:
    parts = [section_runs(groups)]
    rows = []
    for g in groups:
        pairs = [_base_final(r) for r in g.runs]
        metrics = dict.fromkeys(k for b, f, _ in pairs for k in [*b, *f]
                                if k != "step" and _num(f.get(k, b.get(k))) is not None)
        for k in metrics:
            bm, bs = mean_std([_num(b.get(k)) for b, _, _ in pairs])
            fm, fs = mean_std([_num(f.get(k)) for _, f, _ in pairs])
            d = fm - bm if fm is not None and bm is not None else None
            cls = _delta_class(k, d, bm)
            rows.append(f"<tr><td><span class=sw style='background:{g.color}'></span>{esc(g.label)}</td>"
                        f"<td>{esc(k)}</td><td>{_pm(bm, bs)}</td><td>{_pm(fm, fs)}</td>"
                        f"<td class='{cls}'>{'–' if d is None else f'{d:+.4g}'}</td></tr>")
    if rows:
        sources = sorted({src for g in groups for r in g.runs for _, _, src in [_base_final(r)] if src})
        parts.append("<h3>Base vs final evaluation</h3><table class=cmp><tr><th>run</th><th>metric</th>"
                     "<th>base</th><th>final</th><th>Δ</th></tr>" + "".join(rows) + "</table>"
                     f"<p class=note>mean ± std over seeds; from {esc(', '.join(sources))}.</p>")
    else:
        parts.append(_missing("No base or final evaluation recorded (no summary.json or eval.jsonl)"))
    parts.append("<h3>Top recommendations</h3>")
    if advice.findings:
        parts.append("<ol class=top>" + "".join(f"<li><b>{esc(f.change)}</b> — {esc(f.symptom)}</li>"
                                                for f in advice.findings[:3]) + "</ol>")
    else:
        parts.append(f"<p class=missing>{esc(advice.note)}</p>")
    return "".join(parts)


_num = F._num  # one finite-number coercion for figures and tables


def section_dynamics(groups: list[Group], figs: _Figures) -> str:
    fig = F.training_dynamics(groups)
    if fig is None:
        return _missing("No training dynamics recorded (metrics.jsonl and eval.jsonl missing or empty)")
    notes = ""
    for stream, what in (("metrics", "train metrics"), ("eval", "evaluations")):
        lack = _lacking(groups, stream)
        if lack:
            notes += _missing(f"No {what} recorded", lack)
    out = figs.embed(fig) + notes + ("<p class=note>Lines: mean over seeds; bands: ± 1 std over seeds. "
                                     f"Long runs are binned to at most {F.MAX_POINTS} points.</p>")
    other = F.other_signals(groups)
    if other is not None:
        out += "<h3>Other recorded training signals</h3>" + figs.embed(other)
    return out


def section_displacement(groups: list[Group], figs: _Figures) -> str:
    out = []
    for g in groups:
        fig = F.weight_heatmap(g)
        if fig is not None:
            out.append(figs.embed(fig))
    dyn = F.displacement_dynamics(groups)
    if dyn is not None:
        out.append(figs.embed(dyn))
    if not out:
        return _missing("No weight displacement recorded (displacement.jsonl missing or empty)")
    lack = _lacking(groups, "displacement")
    if lack:
        out.append(_missing("No weight displacement recorded", lack))
    out.append("<p class=note>Cells: ||W − W<sub>ref</sub>||<sub>F</sub> / ||W<sub>ref</sub>||<sub>F</sub> per "
               "layer and module (LoRA: the effective weight), mean over seeds; drag the slider to see it over "
               "steps. WDisp pools all recorded tensors; update mass is each module type's share of "
               "Σ ||ΔW||².</p>")
    ks = set()
    for g in groups:
        geo = F.geometry_heatmap(g)
        if geo is not None:
            out.append(figs.embed(geo[0]))
            ks.update(geo[1])
    if ks:
        k = ", ".join(str(k) for k in sorted(ks))
        out.append("<p class=note>Update geometry at the final step (docs/metrics.md): subspace_overlap is the "
                   f"share of ||ΔW||² inside the span of the base weight's top-k singular vectors (k = {k}, the "
                   "LoRA rank; a random update gives about k²/(m n)); intruders counts the tuned weight's top-10 "
                   "singular vectors with |cos| &lt; 0.5 to every base singular vector.</p>")
    return "".join(out)


def section_user_signals(groups: list[Group], figs: _Figures) -> str:
    parts = [f"<h3>{esc(name)}</h3>" + figs.embed(fig) for name, fig in F.user_signals(groups)]
    return "".join(parts)  # no user signals: no section


def section_shift(groups: list[Group], figs: _Figures) -> str:
    fig = F.activation_shift(groups)
    if fig is None:
        return _missing("No activation shift recorded (shift.jsonl missing or empty)")
    lack = _lacking(groups, "shift")
    return figs.embed(fig) + (_missing("No activation shift recorded", lack) if lack else "") + (
        "<p class=note>Shift<sub>l</sub> = ||h<sub>tuned</sub> − h<sub>ref</sub>|| / ||h<sub>ref</sub>|| on the "
        "post-block residual stream at each run's last measured step; error bars: bootstrap interval over "
        "prompts.</p>")


def section_attribution(groups: list[Group]) -> str:
    """Causal share (output KL lost without the part) beside displacement share, per layer and module."""
    out = []
    for g in groups:
        for r in g.runs:
            rows = r.read("attribution")
            if not rows:
                continue
            none, allr = attribution_reference(rows, "none"), attribution_reference(rows, "all")
            head = (f"<h3>{esc(r.name)}</h3><p>tuned accuracy {_fmt(none and none.get('accuracy_without'))}, "
                    f"without the whole adapter {_fmt(allr and allr.get('accuracy_without'))}</p>")
            tables = []
            for by in ("layer", "module"):
                parts = [x for x in rows if x.get("by") == by]
                if not parts:
                    continue
                causal = causal_shares(rows, by)
                disp = {(x["layer"] if by == "layer" else x["module"]): x.get("disp_share") for x in parts
                        if _num(x.get("disp_share")) is not None}
                rho = rank_correlation(disp, causal)
                body = "".join(
                    f"<tr><th>{esc(x['part'])}</th><td>{_fmt(x.get('disp_share'), 3)}</td>"
                    f"<td>{_fmt(causal.get(x['layer'] if by == 'layer' else x['module']), 3)}</td>"
                    f"<td>{_fmt(x.get('accuracy_without'))}</td><td>{_fmt(x.get('accuracy_only'))}</td>"
                    f"<td>{_fmt(x.get('output_kl_without'), 3)}</td></tr>" for x in parts)
                tables.append(f"<table class=cmp><tr><th>{by}</th><th>displacement share</th><th>causal share</th>"
                              f"<th>accuracy without</th><th>accuracy only</th><th>output KL without</th></tr>"
                              f"{body}</table><p>Spearman rank correlation (displacement vs causal, by {by}): "
                              f"{_fmt(rho, 3)}</p>")
            out.append(head + "".join(tables))
    if not out:
        return _missing("No attribution recorded (attribution.jsonl missing; run `mechdiag attribute RUN --save`)")
    return "".join(out) + (
        "<p class=note>Causal share: a part's output KL(tuned || tuned without the part) on the held-out greedy "
        "completions, over the sum for all parts of its kind. Displacement share: its share of Σ ||ΔW||². A rank "
        "correlation near 1 means displacement predicted which parts mattered on this run.</p>")


def section_benchmarks(groups: list[Group]) -> str:
    # (benchmark, metric) -> column -> values over seeds; the column is the model label, per group.
    cells: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    stds: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    columns: list[str] = []
    multi = len(groups) > 1
    for g in groups:
        for r in g.runs:
            for row in r.read("eval_benchmarks"):
                v = _num(row.get("value"))
                if v is None or row.get("benchmark") is None or row.get("metric") is None:
                    continue
                model = str(row.get("model", "tuned"))
                col = "base" if model == "base" else (f"{g.label} / {model}" if multi else model)
                if col not in columns:
                    columns.append(col)
                key = (str(row["benchmark"]), str(row["metric"]))
                cells[key][col].append(v)
                if _num(row.get("std")) is not None:
                    stds[(*key, col)].append(_num(row["std"]))
    if not cells:
        return _missing("No benchmark evaluation recorded (eval_benchmarks.jsonl missing or empty; "
                        "run `mechdiag eval`)")
    columns = (["base"] if "base" in columns else []) + [c for c in columns if c != "base"]
    metrics = sorted({m for _, m in cells}, key=metric_order)
    benches = sorted({b for b, _ in cells})
    head1 = "".join(f"<th colspan={len(columns)}>{esc(m)}</th>" for m in metrics)
    head2 = "".join(f"<th>{esc(c)}</th>" for _ in metrics for c in columns)
    body = []
    for b in benches:
        tds = []
        for m in metrics:
            base_mean, _ = mean_std(cells.get((b, m), {}).get("base", []))
            for c in columns:
                vals = cells.get((b, m), {}).get(c, [])
                mean, std = mean_std(vals)
                if std is None and len(vals) == 1 and stds.get((b, m, c)):
                    std = stds[(b, m, c)][0]
                d = mean - base_mean if c != "base" and mean is not None and base_mean is not None else None
                cls = _delta_class(m, d, base_mean)
                tip = f" title='Δ vs base {d:+.4g}'" if d is not None else ""
                tds.append(f"<td class='{cls}'{tip}>{_pm(mean, std) if mean is not None else '–'}</td>")
        body.append(f"<tr><th class=bench>{esc(b)}</th>{''.join(tds)}</tr>")
    return (f"<div class=scroll><table class='cmp bench'><tr><th rowspan=2>benchmark</th>{head1}</tr>"
            f"<tr>{head2}</tr>" + "".join(body) + "</table></div><p class=note>mean ± std over seeds "
            "(or the recorded std); <span class=up>green</span>: better than base, "
            "<span class=down>red</span>: worse; entropy and length are not judged.</p>")


def section_recommendations(advice) -> str:
    if not advice.findings:
        out = f"<p class=missing>{esc(advice.note)}</p>"
    else:
        rows = []
        for f in advice.findings:
            c = f.confidence
            conf = f"{c:.0%}" if isinstance(c, (int, float)) and not isinstance(c, bool) else esc(c)
            reason = f"<div class=note>{esc(f.reason)}</div>" if f.reason else ""
            when = f"<div class=note>{esc(f.when)}</div>" if f.when else ""
            rows.append(f"<tr><td>{esc(f.rule)}</td><td>{esc(f.symptom)}</td><td class=ev>{esc(f.evidence)}{when}</td>"
                        f"<td><code>{esc(f.change)}</code>{reason}</td><td>{conf}</td></tr>")
        out = ("<table class=recs><tr><th>rule</th><th>symptom</th><th>evidence</th><th>change</th>"
               "<th>confidence</th></tr>" + "".join(rows) + "</table>")
    if advice.refined_yaml and advice.findings:
        out += (f"<details><summary>{advice.refined_label}</summary>"
                f"<pre class=completion>{esc(advice.refined_yaml)}</pre></details>")
    return out


def _completion(text) -> str:
    text = "" if text is None else str(text)
    more = ""
    if len(text) > MAX_COMPLETION_CHARS:
        more = f"<span class=cut>… {len(text) - MAX_COMPLETION_CHARS} more characters</span>"
        text = text[:MAX_COMPLETION_CHARS]
    return f"<pre class=completion>{esc(text)}</pre>{more}"


def _badge(s: dict) -> str:
    bits = []
    if "correct" in s and s["correct"] is not None:
        bits.append("<span class='tag ok'>correct</span>" if s["correct"] else "<span class='tag bad'>wrong</span>")
    if _num(s.get("reward")) is not None:
        bits.append(f"<span class=tag>reward {_fmt(_num(s['reward']), 3)}</span>")
    if _num(s.get("advantage")) is not None:
        bits.append(f"<span class=tag>adv {_fmt(_num(s['advantage']), 3)}</span>")
    return "".join(bits)


def _is_base(s: dict) -> bool:
    """mechdiag eval labels the untrained model "base"; a training run's eval at step 0 is the untrained model."""
    return s.get("model") == "base" if "model" in s else (_num(s.get("step")) or 0.0) == 0.0


def _pairs(run: Run) -> tuple[list[tuple[str, dict, dict]], float | None]:
    """(prompt, base, tuned) eval completions: the untrained model against the last evaluated step."""
    ev = [s for s in run.read("samples") if s.get("split") == "eval"]
    tuned = [s for s in ev if not _is_base(s)]

    def key(s):
        return str(s.get("prompt") if s.get("prompt") is not None else s.get("example_id"))

    base = {key(s): s for s in ev if _is_base(s)}
    if not tuned:
        return [], None
    last = max((_num(s.get("step")) or 0.0) for s in tuned)
    out, seen = [], set()
    for s in tuned:
        p = key(s)
        if (_num(s.get("step")) or 0.0) == last and p not in seen:
            seen.add(p)
            out.append((p, base.get(p, {}), s))
    out.sort(key=lambda t: t[1].get("correct") == t[2].get("correct"))  # disagreements first
    return out[:MAX_PAIRS], last


def section_samples(groups: list[Group]) -> str:
    out = []
    for g in groups:
        run = next((r for r in g.runs if _pairs(r)[0]), None)
        if run is None:
            continue
        pairs, last = _pairs(run)
        out.append(f"<h3><span class=sw style='background:{g.color}'></span>{esc(g.label)} "
                   f"<span class=sub>({esc(run.name)}, eval at step {_fmt(last)})</span></h3>")
        tuned_label = f"tuned, step {_fmt(last)}" if last else "tuned"
        for prompt, b, t in pairs:
            bcell = (f"{_badge(b)}{_completion(b.get('completion'))}" if b
                     else "<p class=missing>no base completion recorded for this prompt.</p>")
            out.append(f"<div class=pair><div class=prompt><b>prompt</b><pre class=completion>{esc(prompt)}</pre>"
                       f"</div><div class=side><div><b>base</b> {bcell}</div><div><b>{tuned_label}</b> {_badge(t)}"
                       f"{_completion(t.get('completion'))}</div></div></div>")
    rollouts = _rollouts(groups)
    if not out and not rollouts:
        return _missing("No sample completions recorded (samples.jsonl missing or empty)")
    if not out:
        out.append(_missing("No eval completions recorded (samples with split=eval)"))
    return "".join(out) + rollouts


def _rollouts(groups: list[Group]) -> str:
    """One training group of the last sampled step: G completions with their rewards and advantages."""
    for g in groups:
        for r in g.runs:
            train = [s for s in r.read("samples") if s.get("split", "train") == "train"]
            if not train:
                continue
            last = max((_num(s.get("step")) or 0.0) for s in train)
            at = [s for s in train if (_num(s.get("step")) or 0.0) == last]
            grp = at[0].get("group")
            rows = [s for s in at if s.get("group") == grp][:MAX_ROLLOUTS]
            body = "".join(f"<tr><td>{_badge(s)}</td><td>{_completion(s.get('completion'))}</td></tr>" for s in rows)
            return (f"<h3>A rollout group <span class=sub>({esc(r.name)}, step {_fmt(last)}, group "
                    f"{esc(grp)})</span></h3><p class=prompt><b>prompt</b></p><pre class=completion>"
                    f"{esc(rows[0].get('prompt'))}</pre><table class=rollouts>{body}</table>")
    return ""


# ---- page ---------------------------------------------------------------------------------------------------
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;margin:0;background:#fafafa}
header{background:#23395d;color:#fff;padding:14px 28px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;opacity:.85;font-size:12px}
nav{padding:6px 28px;background:#eef1f6;border-bottom:1px solid #dde}nav a{margin-right:14px;color:#23395d}
main{padding:8px 28px 40px;max-width:1500px}section{background:#fff;border:1px solid #e3e3e3;border-radius:6px;
padding:6px 18px 14px;margin:14px 0}h2{font-size:17px;border-bottom:1px solid #eee;padding-bottom:4px}
h3{font-size:14px;margin:14px 0 6px}.sub{font-weight:normal;color:#666}
table{border-collapse:collapse;margin:6px 0;font-size:13px}th,td{border:1px solid #e2e2e2;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f4f5f7}td.up,span.up{background:#e6f4ea;color:#136c2e}
td.down,span.down{background:#fdecea;color:#a61b1b}.pm{color:#777;font-size:11px}
.missing{color:#8a5a00;background:#fff8e6;border-left:3px solid #f0b400;padding:4px 8px}
.note{color:#666;font-size:12px}.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px}
.tag{display:inline-block;font-size:11px;padding:0 5px;border-radius:3px;background:#eee;margin-right:4px}
.tag.ok{background:#e6f4ea;color:#136c2e}.tag.bad{background:#fdecea;color:#a61b1b}
pre.completion{white-space:pre-wrap;word-break:break-word;background:#f7f7f9;border:1px solid #eee;padding:6px;
margin:3px 0;max-height:320px;overflow:auto;font-size:12px}.cut{color:#999;font-size:11px}
.pair{border-top:1px solid #eee;padding:6px 0}.side{display:grid;grid-template-columns:1fr 1fr;gap:12px}
td.ev{max-width:520px;font-size:12px}td.path{font-family:monospace}
.scroll{max-width:100%;overflow-x:auto}table.bench td{white-space:nowrap}th.diff{background:#fff3cd}
#report-errors{display:none;background:#fdecea;color:#a61b1b;padding:8px 28px;white-space:pre-wrap}
"""

# Runs first: record any script error on <html> and in a visible banner, so a broken page says so.
JS_GUARD = """
(function(){var d=document.documentElement;d.setAttribute('data-report-status','loading');
function rec(m){d.setAttribute('data-report-status','error');var e=document.getElementById('report-errors');
var t=(d.getAttribute('data-errors')||'')+String(m)+'\\n';d.setAttribute('data-errors',t);
if(e){e.textContent=t;e.style.display='block';}}
window.addEventListener('error',function(e){rec('error: '+(e.message||e.type))});
window.addEventListener('unhandledrejection',function(e){rec('unhandled: '+(e.reason&&e.reason.message||e.reason))});
var ce=console.error;console.error=function(){rec('console.error: '+Array.prototype.join.call(arguments,' '));
return ce.apply(console,arguments)};window.__reportError=rec;})();
"""

JS_RENDER = """
(function(){var d=document.documentElement,blocks=document.querySelectorAll('script.fig-data'),n=0,jobs=[];
d.setAttribute('data-figures',String(blocks.length));d.setAttribute('data-rendered','0');
blocks.forEach(function(b){try{var spec=JSON.parse(b.textContent);
jobs.push(Plotly.newPlot(b.getAttribute('data-target'),spec.data,spec.layout,
{displaylogo:false,responsive:true}).then(function(){n+=1;d.setAttribute('data-rendered',String(n));}));}
catch(e){window.__reportError('figure '+b.getAttribute('data-target')+': '+e.message);}});
Promise.all(jobs).then(function(){if(d.getAttribute('data-report-status')!=='error'&&n===blocks.length)
d.setAttribute('data-report-status','ok');},function(e){window.__reportError('plot: '+(e&&e.message||e));});})();
"""


def render_page(groups: list[Group], advice=None, plotly_js: str | None = None) -> str:
    """The whole page. `advice`: mechdiag.report.Advice (findings, or the note shown in their place)."""
    if advice is None:
        advice = Advice(note="Recommendations not requested.")
    if plotly_js is None:
        from plotly.offline import get_plotlyjs  # noqa: PLC0415 - plotly loads only when a figure is drawn

        plotly_js = get_plotlyjs()
    if "</script" in plotly_js.lower():
        raise RuntimeError("plotly.js bundle contains </script>; cannot inline it")
    figs = _Figures()
    sections = [
        ("summary", "Summary", section_summary(groups, advice)),
        ("dynamics", "Training dynamics: the eight signals", section_dynamics(groups, figs)),
        ("displacement", "Weight displacement", section_displacement(groups, figs)),
        ("shift", "Activation shift", section_shift(groups, figs)),
        ("user-signals", "User signals", section_user_signals(groups, figs)),
        ("attribution", "Attribution: causal vs displacement share", section_attribution(groups)),
        ("benchmarks", "Evaluation: base vs tuned", section_benchmarks(groups)),
        ("recommendations", "Recommendations", section_recommendations(advice)),
        ("samples", "Sample completions: base vs tuned", section_samples(groups)),
    ]
    sections = [sec for sec in sections if sec[2]]  # a section with nothing to say (no user signals) is left out
    nonce = secrets.token_urlsafe(18)
    csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; img-src data: blob:; "
           "font-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'")
    title = "mechdiag report: " + ", ".join(g.label for g in groups)
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = "".join(f"<a href='#{k}'>{esc(t.split(':')[0])}</a>" for k, t, _ in sections)
    body = "".join(f"<section id={k}><h2>{esc(t)}</h2>{s}</section>" for k, t, s in sections)
    nruns = sum(len(g.runs) for g in groups)
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name=viewport content="width=device-width,initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style>"
        f"<script nonce='{nonce}'>{JS_GUARD}</script>"
        f"<script nonce='{nonce}'>{plotly_js}</script></head><body>"
        f"<header><h1>{esc(title)}</h1><p>{nruns} run{'s' * (nruns != 1)} in {len(groups)} "
        f"configuration{'s' * (len(groups) != 1)} · generated {when} by mechdiag</p></header>"
        f"<div id=report-errors></div><nav>{nav}</nav><main>{body}</main>"
        f"<script nonce='{nonce}'>{JS_RENDER}</script></body></html>\n"
    )
