"""Displacement rows as a table and grouped: the study's WDisp per module, layer or the whole model (eq. 10/12)
and each group's update mass (mechdiag.metrics), from the per-tensor rows of mechdiag.displacement or the
trainers' records (mechdiag.live_rows).
"""

from __future__ import annotations

import pandas as pd

from mechdiag.errors import UserError
from mechdiag.lowrank import GEOMETRY_COLUMNS, SPECTRAL_COLUMNS
from mechdiag.metrics import DELTA_W, update_mass, update_mass_size_normalised, wdisp

ROW_COLUMNS = ["name", "layer", "module", "shape", "dtype", "numel", "ref_fro", "delta_fro", "rel_fro",
               "frac_unchanged", "frac_sub_ulp", "lora_rank", "nonfinite", "part_of", "expert"]


def rows_frame(rows: list[dict], spectral: bool = False) -> pd.DataFrame:
    cols = ROW_COLUMNS + (SPECTRAL_COLUMNS + GEOMETRY_COLUMNS if spectral else [])
    df = pd.DataFrame(rows, columns=cols)
    for c in ("layer", "lora_rank", "expert", *(("overlap_k", "intruders") if spectral else ())):
        df[c] = df[c].astype("Int64")
    for c in ("frac_unchanged", "frac_sub_ulp", *(SPECTRAL_COLUMNS + ["subspace_overlap"] if spectral else ())):
        df[c] = df[c].astype(float)
    df["nonfinite"] = df["nonfinite"].astype(bool)
    return df


def _keys(df: pd.DataFrame, by: str) -> list[str]:
    if by not in ("module", "layer", "all"):
        raise UserError(f"--by must be tensor, module, layer or all, not {by!r}")
    keys = ["step"] if "step" in df.columns else []
    return keys + ([] if by == "all" else [by])


def group_wdisp(rows_df: pd.DataFrame, by: str = "module", delta_w: float = DELTA_W) -> pd.DataFrame:
    """The study's WDisp per group (per step too when rows carry a step column).
    Columns: [step], key, n_tensors, ref_fro, delta_fro, wdisp, update_mass, update_mass_size_normalised
    (mechdiag.metrics.update_mass, update_mass_size_normalised). Non-finite rows are left out; a fused tensor's parts
    are groups of their own by module (a share of the same total as the whole tensors), and left out of layers and
    the whole model."""
    df = rows_df.copy()
    if "nonfinite" in df.columns:
        df = df[~df["nonfinite"].astype(bool)]
    part = df["part_of"].notna() & (df["part_of"] != "") if "part_of" in df.columns else pd.Series(False, df.index)
    if by != "module":
        df, part = df[~part], part[~part]
    df["is_part"] = part.astype(bool)
    df = df[df["ref_fro"].notna() & df["delta_fro"].notna()]
    df["ref_sq"] = df["ref_fro"].astype(float) ** 2
    df["delta_sq"] = df["delta_fro"].astype(float) ** 2
    keys = _keys(df, by)
    if keys:
        g = df.groupby(keys, dropna=False, sort=True).agg(n_tensors=("ref_sq", "size"), ref_sq=("ref_sq", "sum"),
                                                          delta_sq=("delta_sq", "sum"),
                                                          is_part=("is_part", "any")).reset_index()
    else:
        g = pd.DataFrame({"n_tensors": [len(df)], "ref_sq": [df["ref_sq"].sum()], "delta_sq": [df["delta_sq"].sum()],
                          "is_part": [False]})
    if by == "all":
        g.insert(len(keys), "all", "all")
    g["ref_fro"] = g["ref_sq"] ** 0.5
    g["delta_fro"] = g["delta_sq"] ** 0.5
    g["wdisp"] = wdisp(g["delta_sq"], g["ref_sq"], delta_w)
    parts = [part for _, part in g.groupby("step")] if "step" in g.columns else [g]
    for col, mass in (("update_mass", update_mass), ("update_mass_size_normalised", update_mass_size_normalised)):
        shares = {}
        for part in parts:  # shares within each recorded step
            rows = [{"group": i, "delta_fro": d, "ref_fro": r, "part_of": "part" if p else None} for i, d, r, p in
                    zip(part.index, part["delta_fro"], part["ref_fro"], part["is_part"], strict=True)]
            shares.update(mass(rows, "group", parts=True))
        g[col] = [shares.get(i, 0.0) for i in g.index]
    if by == "layer":
        g["layer"] = g["layer"].astype("Int64")
    return g.drop(columns=["ref_sq", "delta_sq", "is_part"])
