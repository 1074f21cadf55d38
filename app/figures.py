"""Figure builders: data in, `go.Figure` out, no streamlit calls.

Colour everywhere is log10(error / tolerance) on one diverging scale, blue (passes by far) through
white (the pass line, 0) to red (fails by far), so every tensor is judged on the same picture.
Heatmap cells are square scatter markers, not a `go.Heatmap`: Streamlit returns an empty selection
for clicks on heatmap traces (streamlit#8760), while scatter points carry their customdata back.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.colors as plotly_colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ttrace_dashboard.cells import KIND_LABELS, LOG_RATIO_LIMIT
from ttrace_dashboard.colours import faded_colour
from ttrace_core.api import KINDS, display_fqn

RATIO_SCALE = [[0.0, "#2166ac"], [0.35, "#92c5de"], [0.5, "#f7f7f7"], [0.5001, "#fddbc7"], [0.75, "#ef8a62"],
               [1.0, "#67001f"]]
CATEGORY_STYLE = {
    "nan": ("NaN in the candidate", "#c51bdd"),
    "inf": ("Inf in the candidate", "#6d4c41"),
    "missing": ("missing in one run", "#9e9e9e"),
    "structure": ("shape / dtype / layout differs", "#ff9800"),
}
PHASE_COLOURS = {"initial": "rgba(128,128,128,0.12)", "forward": "rgba(66,133,244,0.12)", "backward": "rgba(244,140,66,0.12)", "grad": "rgba(76,175,80,0.12)",
                 "param": "rgba(156,39,176,0.12)"}
"""Translucent, so the bands read on Streamlit's light and dark themes alike."""
NEUTRAL = "rgba(128,128,128,0.9)"
"""Lines and frames drawn on the plot: mid grey reads on a light and a dark background. Text carries no colour
of its own: it takes the theme's (Streamlit's `theme="streamlit"` follows the browser's light or dark mode)."""
ROW_HEIGHT = 18
LABEL_CHAR_PX = 6.2
MAX_LABEL_PX = 420
TIMELINE_GL_POINTS = 3000
"""Above this many points the timeline is drawn with WebGL (scattergl): SVG markers slow the browser."""
FIRST_DIVERGENCE_COLOUR = "#ffd400"
PHASE_NAME_PX = 14
"""The timeline's phase names stand above the plot on two lines this far apart, alternating."""
FOCUS_COLOUR = "#9e9e9e"
"""The frame around the heatmap row a link asked for (`module` in the URL)."""
MATRIX_PLOT_PX = 1100
"""The layout matrix sizes its cells to fit about this plot width (the page is wide)."""
AFTER_FIRST = "after the first divergence"
"""The layout matrix's trace of cells that ran only after their layout's first divergence (drawn faded)."""


def _colour_axis() -> dict:
    return dict(colorscale=RATIO_SCALE, cmin=-LOG_RATIO_LIMIT, cmax=LOG_RATIO_LIMIT,
                colorbar=dict(title="log10(error/tol)", tickvals=[-4, -2, 0, 2, 4],
                              ticktext=["≤1e-4", "1e-2", "1 (pass line)", "1e2", "≥1e4"]))


def _clickable(points: pd.DataFrame) -> dict:
    return dict(customdata=points[["tensor", "step", "micro_batch"]].astype(object).values.tolist(),
                text=points["hover"].tolist(), hovertemplate="%{text}<extra></extra>")


def _layer_bands(rows: pd.DataFrame) -> list[dict]:
    """A light band behind every other layer, and a line where the pipeline stage changes."""
    shapes = []
    for layer, group in rows.dropna(subset=["layer"]).groupby("layer"):
        if int(layer) % 2 == 0:
            shapes.append(dict(type="rect", xref="paper", x0=0, x1=1, y0=group["row"].min() - 0.5,
                               y1=group["row"].max() + 0.5, fillcolor="rgba(128,128,128,0.12)", line_width=0, layer="below"))
    stages = rows["stage"].ffill()
    for row in rows["row"][stages.ne(stages.shift()) & stages.notna()].iloc[1:]:
        shapes.append(dict(type="line", xref="paper", x0=0, x1=1, y0=row - 0.5, y1=row - 0.5,
                           line=dict(color=NEUTRAL, width=2, dash="dash")))
    return shapes


