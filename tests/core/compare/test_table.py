import json

import pandas as pd
import pytest

from tests.synthetic_runs import write_pair
from ttrace_core.errors import TraceFormatError
from ttrace_core.format.records import data_from_record
from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.results import TensorComparison, Tolerance, detectable_of, row_detectable
from ttrace_core.compare.table import (
    COLUMNS, comparison_from_table, frame_from_comparisons, layer_of, read_table,
    table_from_comparison, tensor_id,
    tensor_kind, write_table,
)
from ttrace_core.format.naming import GRADIENT_CLIPPING, LOSS_FUNCTION, key_from_tensor_id
from ttrace_core.format.schema import TensorKey


@pytest.fixture
def compared(tmp_path):
    reference_dir, candidate_dir = write_pair(tmp_path)
    with RunReader(reference_dir) as reference, RunReader(candidate_dir) as candidate:
        result = compare_runs(reference, candidate)
        frame = table_from_comparison(result, candidate)
    return result, frame


def _normalized(result) -> dict:
    """JSON of a comparison with NaN/inf as text, for equality."""
    return json.loads(result.to_json())


def test_the_table_round_trips_every_number_through_parquet(tmp_path, compared):
    result, frame = compared
    provenance = {"reference": result.reference, "candidate": result.candidate, "steps_compared": result.steps_compared,
                  "notes": result.notes, "coverage": data_from_record(result.coverage)}
    write_table(tmp_path / "t.parquet", frame, provenance)
    again, read_provenance = read_table(tmp_path / "t.parquet")
    assert read_provenance == provenance
    assert _normalized(comparison_from_table(again, read_provenance)) == _normalized(result)


def test_one_row_per_tensor_instance_in_execution_order(compared):
    result, frame = compared
    assert list(frame.columns) == list(COLUMNS)
    assert list(frame["order"]) == list(range(len(result.comparisons)))
    assert list(frame["tensor"]) == [tensor_id(c.key) for c in result.comparisons]
    by_fqn = frame[frame["micro_batch"] == 0].set_index("fqn")
    assert by_fqn.loc["layers.0.act", "status"] == "mismatch" and by_fqn.loc["layers.0.act", "layer"] == 0
    assert by_fqn.loc["layers.1.out", "status"] == "missing" and pd.isna(by_fqn.loc["layers.1.out", "ratio"])
    assert by_fqn.loc["layers.1.lin", "num_nan_candidate"] == 1


def test_replica_drift_has_its_own_column_and_the_ratio_that_judged(compared):
    _, frame = compared
    row = frame[(frame["fqn"] == "layers.1.norm") & (frame["micro_batch"] == 0)].iloc[0]
    assert row["status"] == "replica_drift"
    assert row["value_ratio"] == 0.0  # rank 0's replica equals the reference
    assert row["drift_ratio"] == pytest.approx(1e-3 / 1e-5, rel=1e-3)
    assert row["ratio"] == max(row["value_ratio"], row["drift_ratio"])
    assert json.loads(row["drift_ranks"]) == [0, 1]


def test_tolerance_method_and_parameters_are_columns(compared):
    _, frame = compared
    row = frame.iloc[0]
    assert row["tolerance_method"] == "dtype" and row["tolerance_rel"] == 1e-5
    assert json.loads(row["tolerance_params"]) == {}


@pytest.mark.parametrize("key, kind", [
    (TensorKey(0, 0, "forward", "a.b", "input.0"), "input"),
    (TensorKey(0, 0, "forward", "a.b", "input.hidden_states"), "input"),
    (TensorKey(0, 0, "forward", "a.b", "output.1"), "output"),
    (TensorKey(0, 0, "backward", "a.b", "grad_output.0"), "grad_output"),
    (TensorKey(0, 0, "backward", "a.b", "grad_input.0"), "grad_input"),
    (TensorKey(0, -1, "grad", "a.b.weight", "grad"), "param_grad"),
    (TensorKey(0, -1, "param", "a.b.weight", "value"), "param"),
], ids=["input", "kwarg-input", "output", "grad_output", "grad_input", "param_grad", "param"])
def test_tensor_kinds(key, kind):
    assert tensor_kind(key) == kind
    assert key_from_tensor_id(tensor_id(key), key.step, key.micro_batch) == key


@pytest.mark.parametrize("fqn, layer", [("decoder.layers.12.mlp", 12), ("layers.0", 0), ("embedding", None),
                                        ("h.3.attn", 3), ("mylayers.4", None)],
                         ids=["megatron", "torch", "none", "gpt2", "not-a-component"])
def test_layer_of(fqn, layer):
    assert layer_of(fqn) == layer


@pytest.mark.parametrize("key, kind", [(TensorKey(0, 0, "forward", LOSS_FUNCTION, "scalar.loss"), "loss"),
                                       (TensorKey(0, -1, "step", GRADIENT_CLIPPING, "scalar.grad_norm"), "step")],
                         ids=["loss", "step"])
