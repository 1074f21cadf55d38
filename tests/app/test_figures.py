import numpy as np
import pandas as pd
import pytest

from ttrace_dashboard import cells, figures
from tests.synthetic_runs import write_pair
from ttrace_core import api


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    return api.comparison(*write_pair(tmp_path_factory.mktemp("runs")))


def _traces(figure) -> dict:
    return {trace.name: trace for trace in figure.data}


def test_heatmap_cells_are_clickable_square_markers_on_one_diverging_scale(frame):
    rows, view = cells.module_rows(frame), cells.heatmap_cells(frame, 0, "all")
    first = cells.first_divergence(frame)
    figure = figures.heatmap_figure(cells.pointing_at_first(view, first, first["module"]), rows, ("layers.0.act", "output"))
    traces = _traces(figure)
    assert all(trace.type == "scatter" for trace in figure.data)  # heatmap traces return no click selection
    numeric = traces["error / tolerance"]
    assert numeric.marker.symbol == "square" and numeric.marker.cmin == -4 and numeric.marker.cmax == 4
    assert all(len(point) == 3 for trace in figure.data for point in trace.customdata)
    assert traces["first divergence"].customdata[0][0] == "forward/layers.0.act/output.0"
    assert traces["NaN in the candidate"].marker.color == figures.CATEGORY_STYLE["nan"][1]
    labels = [a for a in figure.layout.annotations if a.xanchor == "right"]  # drawn as annotations: tick labels are slow
    assert [(a.text, a.y) for a in labels] == list(zip(rows["module"], rows["row"]))
    assert figure.layout.yaxis.showticklabels is False


def test_a_click_anywhere_in_the_outlined_cell_opens_the_first_divergence(frame):
    # Issue 41: the cell's worst (mb 1, the larger ratio) sat under the outline (mb 0, the first divergence); at the
    # cell's centre the two markers tie and plotly picked the cell's worst, whose hover it showed too.
    first = cells.first_divergence(frame)
    view = cells.heatmap_cells(frame, 0, "all")
    at = (view["module"] == first["module"]) & (view["kind"] == first["kind"])
    assert view.loc[at, "micro_batch"].tolist() == [1]  # the cell's worst is another tensor than the first divergence
    pointed = cells.pointing_at_first(view, first, first["module"])
    figure = figures.heatmap_figure(pointed, cells.module_rows(frame), (first["module"], first["kind"]))
    column = cells.KINDS.index(first["kind"]) if hasattr(cells, "KINDS") else None
    row = int(cells.module_rows(frame).set_index("module").loc[first["module"], "row"])
    under_click = [(trace.name, list(data), text) for trace in figure.data if trace.customdata is not None
                   for x, y, data, text in zip(trace.x, trace.y, trace.customdata, trace.text)
                   if y == row and (column is None or x == column)]
    assert {name for name, _, _ in under_click} == {"error / tolerance", "first divergence"}
    assert all(data == [first["tensor"], 0, 0] for _, data, _ in under_click)
    assert all("first divergence" in text and "mb 0" in text for _, _, text in under_click)
    assert pointed.loc[at, "value"].tolist() == view.loc[at, "value"].tolist()  # the colour stays the cell's worst


def test_heatmap_markers_come_in_reading_order(frame):
    # The first marker in the page is the top-left cell: the DOM order a keyboard or a probe walks.
    view = cells.heatmap_cells(frame, 0, "all").sample(frac=1.0, random_state=0)
    numeric = _traces(figures.heatmap_figure(view, cells.module_rows(frame)))["error / tolerance"]
    positions = list(zip(numeric.y, numeric.x))
    assert len(positions) > 3 and positions == sorted(positions)


def test_pipeline_stages_are_marked(frame):
    staged = frame.assign(stage=[0 if layer == 0 else 1 for layer in frame["layer"]])
    rows = cells.module_rows(staged)
    figure = figures.heatmap_figure(cells.heatmap_cells(staged, 0, "all"), rows)
    assert [a.text for a in figure.layout.annotations if a.text.startswith("stage")] == ["stage 0", "stage 1"]
    assert any(shape.type == "line" and shape.y0 == 1.5 for shape in figure.layout.shapes)