def _stage_annotations(rows: pd.DataFrame) -> list[dict]:
    starts = rows.dropna(subset=["stage"]).drop_duplicates("stage")
    if len(starts) < 2:
        return []
    return [dict(xref="paper", yref="y", x=1.0, y=r["row"], xanchor="left", text=f"stage {int(r['stage'])}", showarrow=False,
                 font=dict(size=11)) for _, r in starts.iterrows()]


def _row_labels(rows: pd.DataFrame, focus: str | None = None) -> list[dict]:
    """Module names as annotations, not tick labels: plotly measures every tick label's box on each
    draw, which took 20+ s for the 774 rows of a 48-layer model (benchmarks/results/dashboard.md);
    annotations draw in well under a second. The `focus` module's name is bold."""
    def label(module: str) -> str:
        text = display_fqn(module)
        return f"<b>{text}</b>" if module == focus else text

    return [dict(xref="paper", yref="y", x=0, y=row, xanchor="right", xshift=-6, showarrow=False, text=label(module),
                 font=dict(size=11)) for module, row in zip(rows["module"], rows["row"])]


def _focus_outline(rows: pd.DataFrame, focus: str | None) -> list[dict]:
    """A dark frame around the `focus` module's row (the one a link, e.g. a layout matrix cell, points at)."""
    matched = rows.loc[rows["module"] == focus, "row"]
    return [dict(type="rect", xref="paper", x0=0, x1=1, y0=row - 0.5, y1=row + 0.5, fillcolor="rgba(0,0,0,0)",
                 line=dict(color=FOCUS_COLOUR, width=2), layer="above") for row in matched]


HEATMAP_COLUMN_PX = 72
"""The heatmap's column pitch: its width is set from it (the page draws it at that width, narrower only when the
page is), so the module names no longer squeeze the columns until their headers ran into each other ("param
grad param after step"). A header's longest line (`kind_header`) fits in it level."""
HEADER_CHAR_PX = 6.5
"""Width of one character of a column header (plotly's default 12 px font), rounded up."""
HEADER_ANGLES = dict(autotickangles=[0, -90], automargin=True)
"""On a page narrower than the figure the headers stand upright rather than overlap (plotly takes the first
angle at which no two labels overlap; upright, a label needs only its line height), the top margin growing
to hold them."""


def kind_header(kind: str) -> str:
    """A heatmap column's header on two lines ("param<br>after step"), half the width of one."""
    return KIND_LABELS[kind].replace(" ", "<br>", 1)


def heatmap_plot_px() -> int:
    """The plot area's width: every column's pitch, over the axis range of -0.6 to len(KINDS) - 0.4."""
    return round((len(KINDS) + 0.2) * HEATMAP_COLUMN_PX)


def heatmap_figure(cells: pd.DataFrame, rows: pd.DataFrame, first: tuple[str, str] | None = None,
                   focus: str | None = None) -> go.Figure:
    """Modules (rows, execution order) x tensor kinds (columns); the `first` (module, kind) cell is outlined (a
    click on it opens what the cell points at: `cells.pointing_at_first` makes that the first divergence);
    the `focus` row (a module, or a layer when rows are layers) is framed and its label bold."""
    figure = go.Figure()
    # Reading order (top row first, left to right), so the first marker in the page is the top-left cell.
    numeric = cells[cells["category"] == "ratio"].sort_values(["row", "column"])
    figure.add_trace(go.Scatter(x=numeric["column"], y=numeric["row"], mode="markers", name="error / tolerance",
                                marker=dict(symbol="square", size=14, color=numeric["value"], line=dict(width=0.5, color="#888"),
                                            **_colour_axis()), showlegend=False, **_clickable(numeric)))
    for name, (label, colour) in CATEGORY_STYLE.items():
        special = cells[cells["category"] == name]
        if not special.empty:
            figure.add_trace(go.Scatter(x=special["column"], y=special["row"], mode="markers", name=label,
                                        marker=dict(symbol="square", size=14, color=colour), **_clickable(special)))
    if first is not None:
        marked = cells[(cells["module"] == first[0]) & (cells["kind"] == first[1])]
        figure.add_trace(go.Scatter(x=marked["column"], y=marked["row"], mode="markers", name="first divergence",
                                    marker=dict(symbol="square-open", size=22, color=FIRST_DIVERGENCE_COLOUR,
                                                line=dict(width=3, color=FIRST_DIVERGENCE_COLOUR)), **_clickable(marked)))
    labels = _row_labels(rows, focus)
    margin = dict(l=min(MAX_LABEL_PX, 12 + LABEL_CHAR_PX * max((len(a["text"]) for a in labels), default=4)), r=80,
                  t=40, b=10)
    figure.update_layout(
        height=max(360, ROW_HEIGHT * len(rows) + 160), width=margin["l"] + heatmap_plot_px() + margin["r"], margin=margin,
        shapes=_layer_bands(rows) + _focus_outline(rows, focus), annotations=_stage_annotations(rows) + labels, clickmode="event+select", dragmode=False,
        legend=dict(orientation="h", y=-0.01, x=0, yanchor="top"),
        xaxis=dict(tickvals=list(range(len(KINDS))), ticktext=[kind_header(k) for k in KINDS], side="top",
                   range=[-0.6, len(KINDS) - 0.4], fixedrange=True, **HEADER_ANGLES),
        yaxis=dict(tickvals=rows["row"].tolist(), showticklabels=False, autorange="reversed", fixedrange=True),
    )
    return figure


