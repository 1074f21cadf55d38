import json
import math

import pandas as pd
import pytest

from ttrace_dashboard import cells
from tests.synthetic_runs import write_pair
from ttrace_core import api


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    reference, candidate = write_pair(tmp_path_factory.mktemp("runs"))
    return api.comparison(reference, candidate)


def test_rows_are_modules_in_the_order_they_first_ran(frame):
    rows = cells.module_rows(frame)
    assert list(rows["module"]) == ["layers.0.lin", "layers.0.act", "layers.1.norm", "layers.1.lin", "layers.1.out"]
    assert list(rows["layer"]) == [0, 0, 1, 1, 1] and list(rows["row"]) == [0, 1, 2, 3, 4]


def test_cells_show_the_worst_tensor_with_its_own_category(frame):
    view = cells.heatmap_cells(frame, 0, "all").set_index(["module", "kind"])
    assert view.loc[("layers.0.act", "output"), "category"] == "ratio"
    assert view.loc[("layers.0.act", "output"), "micro_batch"] == 1  # mb 1 has the larger ratio (7.6e4 > 6.3e4)
    assert view.loc[("layers.0.act", "output"), "value"] == cells.LOG_RATIO_LIMIT
    assert view.loc[("layers.1.lin", "output"), "category"] == "nan"
    assert view.loc[("layers.1.out", "output"), "category"] == "missing"
    assert view.loc[("layers.0.lin", "output"), "value"] == -cells.LOG_RATIO_LIMIT  # exact: the far blue end
    assert view.loc[("layers.0.lin", "param_grad"), "tensor"] == "grad/layers.0.lin.weight/grad"
    assert "worst of 2 tensors" in view.loc[("layers.0.act", "output"), "hover"]


def test_one_micro_batch_keeps_the_step_gradients(frame):
    view = cells.heatmap_cells(frame, 0, 0)
    assert set(view["micro_batch"]) == {0, -1}
    assert cells.heatmap_cells(frame, 7, "all").empty


@pytest.mark.parametrize("ratio, value", [(None, math.nan), (0.0, -4.0), (1.0, 0.0), (100.0, 2.0), (1e9, 4.0),
                                          (math.inf, 4.0)], ids=["none", "zero", "pass-line", "fail", "clipped", "inf"])
def test_log_ratio(ratio, value):
    got = cells.log_ratios(pd.Series([ratio, 1.0], dtype="Float64" if ratio is None else float))
    assert got[0] == value or (math.isnan(value) and math.isnan(got[0]))
    assert got[1] == 0.0


def test_tensor_choices_list_failures_first_and_the_first_divergence_is_found(frame):
    choices = cells.tensor_choices(frame, 0)
    assert choices[0] == ("forward/layers.0.act/output.0", 0, 0)
    assert choices[-1][0] == "grad/layers.0.lin.weight/grad"
    assert cells.first_divergence(frame)["tensor"] == "forward/layers.0.act/output.0"
    assert list(cells.history(frame, "forward/layers.0.act/output.0")["micro_batch"]) == [0, 1]


def test_rows_by_layer_fold_every_module_of_a_layer_into_one_row(frame):
    layered = cells.rows_by_layer(frame)
    assert list(cells.module_rows(layered)["module"]) == ["layers.0", "layers.1"]
    view = cells.heatmap_cells(layered, 0, "all").set_index(["module", "kind"])
    assert view.loc[("layers.1", "output"), "category"] == "nan"  # the worst of norm, lin (NaN) and out (missing)
    assert view.loc[("layers.0", "output"), "tensor"] == "forward/layers.0.act/output.0"


def test_the_timeline_has_one_point_per_module_and_kind_where_it_first_ran(frame):
    points = cells.timeline_points(frame, 0)
    assert len(points) == 6 and list(points["order"]) == sorted(points["order"])
    act = points[points["module"] == "layers.0.act"].iloc[0]
    assert act["micro_batch"] == 1 and act["order"] == 1  # worst micro-batch, drawn at its first appearance


def _float32_rel() -> float:
    from ttrace_core.compare.tolerances import DTYPE_TOLERANCES

    return DTYPE_TOLERANCES["float32"][0]


def test_the_hover_says_which_error_the_comparison_catches_on_the_cells_tensor(frame):
    view = cells.heatmap_cells(frame, 0, "all").set_index(["module", "kind"])
    # the table's rows come finished: the norm test's tolerance where no structure test set a smaller figure
    assert f"<br>catches errors above {_float32_rel():.3g}<br>" in view.loc[("layers.0.lin", "output"), "hover"]
    assert "catches" not in view.loc[("layers.1.out", "output"), "hover"]  # missing: not compared by value
    edited = frame.copy()
    edited.loc[(edited["fqn"] == "layers.0.act") & (edited["micro_batch"] == 1), "detectable"] = 3e-4
    edited.loc[edited["fqn"] == "layers.0.lin", "detectable"] = float("nan")
    view = cells.heatmap_cells(edited, 0, "all").set_index(["module", "kind"])
    assert "<br>catches errors above 0.0003<br>" in view.loc[("layers.0.act", "output"), "hover"]  # the worst, mb 1
    assert "catches" not in view.loc[("layers.0.lin", "output"), "hover"]  # the hover reads the column as it is


