"""From the comparison table to what the heatmap and the timeline draw: pure pandas, no streamlit.

A heatmap row is a module, in the order it first ran (so layers stay together and forward order
is top to bottom); a column is a tensor kind (table.KINDS). A cell holds every tensor of that
module and kind in the chosen step and micro-batch (all of them for `mb=all`) and shows the worst:
its log10(ratio) as colour, or a category of its own when the worst is not a number.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ttrace_core.table import KINDS

LOG_RATIO_LIMIT = 4.0
"""The colour scale spans log10(ratio) in [-4, 4]; 0 is the pass line."""
KIND_LABELS = {"input": "fwd input", "output": "fwd output", "grad_output": "grad output", "grad_input": "grad input",
               "param_grad": "param grad", "param": "param after step"}
CATEGORY_OF_STATUS = {"pass": "ratio", "mismatch": "ratio", "replica_drift": "ratio", "missing": "missing",
                      "extra": "missing", "shape": "structure", "dtype": "structure", "layout": "structure"}
"""Cells whose worst tensor has no ratio get their own colour: nan, inf, missing, structure."""


def _ranked(rows: pd.DataFrame) -> pd.DataFrame:
    """Worst first: non-finite values, then failures by ratio, then failures without a ratio (missing,
    structure), then passes by ratio."""
    ratio = rows["ratio"].astype(float).fillna(0.0)
    nonfinite = rows["status"] == "nonfinite"
    has_ratio = rows["ratio"].notna()
    severity = np.select([nonfinite, ~rows["passed"] & has_ratio, ~rows["passed"]], [3, 2, 1], default=0)
    ranked = rows.assign(_severity=severity, _ratio=ratio)
    return ranked.sort_values(["_severity", "_ratio"], ascending=False, kind="stable")


def category(row: pd.Series | dict) -> str:
    if row["status"] == "nonfinite":
        return "nan" if row["num_nan_candidate"] != row["num_nan_reference"] else "inf"
    return CATEGORY_OF_STATUS.get(row["status"], "structure")


def log_ratio(ratio: float | None) -> float:
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return float("nan")
    if ratio <= 0:
        return -LOG_RATIO_LIMIT
    return float(np.clip(math.log10(ratio), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def in_view(frame: pd.DataFrame, step: int, micro_batch: int | str) -> pd.DataFrame:
    """Rows of one step; one micro-batch's activations plus the step's gradients and parameters."""
    rows = frame[frame["step"] == step]
    if micro_batch != "all":
        rows = rows[rows["micro_batch"].isin([int(micro_batch), -1])]
    return rows


def module_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per module in the order it first ran: module, layer, stage, row (0 at the top)."""
    firsts = frame.sort_values("order").groupby("module", sort=False).agg(
        order=("order", "min"), layer=("layer", "first"), stage=("stage", "first"))
    firsts = firsts.sort_values("order").reset_index()
    firsts["row"] = range(len(firsts))
    return firsts[["module", "layer", "stage", "row"]]


def _hover(row: pd.Series, count: int) -> str:
    tolerance = "-" if pd.isna(row["tolerance_rel"]) else f"{row['tolerance_rel']:.3g} ({row['tolerance_source']})"
    numbers = "-" if pd.isna(row["error"]) else f"{row['error']:.3g}"
    ratio = "-" if pd.isna(row["ratio"]) else f"{row['ratio']:.3g}"
    mb = "" if row["micro_batch"] < 0 else f" mb {row['micro_batch']}"
    return (f"<b>{row['tensor']}</b><br>step {row['step']}{mb}: {row['status']}<br>error {numbers}<br>"
            f"tolerance {tolerance}<br>ratio {ratio}<br>shape {row['shape'] or '-'} {row['dtype'] or ''}"
            + (f"<br>worst of {count} tensors" if count > 1 else ""))


def heatmap_cells(frame: pd.DataFrame, step: int, micro_batch: int | str) -> pd.DataFrame:
    """One row per (module, kind) cell: row, column, value (log10 ratio), category, customdata, hover."""
    rows = in_view(frame, step, micro_batch)
    if rows.empty:
        return pd.DataFrame(columns=["module", "kind", "row", "column", "value", "category", "tensor", "step",
                                     "micro_batch", "hover", "passed"])
    positions = module_rows(frame).set_index("module")["row"]
    ranked = _ranked(rows)
    counts = ranked.groupby(["module", "kind"]).size()
    worst = ranked.drop_duplicates(["module", "kind"]).copy()
    worst["row"] = worst["module"].map(positions)
    worst["column"] = worst["kind"].map({kind: index for index, kind in enumerate(KINDS)})
    worst["value"] = [log_ratio(r) for r in worst["ratio"]]
    worst["category"] = [category(r) for r in worst.to_dict("records")]
    worst["hover"] = [_hover(r, counts[(r["module"], r["kind"])]) for _, r in worst.iterrows()]
    columns = ["module", "kind", "row", "column", "value", "category", "tensor", "step", "micro_batch", "hover", "passed"]
    return worst.dropna(subset=["column"])[columns].reset_index(drop=True)


def timeline_points(frame: pd.DataFrame, step: int) -> pd.DataFrame:
    """Every tensor of one step in execution order, with log10(ratio) and its phase."""
    rows = frame[frame["step"] == step].sort_values("order").copy()
    rows["value"] = [log_ratio(r) for r in rows["ratio"]]
    rows["category"] = [category(r) for r in rows.to_dict("records")]
    rows["hover"] = [_hover(r, 1) for _, r in rows.iterrows()]
    return rows


def first_divergence(frame: pd.DataFrame) -> pd.Series | None:
    failed = frame[~frame["passed"]].sort_values("order")
    return None if failed.empty else failed.iloc[0]


def tensor_choices(frame: pd.DataFrame, step: int) -> list[tuple[str, int, int]]:
    """(tensor, step, micro_batch) of one step, failures first in execution order, then the rest."""
    rows = frame[frame["step"] == step].sort_values("order")
    ordered = pd.concat([rows[~rows["passed"]], rows[rows["passed"]]])
    return list(zip(ordered["tensor"], ordered["step"].astype(int), ordered["micro_batch"].astype(int)))


def history(frame: pd.DataFrame, tensor: str) -> pd.DataFrame:
    """One tensor across steps and micro-batches: step, micro_batch, ratio, status."""
    return frame[frame["tensor"] == tensor].sort_values(["step", "micro_batch"])[
        ["step", "micro_batch", "ratio", "error", "tolerance_rel", "status"]]