def timeline_figure(points: pd.DataFrame, first_order: int | None) -> go.Figure:
    """log10(ratio) along execution order, with the phases as bands and the first divergence marked."""
    figure = go.Figure()
    for band, (phase, group) in enumerate(points.groupby("phase", sort=False)):
        start = group["order"].min() - 0.5
        figure.add_vrect(x0=start, x1=group["order"].max() + 0.5, fillcolor=PHASE_COLOURS.get(phase, "rgba(128,128,128,0.12)"),
                         line_width=0, layer="below")
        # Above the plot, every other name a line higher: inside it they sat on the worst points, and next to a
        # narrow band (the initial values, the reduced gradients) two names ran together ("initialforward").
        figure.add_annotation(x=start, xref="x", xanchor="left", y=1, yref="paper", yanchor="bottom", text=phase,
                              showarrow=False, yshift=PHASE_NAME_PX * (band % 2))
    numeric = points[points["category"] == "ratio"]
    scatter = go.Scattergl if len(points) > TIMELINE_GL_POINTS else go.Scatter
    figure.add_trace(scatter(x=numeric["order"], y=numeric["value"], mode="markers", showlegend=False,
                                marker=dict(size=6, color=numeric["value"], **{**_colour_axis(), "showscale": False}),
                                **_clickable(numeric)))
    for name, (label, colour) in CATEGORY_STYLE.items():
        special = points[points["category"] == name]
        if not special.empty:
            figure.add_trace(go.Scatter(x=special["order"], y=[LOG_RATIO_LIMIT] * len(special), mode="markers", name=label,
                                        marker=dict(symbol="x", size=8, color=colour), **_clickable(special)))
    figure.add_hline(y=0, line=dict(color=NEUTRAL, width=1, dash="dot"), annotation_text="pass line")
    if first_order is not None:
        # At the bottom, away from the phase names above the plot (beside them the two ran together: "gradfirst divergence").
        figure.add_vline(x=first_order, line=dict(color=FIRST_DIVERGENCE_COLOUR, width=3),
                         annotation_text="first divergence", annotation_position="bottom right")
    figure.update_layout(height=300, margin=dict(l=10, r=10, t=20 + 2 * PHASE_NAME_PX, b=10), dragmode=False,
                         xaxis=dict(title="execution order"),
                         yaxis=dict(title="log10(error/tol)", range=[-LOG_RATIO_LIMIT - 0.3, LOG_RATIO_LIMIT + 0.3]))
    return figure


def _log_axis(values, title: str) -> dict:
    """A log axis labelled at whole decades ("1e-05"), a label every `dtick` decades so that at most about six show:
    plotly's own choice put 2 and 5 between decades, and the labels ran into each other."""
    finite = [math.log10(v) for v in np.asarray(values, dtype=float).ravel() if np.isfinite(v) and v > 0]
    decades = (max(finite) - min(finite)) if finite else 1.0
    return dict(type="log", title=title, dtick=max(1, math.ceil(decades / 6)), tickformat=".0e")