def test_timeline_marks_the_first_divergence_and_the_pass_line(frame):
    points = cells.timeline_points(frame, 0)
    figure = figures.timeline_figure(points, first_order=1)
    assert any(shape.type == "line" and shape.x0 == 1 for shape in figure.layout.shapes)
    assert {a.text for a in figure.layout.annotations} >= {"first divergence", "pass line", "forward", "grad"}


def test_tensor_figures_draw_the_view(frame, tmp_path):
    reference, candidate = write_pair(tmp_path)
    view = api.tensor_view(reference, candidate, "forward/layers.0.act/output.0", 0, 0)
    shard_map = figures.shard_map_figure(view.shards, view.shape, 1e-5, highlight_rank=1)
    bars = [(trace.y[0], trace.base[0], trace.x[0]) for trace in shard_map.data]
    assert bars == [("rank 0", 0, 4), ("rank 1", 4, 4)]  # rows 0:4 and 4:8 of dim 0
    assert shard_map.data[1].marker.line.width == 3  # the highlighted rank
    image = figures.difference_image_figure(view.image, view.image_block, view.image_view_shape)
    assert np.isnan(image.data[0].z[0]).all() and np.nanmax(image.data[0].z) == pytest.approx(0.0, abs=1e-6)
    histogram = figures.histogram_figure(view.histogram_edges, view.histogram_counts, 1e-5)
    assert histogram.data[0].y.sum() == 24 and histogram.layout.xaxis.type == "log"
    history = figures.history_figure(cells.history(frame, "forward/layers.0.act/output.0"), (0, 0))
    assert list(history.data[0].x) == ["s0 mb0", "s0 mb1"]
    assert figures.rank_error_figure(view.shards, 1e-5).data[0].x == ("rank 0", "rank 1")


@pytest.mark.parametrize("focus, framed_row", [("layers.1.lin", 3), ("nowhere", None), (None, None)],
                         ids=["module-framed", "unknown-module", "no-focus"])
def test_heatmap_frames_the_row_a_link_points_at(frame, focus, framed_row):
    rows = cells.module_rows(frame)
    figure = figures.heatmap_figure(cells.heatmap_cells(frame, 0, "all"), rows, focus=focus)
    framed = [(s.y0, s.y1) for s in figure.layout.shapes if s.type == "rect" and s.line.color == figures.FOCUS_COLOUR]
    assert framed == ([] if framed_row is None else [(framed_row - 0.5, framed_row + 0.5)])
    bold = [a.text for a in figure.layout.annotations if a.text.startswith("<b>")]
    assert bold == ([] if framed_row is None else [f"<b>{focus}</b>"])


def test_heatmap_timeline_and_matrix_leave_background_and_text_to_the_theme(frame):
    """Issue 41: in dark mode the plots kept a white plot area with grey labels on it. Streamlit's theme follows the
    browser; a figure that sets neither background nor text colour follows it too."""
    from ttrace_dashboard import matrix

    staged = frame.assign(stage=[0 if layer == 0 else 1 for layer in frame["layer"]])
    drawn = [figures.heatmap_figure(cells.heatmap_cells(staged, 0, "all"), cells.module_rows(staged), focus="layers.0.lin"),
             figures.timeline_figure(cells.timeline_points(frame, 0), first_order=1)]
    view = matrix.matrix_cells({"tp2": frame}, "modules")
    drawn.append(figures.matrix_figure(view, ["tp2", "tp4"], matrix.matrix_columns(view), pending=["tp4"]))
    for figure in drawn:
        assert figure.layout.plot_bgcolor is None and figure.layout.paper_bgcolor is None
        assert figure.layout.annotations and all(a.font.color is None for a in figure.layout.annotations)
        for shape in figure.layout.shapes:  # bands translucent, lines mid grey: readable on white and on black
            assert shape.fillcolor in (None, "rgba(0,0,0,0)") or shape.fillcolor.startswith("rgba"), shape.fillcolor


def test_a_vector_is_drawn_as_a_vector_with_whole_number_ticks():
    # Issue 41: a 16-element vector was wrapped into a 4 x 4 image with half-integer ticks.
    from ttrace_core.service.tensor_view import as_matrix, max_pool

    diff = np.zeros(16)
    diff[11] = 0.5
    image, block = max_pool(as_matrix(diff))
    figure = figures.difference_image_figure(image, block, (1, 16))
    (bars,) = figure.data
    assert bars.type == "bar" and list(bars.x) == list(range(16)) and figure.layout.xaxis.tickformat == "d"
    assert np.nanargmax(np.asarray(bars.y, dtype=float)) == 11