def test_the_tensor_pages_line_names_the_smallest_error_caught_and_its_test(frame):
    row = frame[(frame["fqn"] == "layers.0.act") & (frame["micro_batch"] == 0)].iloc[0].copy()
    assert cells.detectable_text(row) == \
        f"smallest error this comparison catches on this tensor: {_float32_rel():.3g} (test: norm)"
    row["detectable"] = 2e-4
    row["structure"] = json.dumps([{"name": "offset", "value": 0.0, "tolerance": 3e-4, "ratio": 0.0, "finding": ""},
                                   {"name": "scale", "value": 0.0, "tolerance": 2e-4, "ratio": 0.0, "finding": ""}])
    assert cells.detectable_text(row) == "smallest error this comparison catches on this tensor: 0.0002 (test: scale)"
    row["detectable"] = float("nan")
    assert cells.detectable_text(row) is None
    missing = frame[frame["status"] == "missing"].iloc[0]
    assert cells.detectable_text(missing) is None


def test_the_tensor_pages_verdict_line_states_each_ratio_once(frame):
    failing = frame[frame["tensor"] == "forward/layers.0.act/output.0"].iloc[0]
    line = cells.verdict_banner(failing)
    assert line.startswith("**mismatch** · mismatch ratio ")
    assert line.count("ratio") == 1 and line.count("tolerance") == 1
    passing = frame[(frame["tensor"] == "forward/layers.0.lin/output.0") & (frame["micro_batch"] == 0)].iloc[0]
    assert cells.verdict_banner(passing) == (f"**pass** · error {passing['error']:.3g} · tolerance "
                                             f"{passing['tolerance_rel']:.3g} · ratio {passing['ratio']:.3g}")


@pytest.mark.parametrize("module, expected", [
    ("layers.1.norm", "layers.1.norm"),  # the link's module
    ("layers.0", "layers.0.act"),  # a layer: the first divergence is in it
    ("layers.1", "layers.1.norm"),  # a layer without it: its first module
    (None, "layers.0.act"),  # no link: the first divergence
    ("gone", "layers.0.act"),
], ids=["module", "layer-with-first-divergence", "layer-without", "no-link", "unknown"])
def test_the_replay_box_opens_on_the_linked_module(frame, module, expected):
    suspects = list(cells.module_rows(frame)["module"])
    assert suspects[cells.replay_default(suspects, module, "layers.0.act")] == expected


def test_the_focus_row_is_the_module_or_its_layer():
    assert cells.focus_row("layers.1.lin", by_layer=False) == "layers.1.lin"
    assert cells.focus_row("layers.1.lin", by_layer=True) == "layers.1"
    assert cells.focus_row(None, by_layer=True) is None


MODULES = ["embedding", "decoder.layers.0", "decoder.layers.0.mlp", "decoder.layers.0.mlp.linear_fc1",
           "decoder.layers.0.mlp.linear_fc2", "output_layer"]


@pytest.mark.parametrize(("module", "kind", "target"), [
    ("decoder.layers.0.mlp.linear_fc2", "output", "decoder.layers.0.mlp.linear_fc2"),
    ("decoder.layers.0.mlp.linear_fc2", "grad_input", "decoder.layers.0.mlp.linear_fc2"),
    ("decoder.layers.0.mlp.linear_fc2", "input", "decoder.layers.0.mlp"),  # made by the mlp's glue: replay the mlp
    ("decoder.layers.0.mlp.linear_fc2", "grad_output", "decoder.layers.0.mlp"),
    ("decoder.layers.0.mlp.linear_fc2.inner", "input", "decoder.layers.0.mlp.linear_fc2"),
    ("decoder.layers.0.untraced.linear", "input", "decoder.layers.0"),  # the nearest traced ancestor
    ("embedding", "input", ""),  # arrives from outside the model: the whole model
    ("embedding", "param_grad", "embedding"),
], ids=["output", "grad-input", "input", "grad-output", "input-nested", "untraced-parent", "model-input", "param-grad"])
def test_a_tensor_a_module_receives_is_replayed_in_the_module_around_it(module, kind, target):
    # Issue 41's walk: the sample's first divergence is linear_fc2's input; replaying linear_fc2 found nothing.
    assert cells.replay_target(module, kind, MODULES) == target


def _shard(rank: int, error: float | None):
    from ttrace_core.service.tensor_view import ShardInfo

    return ShardInfo(rank=rank, coordinate=(rank,), placements=("S(-1)",), mesh_axis_names=("tp",), region=((0, 1),),
                     flat_range=None, local_shape=(1,), error=error)


@pytest.mark.parametrize(("errors", "text"), [
    ({0: 0.0023, 1: 0.403}, "**Beyond the tolerance (0.0511): rank 1 (0.403).** Within it: rank 0 (0.0023)."),
    ({0: 0.3, 1: 0.4}, "**Beyond the tolerance (0.0511): rank 0 (0.3), rank 1 (0.4).**"),
    ({0: 0.001, 1: 0.002}, "Every rank is within the tolerance (0.0511): rank 0 (0.001), rank 1 (0.002)."),
    ({0: None, 1: None}, None),  # partial sums: only their sum has an error
], ids=["one-rank", "both", "none", "partial"])
def test_the_tensor_page_says_which_ranks_are_beyond_the_tolerance(errors, text):
    shards = [_shard(rank, error) for rank, error in errors.items()]
    assert cells.ranks_beyond_text(shards, 0.0511) == text
