"""From the comparison table to what the heatmap and the timeline draw: pure pandas, no streamlit.

A heatmap row is a module, in the order it first ran (so layers stay together and forward order
is top to bottom); a column is a tensor kind (table.KINDS). A cell holds every tensor of that
module and kind in the chosen step and micro-batch (all of them for `mb=all`) and shows the worst:
its log10(ratio) as colour, or a category of its own when the worst is not a number.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from ttrace_core.api import KINDS, PRE_STEP_SLOT, layer_module

LOG_RATIO_LIMIT = 4.0
"""The colour scale spans log10(ratio) in [-4, 4]; 0 is the pass line."""
KIND_LABELS = {"input": "fwd input", "output": "fwd output", "grad_output": "grad output", "grad_input": "grad input",
               "param_grad": "param grad", "param": "param after step", "loss": "loss",
               "step": "step scalars"}
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


def categories(rows: pd.DataFrame) -> pd.Series:
    """Each row's category: "ratio" when it has one to colour by, else "nan" or "inf" (non-finite values, NaN when
    the candidate's NaN count differs from the reference's), "missing" or "structure" (CATEGORY_OF_STATUS)."""
    nonfinite = rows["status"] == "nonfinite"
    nan = rows["num_nan_candidate"] != rows["num_nan_reference"]
    named = rows["status"].map(CATEGORY_OF_STATUS).fillna("structure")
    return pd.Series(np.where(nonfinite, np.where(nan, "nan", "inf"), named), index=rows.index, dtype=object)


def log_ratios(ratios: pd.Series) -> np.ndarray:
    """The colour of each ratio: its log10 clipped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]; a ratio of 0 (or
    below) the far blue end, a missing one NaN."""
    values = ratios.astype(float).to_numpy(dtype=float, na_value=np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.clip(np.log10(np.where(values > 0, values, np.nan)), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return np.where(values <= 0, -LOG_RATIO_LIMIT, logged)


def in_view(frame: pd.DataFrame, step: int, micro_batch: int | str) -> pd.DataFrame:
    """Rows of one step; one micro-batch's activations plus the step's gradients and parameters."""
    rows = frame[frame["step"] == step]
    if micro_batch != "all":
        rows = rows[rows["micro_batch"].isin([int(micro_batch), -1])]
    return rows


INITIAL_SLOT = PRE_STEP_SLOT
"""A parameter's value before the step (recorded at the first step of a recorded range), not an update."""


def _is_initial(frame: pd.DataFrame) -> pd.Series:
    return frame["slot"] == INITIAL_SLOT if "slot" in frame else pd.Series(False, index=frame.index)