def test_tolerance_labels_sit_on_their_lines_and_log_ticks_are_whole_decades(frame, tmp_path):
    # Issue 41: add_vline/add_hline put their labels at the raw value on a log axis (away from the line), and
    # plotly's log ticks (2, 5 between decades) ran into each other.
    import math

    reference, candidate = write_pair(tmp_path)
    view = api.tensor_view(reference, candidate, "forward/layers.0.act/output.0", 0, 0)
    tolerance = 1e-5
    histogram = figures.histogram_figure(view.histogram_edges, view.histogram_counts, tolerance)
    ranks = figures.rank_error_figure(view.shards, tolerance)
    history = figures.history_figure(cells.history(frame, "forward/layers.0.act/output.0"), (0, 0))
    for figure, axis, value, text in ((histogram, "x", tolerance, "tolerance"), (ranks, "y", tolerance, "tolerance"),
                                      (history, "y", 1.0, "pass line")):
        (label,) = [a for a in figure.layout.annotations if a.text == text]
        assert getattr(label, axis) == pytest.approx(math.log10(value))  # on a log axis, positions are log10
        log_axis = getattr(figure.layout, f"{axis}axis")
        assert log_axis.type == "log" and log_axis.tickformat == ".0e" and log_axis.dtick >= 1


def test_the_status_is_said_in_words_and_the_words_are_explained():
    row = {"status": "replica_drift", "message": "replica drift ratio 1.09e+05", "value_ratio": 1.0}
    assert cells.verdict_banner(row).startswith("**replica drift** · ")
    assert set(cells.STATUS_WORDS) >= set(cells.CATEGORY_OF_STATUS) | {"nonfinite"}
    for word in ("**ratio**", "**mismatch**", "**replica drift**"):
        assert word in cells.GLOSSARY


def test_initial_parameter_values_neither_lead_the_rows_nor_stretch_the_parameter_band(frame):
    """Issue 41: on torch-gpt runs the heatmap rows and the timeline started with the initial parameter values
    (recorded before the forward, in registration order), against their own captions."""
    initial = frame[frame["tensor"] == "grad/layers.0.lin.weight/grad"].assign(
        phase="param", kind="param", slot=cells.INITIAL_SLOT, tensor="param/layers.1.norm.weight/value.initial",
        module="layers.1.norm", order=-1)
    with_initial = pd.concat([initial, frame], ignore_index=True)
    assert list(cells.module_rows(with_initial)["module"]) == list(cells.module_rows(frame)["module"])
    points = cells.timeline_points(with_initial, 0)
    assert points.iloc[0]["phase"] == "initial" and points.iloc[0]["order"] == -1
    assert (points.loc[points["phase"] != "initial", "order"] >= 0).all()
    figure = figures.timeline_figure(points, first_order=1)
    bands = {a.text: a for a in figure.layout.annotations if a.text in ("initial", "forward", "grad")}
    assert set(bands) == {"initial", "forward", "grad"}
    assert bands["initial"].yshift != bands["forward"].yshift  # neighbours on two lines, not run together
    (first,) = [a for a in figure.layout.annotations if a.text == "first divergence"]
    assert first.yanchor == "bottom" or first.y < 0.5  # not at the top, where the phase names are


def test_heatmap_headers_fit_their_columns_level_and_stand_up_on_a_narrower_page(frame):
    """Issue 41: the column headers ran into each other ("param grad param after step") when the module names took
    most of the width. The figure now has its own width, whose column pitch holds the longest header line level
    with room to spare; on a page narrower than that, plotly stands the headers upright instead of overlapping."""
    figure = figures.heatmap_figure(cells.heatmap_cells(frame, 0, "all"), cells.module_rows(frame))
    layout = figure.layout
    plot_px = layout.width - layout.margin.l - layout.margin.r
    pitch = plot_px / (layout.xaxis.range[1] - layout.xaxis.range[0])
    lines = [line for text in layout.xaxis.ticktext for line in text.split("<br>")]
    assert len(layout.xaxis.ticktext) == len(api.KINDS) and max(map(len, lines)) <= 10, lines
    assert pitch >= max(map(len, lines)) * figures.HEADER_CHAR_PX + 6, (pitch, lines)
    assert list(layout.xaxis.autotickangles) == [0, -90] and layout.xaxis.automargin is True
