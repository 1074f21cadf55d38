import math

import pandas as pd
import pytest

from ttrace_dashboard import figures, matrix
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
    assert traces["NaN in the candidate"].marker.color == figures.CATEGORY_STYLE["nan"][1]
    assert list(figure.layout.xaxis.ticktext) == columns and list(figure.layout.yaxis.categoryarray) == [BUG, CLEAN,
                                                                                                        "tp4/large"]
    numeric = traces["error / tolerance"]
    assert numeric.marker.cmin == -4 and numeric.marker.cmax == 4 and numeric.marker.size == 16
    # cells only reached after the layout's first divergence are faded
    faded = {(y, x) for x, y, o in zip(numeric.x, numeric.y, numeric.marker.opacity) if o < 1}
    assert faded == {(BUG, 2)}  # layers.1.norm (lin and out are NaN and missing, in their own traces)
    # the colour bar lies above the plot, wide enough to read (on the right it was the plot's height: 15 px)
    bar = numeric.marker.colorbar
    assert bar.orientation == "h" and bar.lenmode == "pixels" and bar.len >= 300