def test_a_pseudo_module_is_its_own_row_outside_every_layer(key, kind):
    row = frame_from_comparisons([TensorComparison(key=key, status="mismatch", ratio=3.0)], None).iloc[0]
    assert (row["module"], row["kind"]) == (key.fqn, kind) and pd.isna(row["layer"])
    assert key_from_tensor_id(row["tensor"], key.step, key.micro_batch) == key


def test_root_module_tensor_id_round_trips():
    key = TensorKey(0, 0, "forward", "", "output.0")
    assert key_from_tensor_id(tensor_id(key), 0, 0) == key
    assert tensor_id(key) == "forward//output.0"


_TOLERANCE = Tolerance(rel=1e-5, abs=1e-7, source="test")
_KEY = TensorKey(0, 0, "forward", "layers.0.mlp", "output.0")
_KEEP = object()


@pytest.mark.parametrize("fields, set_after, expected", [
    ({"status": "pass", "tolerance": _TOLERANCE, "value_ratio": 0.5, "detectable": 3e-6}, _KEEP, 3e-6),
    ({"status": "pass", "tolerance": _TOLERANCE, "value_ratio": 0.5}, _KEEP, 1e-5),
    ({"status": "pass", "tolerance": _TOLERANCE, "value_ratio": 0.5}, None, 1e-5),
    ({"status": "pass", "tolerance": _TOLERANCE, "value_ratio": 0.5, "stats_only": True, "detectable": 3e-6}, _KEEP, None),
    ({"status": "missing"}, _KEEP, None),
    ({"status": "pass", "tolerance": _TOLERANCE, "value_ratio": 0.5, "detectable": 3e-6}, 2e-6, 2e-6),
], ids=["structure-test", "norm-test", "norm-test-set-after", "stats-only", "missing", "structure-set-after"])
def test_a_rows_detectable_is_finished_as_detectable_of_gives(fields, set_after, expected):
    comparison = TensorComparison(key=_KEY, **fields)
    if set_after is not _KEEP:
        comparison.detectable = set_after  # a field set after the row is made (the engine's structure tests do)
    raw = comparison.detectable
    comparison_elementwise = comparison.value_ratio is not None and not comparison.stats_only
    row = frame_from_comparisons([comparison], None).iloc[0]
    assert (None if pd.isna(row["detectable"]) else row["detectable"]) == detectable_of(raw, _TOLERANCE.rel, comparison_elementwise) == expected


def test_every_row_of_a_compared_table_carries_its_finished_detectable(compared):
    result, frame = compared
    compared_rows = frame["value_ratio"].notna() & ~frame["stats_only"].astype(bool)
    assert compared_rows.any() and (~compared_rows).any()
    assert frame.loc[compared_rows, "detectable"].notna().all()
    assert frame.loc[~compared_rows, "detectable"].isna().all()
    for c, value in zip(result.comparisons, frame["detectable"]):
        expected = row_detectable(c)
        assert (value != value and expected is None) or value == expected


def test_a_frame_of_rows_without_numbers_keeps_the_tables_float_columns(compared):
    """A streamed chunk may hold one missing tensor alone: its float columns stay float, so the chunks
    concatenate to the finished table's dtypes."""
    result, frame = compared
    missing = [c for c in result.comparisons if c.status == "missing"][:1]
    with RunReader(result.candidate) as candidate:
        chunk = frame_from_comparisons(missing, candidate)
    floats = [name for name in frame.columns if frame[name].dtype == float]
    assert {"ratio", "error", "detectable", "tolerance_rel"} <= set(floats)
    assert {name: str(chunk[name].dtype) for name in floats} == {name: "float64" for name in floats}


@pytest.mark.parametrize("damage, message", [
    (lambda frame: frame.assign(status=["bogus"] + list(frame["status"][1:])), r"field \$\.status: Invalid enum value 'bogus'"),
    (lambda frame: frame.drop(columns=["num_nonfinite_apart"]), r"field \$\.num_nonfinite_apart: Expected `int`, got `null`"),
    (lambda frame: frame.assign(structure=[json.dumps([{"name": "scale", "value": 0.1, "tolerance": 1.0, "ratio": 0.1,
                                                         "findingz": ""}])] + list(frame["structure"][1:])),
     r"Object contains unknown field `findingz`"),
], ids=["bad-value", "older-table", "renamed-structure-key"])
def test_a_damaged_table_is_refused_in_one_line(compared, damage, message):
    """The rows are read in one conversion; a damaged one is still refused with its field named."""
    result, frame = compared
    with pytest.raises(TraceFormatError, match=r"comparison table: not a valid comparison row \(.*" + message):
        comparison_from_table(damage(frame), {"reference": "r", "candidate": "c", "steps_compared": [0], "notes": []})
    assert comparison_from_table(frame, {"reference": "r", "candidate": "c", "steps_compared": [0], "notes": []}
                                 ).comparisons == result.comparisons