def _log_line(figure: go.Figure, value: float, axis: str, text: str, colour: str, dash: str) -> None:
    """A line across the plot at `value` of a log `axis` ("x" or "y"), its label at the line. (add_vline's and
    add_hline's own labels are placed at the raw value on a log axis, not at its log, so they sat away from it.)"""
    position = math.log10(value)
    line = dict(color=colour, dash=dash)
    if axis == "x":
        figure.add_vline(x=value, line=line)
        figure.add_annotation(x=position, xref="x", y=1, yref="paper", yanchor="bottom", xanchor="left", text=text,
                              showarrow=False)
    else:
        figure.add_hline(y=value, line=line)
        figure.add_annotation(y=position, yref="y", x=1, xref="paper", xanchor="right", yanchor="bottom", text=text,
                              showarrow=False)


def difference_image_figure(image: np.ndarray, block: tuple[int, int], view_shape: tuple[int, int]) -> go.Figure:
    """max |candidate - reference| per block of the tensor's 2-D view, on a log colour scale; a vector (a view of
    one row) as bars along its index, with whole-number ticks."""
    if view_shape[0] == 1:
        return _difference_vector_figure(image[0], block[1], view_shape[1])
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.where(image > 0, np.log10(image), np.nan)
    figure = go.Figure(go.Heatmap(z=logged, colorscale="Inferno", colorbar=dict(title="log10 |diff|"),
                                  hovertemplate="block row %{y}, col %{x}<br>log10 max|diff| %{z:.2f}<extra></extra>"))
    figure.update_layout(height=360, margin=dict(l=10, r=10, t=30, b=10),
                         title=dict(text=f"|difference|: {view_shape[0]} x {view_shape[1]} view, "
                                         f"{block[0]} x {block[1]} elements per cell (max)", font=dict(size=12)),
                         yaxis=dict(autorange="reversed"))
    return figure


def _difference_vector_figure(values: np.ndarray, block: int, length: int) -> go.Figure:
    starts = np.arange(len(values)) * block
    shown = np.where(values > 0, values, np.nan)
    figure = go.Figure(go.Bar(x=starts, y=shown, width=block * 0.9, offset=0, marker_color="#b2182b",
                              customdata=np.minimum(starts + block, length) - 1,
                              hovertemplate=("element %{x}" if block == 1 else "elements %{x}-%{customdata}")
                              + ": max |diff| %{y:.3g}<extra></extra>"))
    figure.update_layout(height=360, margin=dict(l=10, r=10, t=30, b=10), bargap=0,
                         title=dict(text=f"|difference| along the vector's {length} elements"
                                         + ("" if block == 1 else f", {block} per bar (max)"), font=dict(size=12)),
                         xaxis=dict(title="element", tickformat="d", range=[-0.5, length - 0.5 + (block - 1)]),
                         yaxis=_log_axis(shown, "max |diff|"))
    return figure


def histogram_figure(edges: np.ndarray, counts: np.ndarray, tolerance_rel: float | None) -> go.Figure:
    centres = np.sqrt(edges[:-1] * edges[1:])
    figure = go.Figure(go.Bar(x=centres, y=counts, width=np.diff(edges) * 0.9, marker_color="#4a6fa5",
                              hovertemplate="rel. error ~%{x:.1e}: %{y} elements<extra></extra>"))
    if tolerance_rel:
        _log_line(figure, tolerance_rel, "x", "tolerance", "#b2182b", "dash")
    shown = list(edges) + ([tolerance_rel] if tolerance_rel else [])
    figure.update_layout(height=300, margin=dict(l=10, r=10, t=30, b=10),
                         xaxis=_log_axis(shown, "|diff| / |reference|"), yaxis=dict(title="elements"), bargap=0)
    return figure


def _shard_colour(error: float | None, tolerance_rel: float | None) -> str:
    if error is None or not tolerance_rel:
        return "#bdbdbd"
    return ratio_colour(-LOG_RATIO_LIMIT if error == 0 else math.log10(error / tolerance_rel))


