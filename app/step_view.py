"""What the heatmap page draws for one step of a complete comparison table: pure, no streamlit.

The page builds it once per table, step, micro-batch, rows choice and focus, and keeps it in Streamlit's
resource cache (pages/heatmap.py), so a revisit draws without building anything; the timeline is built
only when its section is opened. benchmarks/dashboard.py times the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from ttrace_dashboard import cells, figures
from ttrace_dashboard.state import ALL_MICRO_BATCHES

MAX_CHOICES = 3000
"""The "Go to a tensor" box lists failures first; past this many options it only grows the page."""


@dataclass(frozen=True)
class StepView:
    """One step's heatmap and what the page around it needs. Shared between reruns and sessions: never mutated."""
    rows: pd.DataFrame
    """The heatmap's rows (`cells.module_rows` of the modules or layers shown)."""
    heatmap: go.Figure
    choices: list[tuple[str, int, int]]
    """(tensor, step, micro_batch) for the "Go to a tensor" box, failures first."""
    suspects: list[str]
    """The traced modules a replay can start from, in execution order."""
    marked: tuple[str, str] | None
    """The (row, kind) cell outlined as the first divergence, when it is in this view."""


def step_heatmap(frame: pd.DataFrame, step: int, mb: int | str, rows_choice: str, focus: str | None
                 ) -> tuple[pd.DataFrame, go.Figure, tuple[str, str] | None]:
    """The heatmap of `step` for micro-batch `mb` (or `ALL_MICRO_BATCHES`), rows per module or per layer
    (`rows_choice`), the `focus` row framed: its rows, its figure, and the cell outlined as the first divergence
    (None when that is not in this view). Also what the page draws of a comparison still streaming."""
    first = cells.first_divergence(frame)
    shown = cells.rows_by_layer(frame) if rows_choice == "layers" else frame
    rows = cells.module_rows(shown)
    view_cells = cells.heatmap_cells(shown, step, mb)
    marked = None
    if first is not None and first["step"] == step and mb in (ALL_MICRO_BATCHES, first["micro_batch"], -1):
        marked = (shown.loc[first.name, "module"], first["kind"])
        view_cells = cells.pointing_at_first(view_cells, first, marked[0])
    return rows, figures.heatmap_figure(view_cells, rows, marked, focus), marked


def step_view(frame: pd.DataFrame, step: int, mb: int | str, rows_choice: str, focus: str | None) -> StepView:
    """`step_heatmap`, with the choices and suspects the page around it lists."""
    rows, heatmap, marked = step_heatmap(frame, step, mb, rows_choice, focus)
    return StepView(rows=rows, heatmap=heatmap, choices=cells.tensor_choices(frame, step)[:MAX_CHOICES],
                    suspects=[m for m in cells.module_rows(frame)["module"] if m], marked=marked)


def step_timeline(frame: pd.DataFrame, step: int) -> go.Figure:
    """Every module and tensor kind of `step` in execution order, the first divergence marked when in it."""
    first = cells.first_divergence(frame)
    first_order = int(first["order"]) if first is not None and first["step"] == step else None
    return figures.timeline_figure(cells.timeline_points(frame, step), first_order)
