import math

import pandas as pd
import pytest

from ttrace_dashboard import figures, matrix
from ttrace_dashboard.colours import faded_colour
from tests.synthetic_runs import write_pair
from ttrace_core import api

BUG, CLEAN = "tp2/bug", "tp2/clean"


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    return api.comparison(*write_pair(tmp_path_factory.mktemp("runs")))


@pytest.fixture(scope="module")
def tables(frame):
    # The clean layout: every tensor of the same run, passing at half its tolerance.
    clean = frame.assign(status="pass", passed=True, ratio=0.5, num_nan_candidate=0, num_nan_reference=0)
    return {BUG: frame, CLEAN: clean}


def test_a_cell_is_the_layouts_worst_tensor_up_to_its_first_divergence(tables, frame):
    view = matrix.matrix_cells(tables, "modules").set_index(["layout", "module"])
    assert matrix.matrix_columns(view.reset_index()) == ["layers.0.lin", "layers.0.act", "layers.1.norm", "layers.1.lin",
                                                         "layers.1.out"]
    act = view.loc[(BUG, "layers.0.act")]
    assert (act["row"], act["column"], act["category"], act["status"]) == (0, 1, "ratio", "mismatch")
    # mb 0's 6.3e4, the first divergence; mb 1's 7.6e4 came after it (issue 41: a cell took the worst over the whole
    # run, so a buggy layout was dark red in every column, upstream of its bug too)
    assert act["ratio"] == frame.loc[frame["module"] == "layers.0.act", "ratio"].iloc[0] < 7e4
    assert act["value"] == 4.0 and not act["after_first"]  # clipped at the scale's end
    assert act["hover"] == ("<b>tp2/bug</b><br>layers.0.act<br>worst: forward/layers.0.act/output.0 (step 0)<br>"
                            "ratio 6.29e+04 · mismatch<br><b>first divergence of this layout</b>")
    assert view.loc[(BUG, "layers.1.norm"), "after_first"] and "inherits it" in view.loc[(BUG, "layers.1.norm"), "hover"]
    assert not view.loc[CLEAN, "after_first"].any()
    norm = view.loc[(BUG, "layers.1.norm")]
    assert norm["value"] == math.log10(frame.loc[frame["module"] == "layers.1.norm", "ratio"].max())
    assert view.loc[(BUG, "layers.1.lin"), "category"] == "nan"
    assert view.loc[(BUG, "layers.1.out"), "category"] == "missing"
    lin = view.loc[(BUG, "layers.0.lin")]  # output (two micro-batches) and weight gradient, all exact
    assert (lin["value"], lin["category"], lin["tensor"]) == (-4.0, "ratio", "forward/layers.0.lin/output.0")
    clean = view.loc[CLEAN]
    assert clean["row"].tolist() == [1] * 5 and clean["value"].tolist() == [math.log10(0.5)] * 5
    assert set(clean["category"]) == {"ratio"}


def test_only_each_layouts_first_divergence_is_flagged(tables):
    view = matrix.matrix_cells(tables, "modules")
    assert view.loc[view["first_divergence"], ["layout", "module"]].values.tolist() == [[BUG, "layers.0.act"]]


def test_layers_fold_every_module_of_a_layer_into_one_column(tables):
    view = matrix.matrix_cells(tables, "layers").set_index(["layout", "module"])
    assert matrix.matrix_columns(view.reset_index()) == ["layers.0", "layers.1"]
    first = view.loc[(BUG, "layers.0")]
    assert (first["source_module"], first["value"], first["first_divergence"]) == ("layers.0.act", 4.0, True)
    assert "<br>layers.0 (layers.0.act)<br>" in first["hover"]
    second = view.loc[(BUG, "layers.1")]  # the worst of norm (drift), lin (NaN) and out (missing): the NaN
    assert (second["category"], second["source_module"], second["first_divergence"]) == ("nan", "layers.1.lin", False)
    assert view.loc[(CLEAN, "layers.1"), "value"] == math.log10(0.5)


def test_a_module_only_one_layout_ran_goes_after_its_predecessor():
    def modules(*names: str) -> pd.DataFrame:
        return pd.DataFrame({"module": list(names), "order": range(len(names)), "layer": None, "stage": None})

    assert matrix.column_order([modules("emb", "a", "b", "head"), modules("emb", "a", "fp8_scale", "b", "head"),
                                modules("pre", "emb")]) == ["pre", "emb", "a", "fp8_scale", "b", "head"]