def shard_map_figure(shards: list, shape: tuple[int, ...], tolerance_rel: float | None, highlight_rank: int | None) -> go.Figure:
    """Which rank holds which slice of each dim; a bar per rank and dim, coloured by that shard's error."""
    dims = [d for d in range(len(shape)) if any(s.region[d] != (0, shape[d]) for s in shards)] or list(range(min(len(shape), 1)))
    figure = make_subplots(rows=1, cols=max(len(dims), 1), subplot_titles=[f"dim {d} (size {shape[d]})" for d in dims] or ["scalar"])
    for column, dim in enumerate(dims, start=1):
        for shard in shards:
            start, stop = shard.region[dim]
            error = "-" if shard.error is None else f"{shard.error:.3g}"
            width = 3 if shard.rank == highlight_rank else 0.5
            figure.add_trace(go.Bar(
                y=[f"rank {shard.rank}"], x=[max(stop - start, 0)], base=[start], orientation="h", showlegend=False,
                marker=dict(color=_shard_colour(shard.error, tolerance_rel), line=dict(color=NEUTRAL, width=width)),
                hovertemplate=(f"rank {shard.rank} {list(shard.coordinate)} {list(shard.placements)}<br>"
                               f"[{start}:{stop}) of dim {dim}<br>local shape {list(shard.local_shape)}<br>"
                               f"error {error} {shard.note}<extra></extra>")), row=1, col=column)
        figure.update_xaxes(range=[0, shape[dim]], row=1, col=column)
    figure.update_layout(height=80 + 28 * len(shards), margin=dict(l=10, r=10, t=40, b=10), barmode="overlay",
                         yaxis=dict(autorange="reversed"))
    return figure


def rank_error_figure(shards: list, tolerance_rel: float | None) -> go.Figure:
    """Per rank: its shard's (or replica's) error against the reference, with the tolerance line."""
    known = [s for s in shards if s.error is not None]
    figure = go.Figure(go.Bar(x=[f"rank {s.rank}" for s in known], y=[max(s.error, 1e-17) for s in known],
                              marker_color=[_shard_colour(s.error, tolerance_rel) for s in known],
                              hovertemplate="%{x}: error %{y:.3g}<extra></extra>"))
    if tolerance_rel:
        _log_line(figure, tolerance_rel, "y", "tolerance", "#b2182b", "dash")
    shown = [max(s.error, 1e-17) for s in known] + ([tolerance_rel] if tolerance_rel else [])
    figure.update_layout(height=260, margin=dict(l=10, r=10, t=30, b=10), yaxis=_log_axis(shown, "relative error"))
    return figure


def history_figure(rows: pd.DataFrame, current: tuple[int, int] | None) -> go.Figure:
    """One tensor's ratio over steps and micro-batches."""
    labels = [f"s{s}" + ("" if m < 0 else f" mb{m}") for s, m in zip(rows["step"], rows["micro_batch"])]
    ratios = rows["ratio"].astype(float).fillna(np.nan).clip(lower=1e-8)
    colours = ["#b2182b" if status != "pass" else "#2166ac" for status in rows["status"]]
    widths = [3 if current == (s, m) else 0 for s, m in zip(rows["step"], rows["micro_batch"])]
    figure = go.Figure(go.Bar(x=labels, y=ratios, marker=dict(color=colours, line=dict(width=widths, color=NEUTRAL)),
                              hovertemplate="%{x}: ratio %{y:.3g}<extra></extra>"))
    _log_line(figure, 1.0, "y", "pass line", NEUTRAL, "dot")
    figure.update_layout(height=260, margin=dict(l=10, r=10, t=30, b=10),
                         yaxis=_log_axis(list(ratios) + [1.0], "error / tolerance"))
    return figure


def _matrix_marker_px(num_columns: int) -> float:
    """Square cells that fit about 1100 px of plot width: 16 px for a small model, 6 px for 200 columns."""
    return float(np.clip(MATRIX_PLOT_PX / max(num_columns, 1), 6, 16))


def _matrix_clickable(points: pd.DataFrame) -> dict:
    return dict(customdata=points[["layout", "source_module"]].astype(object).values.tolist(),
                text=points["hover"].tolist(), hovertemplate="%{text}<extra></extra>")


def _after_first(points: pd.DataFrame) -> pd.Series:
    """Cells that ran only after their layout's first divergence (they inherit it): drawn faded."""
    after = points["after_first"] if "after_first" in points else pd.Series(False, index=points.index)
    return after.astype(bool)


def ratio_colour(value: float) -> str:
    """The colour scale's colour of one log10(error / tolerance)."""
    fraction = (float(np.clip(value, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)) + LOG_RATIO_LIMIT) / (2 * LOG_RATIO_LIMIT)
    return plotly_colors.sample_colorscale(RATIO_SCALE, [fraction])[0]


