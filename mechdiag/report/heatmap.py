"""Heatmap of relative weight displacement, layers x modules (the study's per-tensor figure, paper-notes §4)."""

from __future__ import annotations

import os

import pandas as pd

from mechdiag.atomic import write_text
from mechdiag.metrics import wdisp

OUTSIDE = "outside blocks"  # row label for embeddings, final norm and lm_head (layer null)


def displacement_grid(df: pd.DataFrame) -> pd.DataFrame:
    """rel displacement per (layer, module) cell: metrics.wdisp over the cell's tensors
    (weight + bias), i.e. rel_fro when the cell holds one tensor. Rows: layers in order, then OUTSIDE."""
    d = df[["layer", "module", "ref_fro", "delta_fro"]].copy()
    d = d[d["ref_fro"].notna() & d["delta_fro"].notna()]
    d["ref_sq"], d["delta_sq"] = d["ref_fro"].astype(float) ** 2, d["delta_fro"].astype(float) ** 2
    d["row"] = [OUTSIDE if pd.isna(v) else str(int(v)) for v in d["layer"]]
    g = d.groupby(["row", "module"], sort=False)[["ref_sq", "delta_sq"]].sum()
    rel = wdisp(g["delta_sq"], g["ref_sq"].where(g["ref_sq"] > 0)).unstack("module")
    layers = sorted((r for r in rel.index if r != OUTSIDE), key=int) + ([OUTSIDE] if OUTSIDE in rel.index else [])
    modules = list(dict.fromkeys(d["module"]))  # checkpoint order: q, k, v, o, ... as the model lists them
    return rel.reindex(index=layers, columns=modules)


def displacement_heatmap(df: pd.DataFrame, title: str = "Relative weight displacement ||W - W_ref||_F / ||W_ref||_F"):
    """A plotly Figure: rel_fro per layer (rows) x module (columns) from per-tensor displacement rows."""
    import plotly.graph_objects as go  # noqa: PLC0415 - plotly loads only when a figure is drawn

    grid = displacement_grid(df)
    fig = go.Figure(go.Heatmap(
        z=grid.to_numpy(dtype=float), x=list(grid.columns), y=list(grid.index), colorscale="Viridis",
        colorbar={"title": "rel_fro"}, hoverongaps=False,
        hovertemplate="layer %{y}<br>%{x}<br>rel_fro %{z:.3e}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="module", yaxis_title="layer", yaxis_autorange="reversed",
                      height=max(320, 22 * len(grid.index) + 160))
    return fig


def write_html(fig, path: str | os.PathLike) -> None:
    """A self-contained HTML page (plotly.js inlined, works offline), written atomically."""

    write_text(path, fig.to_html(include_plotlyjs=True, full_html=True))
