"""From the comparison tables of every layout of one reference to the layout matrix: pure pandas, no streamlit.

A matrix row is a candidate layout (a run compared with the same reference); a column is a module, in
execution order (or a layer, every module inside it folded into one column). A cell holds every tensor
of that layout and module, over all steps, micro-batches and kinds, up to the layout's first divergence
(a module that ran only after it: all of them, drawn faded), and shows the worst: its
log10(error / tolerance) as colour, or a category of its own when the worst is not a number (as the
heatmap's cells do). Each layout's first divergence is flagged, so one look answers "which layouts
break, and where".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from ttrace_core.api import display_fqn
from ttrace_dashboard.cells import _ranked, categories, first_divergence, log_ratios, module_rows, rows_by_layer

ROWS_BY = ("modules", "layers")
CELL_COLUMNS = ["layout", "module", "row", "column", "value", "category", "tensor", "source_module", "ratio", "status",
                "first_divergence", "after_first", "hover"]


def folded(frame: pd.DataFrame, rows_by: str) -> pd.DataFrame:
    """The table with `source_module` (the module that recorded each tensor) and `module` the matrix
    column it falls in: itself, or its layer ("decoder.layers.3") when `rows_by` is "layers"."""
    if rows_by not in ROWS_BY:
        raise ValueError(f"rows_by must be one of {ROWS_BY}, not {rows_by!r}")
    frame = frame.assign(source_module=frame["module"])
    return rows_by_layer(frame) if rows_by == "layers" else frame


def column_order(frames: Sequence[pd.DataFrame]) -> list[str]:
    """Every module of every layout, in execution order: the first layout's order, and a module only
    another layout ran goes right after the module that ran before it there."""
    order: list[str] = []
    for frame in frames:
        previous = None
        for module in module_rows(frame)["module"]:
            if module not in order:
                order.insert(order.index(previous) + 1 if previous is not None else 0, module)
            previous = module
    return order


def _hover(worst: pd.DataFrame, counts: pd.Series) -> pd.Series:
    ratio = worst["ratio"].astype(float).map(lambda r: "-" if pd.isna(r) else f"{r:.3g}")
    source = worst["source_module"].where(worst["source_module"] != worst["module"], "")
    return ("<b>" + worst["layout"] + "</b><br>" + worst["module"].map(display_fqn)
            + source.map(lambda m: f" ({m})" if m else "") + "<br>worst: " + worst["tensor"] + " (step "
            + worst["step"].astype(str) + ")<br>ratio " + ratio + " · " + worst["status"]
            + counts.map(lambda n: f"<br>worst of {n} tensors" if n > 1 else "")
            + worst["first_divergence"].map(lambda f: "<br><b>first divergence of this layout</b>" if f else "")
            + worst["after_first"].map(lambda a: "<br>ran only after the first divergence (inherits it)" if a else ""))


def _layout_cells(layout: str, frame: pd.DataFrame) -> pd.DataFrame:
    """A module's cell is its worst tensor up to the layout's first divergence (in execution order): once one
    tensor has diverged, everything computed after it inherits the error, and a cell that took the worst over
    the whole run was dark red even upstream of the bug. A module that ran only after the first divergence
    shows its worst, flagged `after_first` (drawn faded)."""
    first = first_divergence(frame)
    upstream = frame if first is None else frame[frame["order"] <= first["order"]]
    later = frame[~frame["module"].isin(set(upstream["module"]))]
    ranked = pd.concat([_ranked(upstream).assign(after_first=False), _ranked(later).assign(after_first=True)])
    counts = ranked.groupby("module", sort=False).size()
    worst = ranked.drop_duplicates("module").assign(layout=layout)
    worst["first_divergence"] = False if first is None else worst["module"] == first["module"]
    worst["hover"] = _hover(worst, worst["module"].map(counts))
    return worst


def matrix_cells(tables: Mapping[str, pd.DataFrame], rows_by: str = "modules") -> pd.DataFrame:
    """One row per (layout, module) cell: layout, module (or layer), row (the layout's index in `tables`),
    column (the module's in execution order), value (log10 ratio of the worst tensor), category, the worst
    tensor and the module that recorded it, its ratio and status, whether the cell holds the layout's first
    divergence, and the hover text."""
    frames = {layout: folded(frame, rows_by) for layout, frame in tables.items() if not frame.empty}
    if not frames:
        return pd.DataFrame(columns=CELL_COLUMNS)
    columns = {module: index for index, module in enumerate(column_order(list(frames.values())))}
    rows = {layout: index for index, layout in enumerate(tables)}
    cells = pd.concat([_layout_cells(layout, frame) for layout, frame in frames.items()], ignore_index=True)
    cells["row"] = cells["layout"].map(rows)
    cells["column"] = cells["module"].map(columns)
    cells["value"] = log_ratios(cells["ratio"])
    cells["category"] = categories(cells)
    return cells.sort_values(["row", "column"])[CELL_COLUMNS].reset_index(drop=True)


def matrix_columns(cells: pd.DataFrame) -> list[str]:
    """The column labels of `matrix_cells`, in order."""
    return cells.drop_duplicates("column").sort_values("column")["module"].tolist()


def clicked_cell(selection: Mapping | None) -> tuple[str, str] | None:
    """(layout, module) of a matrix click, or None when the click selected nothing: every marker carries
    customdata [layout, module that recorded the worst tensor]. `selection` is what
    `st.plotly_chart(on_select="rerun")` returns."""
    points = ((selection or {}).get("selection") or {}).get("points") or []
    for point in points:
        data = point.get("customdata")
        if data and len(data) >= 2 and data[0]:
            return str(data[0]), str(data[1])
    return None