def matrix_figure(cells: pd.DataFrame, layouts: list[str], columns: list[str], pending: list[str] = ()) -> go.Figure:
    """Candidate layouts (rows, in `layouts` order) x modules or layers (`columns`, execution order), each cell
    the layout's worst log10(error / tolerance) there; every layout's first divergence is outlined, and a
    click carries [layout, module]. A layout in `pending` has no cells yet: its row says so."""
    size = _matrix_marker_px(len(columns))
    figure = go.Figure()
    # Every layout gets its row, even one without cells yet (a category axis shows only categories with points).
    figure.add_trace(go.Scatter(x=[-0.5] * len(layouts), y=list(layouts), mode="markers", marker=dict(opacity=0),
                                hoverinfo="skip", showlegend=False, name="rows"))
    numeric = cells[cells["category"] == "ratio"]
    # The colour bar lies above the plot: on its right it had the plot's height, 15 px for two layouts.
    colour_axis = _colour_axis()
    colour_axis["colorbar"].update(orientation="h", lenmode="pixels", len=360, thickness=12, x=1.0, xanchor="right",
                                   y=1.0, yanchor="bottom", title=dict(text="log10(error/tol)", side="top"))
    faded = numeric[_after_first(numeric)]
    numeric = numeric[~_after_first(numeric)]
    figure.add_trace(go.Scatter(x=numeric["column"], y=numeric["layout"], mode="markers", name="error / tolerance",
                                marker=dict(symbol="square", size=size, color=numeric["value"],
                                            line=dict(width=0.5, color="#888"), **colour_axis),
                                showlegend=False, **_matrix_clickable(numeric)))
    # Faded by colour, not opacity: one contrast on the light and the dark theme (colours.faded_colour).
    figure.add_trace(go.Scatter(x=faded["column"], y=faded["layout"], mode="markers", name=AFTER_FIRST,
                                marker=dict(symbol="square", size=size, line=dict(width=0.5, color="#888"),
                                            color=[faded_colour(ratio_colour(v)) for v in faded["value"]]),
                                showlegend=False, **_matrix_clickable(faded)))
    for name, (label, colour) in CATEGORY_STYLE.items():
        special = cells[cells["category"] == name]
        if not special.empty:
            colours = [faded_colour(colour) if after else colour for after in _after_first(special)]
            figure.add_trace(go.Scatter(x=special["column"], y=special["layout"], mode="markers", name=label,
                                        marker=dict(symbol="square", size=size, color=colours),
                                        **_matrix_clickable(special)))
    firsts = cells[cells["first_divergence"].astype(bool)]
    if not firsts.empty:
        figure.add_trace(go.Scatter(x=firsts["column"], y=firsts["layout"], mode="markers", name="first divergence",
                                    marker=dict(symbol="square-open", size=size + 8, color=FIRST_DIVERGENCE_COLOUR,
                                                line=dict(width=3, color=FIRST_DIVERGENCE_COLOUR)),
                                    **_matrix_clickable(firsts)))
    notes = [dict(xref="paper", yref="y", x=0.5, y=layout, showarrow=False, text="not compared yet: open its heatmap",
                  font=dict(size=12)) for layout in pending]
    longest_column = max((len(c) for c in columns), default=4)
    figure.update_layout(
        height=max(320, 60 + 34 * len(layouts) + min(MAX_LABEL_PX, 40 + 5.4 * longest_column)),
        margin=dict(l=min(MAX_LABEL_PX, 12 + LABEL_CHAR_PX * max((len(l) for l in layouts), default=4)), r=20, t=90,
                    b=min(MAX_LABEL_PX, 20 + 5.4 * longest_column)),
        annotations=notes, clickmode="event+select", dragmode=False, legend=dict(orientation="h", y=1.0, x=0, yanchor="bottom"),
        xaxis=dict(tickvals=list(range(len(columns))), ticktext=[display_fqn(c) for c in columns], tickangle=-60,
                   tickfont=dict(size=10), range=[-0.6, len(columns) - 0.4], fixedrange=True, showgrid=False),
        yaxis=dict(type="category", categoryarray=list(layouts), categoryorder="array", autorange="reversed",
                   fixedrange=True, tickfont=dict(size=12)),
    )
    return figure