def test_no_tables_no_cells():
    assert matrix.matrix_cells({}, "layers").columns.tolist() == matrix.CELL_COLUMNS
    with pytest.raises(ValueError, match="rows_by"):
        matrix.folded(pd.DataFrame({"module": []}), "pixels")


@pytest.mark.parametrize("event, expected", [
    (None, None),
    ({"selection": {"points": []}}, None),
    ({"selection": {"points": [{"x": 1, "y": "tp2/bug"}]}}, None),
    ({"selection": {"points": [{"customdata": ["tp2/bug", "layers.0.act"]}]}}, ("tp2/bug", "layers.0.act")),
], ids=["no-event", "nothing-selected", "point-without-customdata", "cell"])
def test_a_click_names_the_layout_and_module(event, expected):
    assert matrix.clicked_cell(event) == expected


def test_matrix_figure_rows_are_layouts_and_outlines_open_the_first_divergence(tables):
    view = matrix.matrix_cells(tables, "modules")
    columns = matrix.matrix_columns(view)
    figure = figures.matrix_figure(view, [BUG, CLEAN, "tp4/large"], columns, pending=["tp4/large"])
    traces = {trace.name: trace for trace in figure.data}
    assert list(traces["rows"].y) == [BUG, CLEAN, "tp4/large"]  # a pending layout keeps its row
    assert [a.text for a in figure.layout.annotations if a.y == "tp4/large"] == ["not compared yet: open its heatmap"]
    outline = traces["first divergence"]
    assert [list(p) for p in outline.customdata] == [[BUG, "layers.0.act"]] and list(outline.x) == [1]
    assert outline.marker.color == figures.FIRST_DIVERGENCE_COLOUR and outline.marker.symbol == "square-open"
    # the NaN ran after the first divergence: its category's colour, faded
    assert list(traces["NaN in the candidate"].marker.color) == [faded_colour(figures.CATEGORY_STYLE["nan"][1])]
    assert list(figure.layout.xaxis.ticktext) == columns and list(figure.layout.yaxis.categoryarray) == [BUG, CLEAN,
                                                                                                        "tp4/large"]
    numeric = traces["error / tolerance"]
    assert numeric.marker.cmin == -4 and numeric.marker.cmax == 4 and numeric.marker.size == 16
    # cells only reached after the layout's first divergence are faded, in their own trace
    faded = traces[figures.AFTER_FIRST]
    assert set(zip(faded.y, faded.x)) == {(BUG, 2)}  # layers.1.norm (lin and out are NaN and missing, in their own traces)
    assert (BUG, 2) not in set(zip(numeric.y, numeric.x))
    # the colour bar lies above the plot, wide enough to read (on the right it was the plot's height: 15 px)
    bar = numeric.marker.colorbar
    assert bar.orientation == "h" and bar.lenmode == "pixels" and bar.len >= 300


@pytest.mark.parametrize("value", [-4.0, -2.0, -0.5, 0.0, 0.01, 1.0, 2.0, 4.0], ids=lambda v: f"log-ratio{v:+g}")
def test_faded_cells_keep_one_contrast_on_the_light_and_the_dark_theme(tables, value):
    """Issue 41: faded by opacity, a cell mixed into the page: a light pink on white, a near-black maroon on the dark
    theme. Faded by colour, it contrasts alike with both backgrounds, as much as mid-grey text does."""
    from ttrace_dashboard.colours import DARK_BACKGROUND, LIGHT_BACKGROUND, contrast_ratio, faded_colour

    colour = faded_colour(figures.ratio_colour(value))
    on_light, on_dark = contrast_ratio(colour, LIGHT_BACKGROUND), contrast_ratio(colour, DARK_BACKGROUND)
    assert on_light >= 4 and on_dark >= 4 and abs(on_light / on_dark - 1) < 0.1, (colour, on_light, on_dark)
    # still the hue of its side of the pass line: red above it, blue below
    red, _, blue = (int(c) for c in colour[4:-1].split(","))
    assert (red > blue) == (value > 0) or value == 0, colour


def test_no_matrix_cell_is_faded_by_opacity(tables):
    view = matrix.matrix_cells(tables, "modules")
    figure = figures.matrix_figure(view, [BUG, CLEAN], matrix.matrix_columns(view))
    cells = [trace for trace in figure.data if trace.name != "rows"]
    assert all(trace.marker.opacity in (None, 1) for trace in cells)  # opacity blends with the theme's background