def module_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per module in the order it first ran: module, layer, stage, row (0 at the top). Initial parameter
    values do not count as running (they come before the forward, in the order the parameters were registered);
    a module with nothing else keeps their place."""
    ran = frame[~_is_initial(frame)]
    frame = pd.concat([ran, frame[~frame["module"].isin(set(ran["module"]))]])
    firsts = frame.sort_values("order").groupby("module", sort=False).agg(
        order=("order", "min"), layer=("layer", "first"), stage=("stage", "first"))
    firsts = firsts.sort_values("order").reset_index()
    firsts["row"] = range(len(firsts))
    return firsts[["module", "layer", "stage", "row"]]


def _formatted(values: pd.Series) -> pd.Series:
    return values.astype(float).map(lambda v: "-" if math.isnan(v) else f"{v:.3g}")


def hover_texts(rows: pd.DataFrame, counts: pd.Series | None = None) -> pd.Series:
    """The hover text of each row: tensor, verdict, error, tolerance with its source, ratio, the smallest
    error the comparison catches on it, shape."""
    micro_batch = rows["micro_batch"].map(lambda m: "" if m < 0 else f" mb {m}")
    tolerance = _formatted(rows["tolerance_rel"]) + " (" + rows["tolerance_source"].fillna("none") + ")"
    catches = rows["detectable"].astype(float).map(lambda v: "" if math.isnan(v) else f"<br>catches errors above {v:.3g}")
    status = rows["status"].map(lambda code: STATUS_WORDS.get(code, code))
    text = ("<b>" + rows["tensor"] + "</b><br>step " + rows["step"].astype(str) + micro_batch + ": " + status
            + "<br>error " + _formatted(rows["error"]) + "<br>tolerance " + tolerance + "<br>ratio "
            + _formatted(rows["ratio"]) + catches + "<br>shape " + rows["shape"].fillna("-") + " " + rows["dtype"].fillna(""))
    if counts is not None:
        text = text + counts.map(lambda n: f"<br>worst of {n} tensors" if n > 1 else "")
    return text


def detectable_text(row: pd.Series) -> str | None:
    """The tensor page's line on the smallest error this comparison catches on the tensor, naming the test
    (the row's `decided_by`, the norm test where no other test set the figure); None when not compared by value."""
    detectable = row["detectable"]
    if pd.isna(detectable):
        return None
    return f"smallest error this comparison catches on this tensor: {detectable:.3g} (test: {_catching_test(row, detectable)})"


def _catching_test(row: pd.Series, detectable: float) -> str:
    """The test whose tolerance is the row's `detectable`: a scale or offset test's, else the norm's (an update
    test's figure is in units of the update, so it never equals the value's)."""
    structure = row.get("structure")
    tests = json.loads(structure) if isinstance(structure, str) else []
    return next((t["name"] for t in tests if math.isclose(t["tolerance"], detectable, rel_tol=1e-9)), "norm")


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
    worst["value"] = log_ratios(worst["ratio"])
    worst["category"] = categories(worst)
    worst["hover"] = hover_texts(worst, pd.Series(counts.loc[list(zip(worst["module"], worst["kind"]))].values,
                                                   index=worst.index))
    columns = ["module", "kind", "row", "column", "value", "category", "tensor", "step", "micro_batch", "hover", "passed"]
    return worst.dropna(subset=["column"])[columns].reset_index(drop=True)


def pointing_at_first(view_cells: pd.DataFrame, first: pd.Series, module: str) -> pd.DataFrame:
    """The heatmap cells with the first divergence's cell (`module` as the rows show it, the first's kind) pointing
    at the first divergence itself: a click anywhere in it opens that tensor, whichever marker plotly picks (the
    cell's own or its outline; at the centre they tie), and its hover names it, then the cell's worst. The colour
    stays the cell's worst."""
    cells = view_cells.copy()
    at = (cells["module"] == module) & (cells["kind"] == first["kind"])
    if not at.any():
        return cells
    worst = cells.loc[at, "tensor"].iloc[0]
    text = hover_texts(first.to_frame().T).iloc[0] + "<br><b>first divergence</b>"
    if worst != first["tensor"]:
        text += f"; the cell's worst (its colour) is {worst}"
    cells.loc[at, ["tensor", "step", "micro_batch", "hover"]] = [
        first["tensor"], int(first["step"]), int(first["micro_batch"]), text]
    return cells


def timeline_points(frame: pd.DataFrame, step: int) -> pd.DataFrame:
    """The step in execution order, one point per (module, tensor kind): its worst tensor over slots and
    micro-batches, placed where that module and kind first ran. (One point per tensor instance sent
    15k points, 6 MB, for a 48-layer model.)"""
    rows = frame[frame["step"] == step]
    # Initial parameter values are their own points, in their own band before the forward: merged with the
    # updated values, a parameter's point sat at the start of the step and its band covered the whole step.
    rows = rows.assign(phase=rows["phase"].where(~_is_initial(rows), "initial"))
    firsts = rows.groupby(["module", "kind", "phase"])["order"].min()
    counts = rows.groupby(["module", "kind", "phase"]).size()
    worst = _ranked(rows).drop_duplicates(["module", "kind", "phase"]).copy()
    index = list(zip(worst["module"], worst["kind"], worst["phase"]))
    worst["order"] = firsts.loc[index].values
    worst["value"] = log_ratios(worst["ratio"])
    worst["category"] = categories(worst)
    worst["hover"] = hover_texts(worst, pd.Series(counts.loc[index].values, index=worst.index))
    return worst.sort_values("order")


def rows_by_layer(frame: pd.DataFrame) -> pd.DataFrame:
    """The same table with every module inside a layer counted as that layer ("decoder.layers.3"), so
    the heatmap has one row per layer (plus the modules outside layers: embedding, final norm, head)."""
    prefixes = {module: layer_module(module) for module in frame["module"].unique()}
    return frame.assign(module=frame["module"].map(prefixes))


STATUS_WORDS = {
    "pass": "pass", "mismatch": "mismatch", "replica_drift": "replica drift", "nonfinite": "NaN or Inf",
    "missing": "missing in one run", "extra": "only in the candidate", "shape": "shapes differ",
    "dtype": "dtypes differ", "layout": "layouts differ",
}
"""A row's status in words, for the page (the table and the JSON keep the code)."""
GLOSSARY = (
    "**error**: how far the candidate is from the reference, ||candidate - reference|| / ||reference||.  \n"
    "**tolerance**: how far it may be, derived for this tensor (its source is named beside it).  \n"
    "**ratio**: error / tolerance. Below 1 the tensor passes; above 1 it fails; the colour is its log10, 0 the "
    "pass line.  \n"
    "**mismatch**: the ratio is above 1: the candidate computes something else than the reference.  \n"
    "**replica drift**: a tensor every rank should hold identically (replicated) differs between the candidate's "
    "ranks; its ratio compares that difference with one rounding.  \n"
    "**first divergence**: the first failing tensor in execution order; everything computed after it may only "
    "inherit its error."
)
"""What the words on the pages mean: the legend every page opens on request."""


def verdict_banner(row: pd.Series | dict) -> str:
    """The tensor page's verdict line: the status in words and its message, which states every ratio that was
    tested; the numbers alone when the message is empty (a pass)."""
    status = f"**{STATUS_WORDS.get(row['status'], row['status'])}**"
    if row["message"]:
        return f"{status} · {row['message']}"
    if row["value_ratio"] is None or pd.isna(row["value_ratio"]):
        return status
    text = f"{status} · error {row['error']:.3g} · tolerance {row['tolerance_rel']:.3g} · ratio {row['ratio']:.3g}"
    decided_by = row.get("decided_by")
    if isinstance(decided_by, str) and decided_by not in ("", "mismatch", "replica drift"):  # a structure test
        text += f" (closest test: {decided_by})"
    if pd.notna(row["drift_ratio"]) and row["drift_ratio"] > 0:
        text += f" · replica drift ratio {row['drift_ratio']:.3g}"
    return text


def first_divergence(frame: pd.DataFrame) -> pd.Series | None:
    failed = frame.loc[~frame["passed"], "order"]
    return None if failed.empty else frame.loc[failed.idxmin()]


def next_step_caption(diverged: bool) -> str:
    """What to do next, under a pair's verdict: the outlined cell exists only where something diverged."""
    if diverged:
        return ("Next: open the heatmap, then click the cell outlined in yellow (the first divergence) to see its "
                "tensor: which rank's shard carries the error.")
    return "Next: open the heatmap to see how close each tensor came to its tolerance (nothing diverged, so no cell is outlined)."


def focus_row(module: str | None, by_layer: bool) -> str | None:
    """The heatmap row a link's `module` points at: the module, or its layer when rows are layers."""
    if not module:
        return None
    return layer_module(module) if by_layer else module


ARRIVING_KINDS = ("input", "grad_output")
"""Tensor kinds a module receives rather than computes: its forward inputs and its output gradients."""


def replay_target(module: str, kind: str, modules: list[str]) -> str:
    """The module whose replay can find where a tensor's error comes from. A module computes its outputs and its
    input gradients: replay it. Its inputs and output gradients arrive from outside, from its parent's glue or a
    sibling, and a replay feeds them the reference's, so replaying the module itself always finds it clean:
    replay its nearest ancestor among `modules` (the traced ones), else the whole model ("")."""
    if kind not in ARRIVING_KINDS:
        return module
    parts = module.split(".")
    ancestors = (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
    return next((a for a in ancestors if a in modules), "")


def ranks_beyond_text(shards: list, tolerance_rel: float | None) -> str | None:
    """Which ranks' shards (or replicas) are beyond the tolerance, in words, under the per-rank chart; None when
    no shard has an error of its own (partial sums) or there is no tolerance to hold them to."""
    known = sorted((s.rank, s.error) for s in shards if s.error is not None)
    if not known or not tolerance_rel:
        return None
    beyond = [(rank, error) for rank, error in known if error > tolerance_rel]
    within = [(rank, error) for rank, error in known if error <= tolerance_rel]

    def listed(pairs: list[tuple[int, float]]) -> str:
        return ", ".join(f"rank {rank} ({error:.3g})" for rank, error in pairs)

    if not beyond:
        return f"Every rank is within the tolerance ({tolerance_rel:.3g}): {listed(within)}."
    text = f"**Beyond the tolerance ({tolerance_rel:.3g}): {listed(beyond)}.**"
    return text + (f" Within it: {listed(within)}." if within else "")


def replay_default(suspects: list[str], module: str | None, first_module: str | None) -> int:
    """The index the heatmap's "Replay a module" box opens on: the link's `module` when it names one;
    for a layer, the first divergence's module if it is in that layer, else the layer's first module;
    without a link, the first divergence's module; else the first."""
    if module in suspects:
        return suspects.index(module)
    inside = [m for m in suspects if module and layer_module(m) == module]
    for pick in ([first_module] if first_module in inside else []) + inside[:1]:
        return suspects.index(pick)
    return suspects.index(first_module) if first_module in suspects else 0


def tensor_choices(frame: pd.DataFrame, step: int) -> list[tuple[str, int, int]]:
    """(tensor, step, micro_batch) of one step, failures first in execution order, then the rest."""
    rows = frame[frame["step"] == step].sort_values("order")
    ordered = pd.concat([rows[~rows["passed"]], rows[rows["passed"]]])
    return list(zip(ordered["tensor"], ordered["step"].astype(int), ordered["micro_batch"].astype(int)))


def history(frame: pd.DataFrame, tensor: str) -> pd.DataFrame:
    """One tensor across steps and micro-batches: step, micro_batch, ratio, status."""
    return frame[frame["tensor"] == tensor].sort_values(["step", "micro_batch"])[
        ["step", "micro_batch", "ratio", "error", "tolerance_rel", "status"]]
