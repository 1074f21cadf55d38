"""The records of a comparison (ttrace_core/compare/results.py): a row's status, and the headroom of a
verdict: per tensor kind, the smallest relative error the comparison could have caught, from each row's
`detectable` (the norm test's tolerance.rel where no test set it), over the rows compared element-wise."""

from __future__ import annotations

import pytest

from ttrace_core.compare.results import KindHeadroom, RunComparison, TensorComparison, Tolerance, headroom_by_kind
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey

KEYS = {
    "output": TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.mlp", slot="output.0"),
    "input": TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.mlp", slot="input.0"),
    "param_grad": TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="grad", fqn="layers.0.mlp.weight", slot="grad"),
    "param": TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="param", fqn="layers.0.mlp.weight", slot="value"),
}


def _row(kind: str, *, detectable: float | None, status: str = "pass", stats_only: bool = False,
         compared: bool = True, micro_batch: int = 0) -> TensorComparison:
    """A row of `kind` judged with rel 1e-5; `compared`: by value (it has a mismatch ratio)."""
    base = KEYS[kind]
    key = TensorKey(step=0, micro_batch=micro_batch if base.micro_batch >= 0 else NO_MICRO_BATCH, phase=base.phase,
                    fqn=base.fqn, slot=base.slot)
    return TensorComparison(key=key, status=status, tolerance=Tolerance(rel=1e-5, abs=1e-7, source="test"),
                            value_ratio=0.5 if compared else None, detectable=detectable, stats_only=stats_only)


def _outputs(*detectables: float | None) -> list[TensorComparison]:
    return [_row("output", detectable=d, micro_batch=index) for index, d in enumerate(detectables)]


CASES = [
    ("median-and-largest", _outputs(1e-3, 4e-3, 2e-3), [KindHeadroom(kind="output", num_tensors=3, median=2e-3, largest=4e-3)]),
    ("even-count-median", _outputs(1e-3, 3e-3), [KindHeadroom(kind="output", num_tensors=2, median=2e-3, largest=3e-3)]),
    ("norm-test-fallback", _outputs(None, 5e-4), [KindHeadroom(kind="output", num_tensors=2, median=(1e-5 + 5e-4) / 2,
                                                               largest=5e-4)]),
    ("failing-rows-count", [_row("param_grad", detectable=0.02, status="mismatch")],
     [KindHeadroom(kind="param_grad", num_tensors=1, median=0.02, largest=0.02)]),
    ("not-compared-by-value-left-out",
     [_row("output", detectable=None, compared=False, status="missing"), _row("input", detectable=None, stats_only=True),
      _row("param", detectable=7e-4)],
     [KindHeadroom(kind="param", num_tensors=1, median=7e-4, largest=7e-4)]),
    ("heatmap-order", [_row("param", detectable=1e-4), _row("param_grad", detectable=2e-4), _row("input", detectable=3e-4)],
     [KindHeadroom(kind="input", num_tensors=1, median=3e-4, largest=3e-4),
      KindHeadroom(kind="param_grad", num_tensors=1, median=2e-4, largest=2e-4),
      KindHeadroom(kind="param", num_tensors=1, median=1e-4, largest=1e-4)]),
]


@pytest.mark.parametrize(("rows", "expected"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_headroom_by_kind(rows, expected):
    actual = headroom_by_kind(rows)
    assert [(h.kind, h.num_tensors) for h in actual] == [(h.kind, h.num_tensors) for h in expected]
    assert [(h.median, h.largest) for h in actual] == pytest.approx([(h.median, h.largest) for h in expected], rel=1e-12)


def test_the_verdict_summary_carries_the_headroom_into_the_json_header():
    result = RunComparison(reference="r", candidate="c", comparisons=_outputs(1e-3, 4e-3, 2e-3))
    assert result.summary().headroom == result.headroom
    assert result.summary().header()["headroom"] == [{"kind": "output", "num_tensors": 3, "median": 2e-3, "largest": 4e-3}]


def test_a_status_is_one_of_comparison_status_and_is_written_as_its_value():
    """The status has one home (ComparisonStatus): a row made or read with any other string is refused, and
    the serialized form holds the plain value, as the table's column and the JSON output always did."""
    from ttrace_core.compare.results import ComparisonStatus
    from ttrace_core.errors import TraceFormatError

    row = _row("output", detectable=None, status="replica_drift")
    assert row.status is ComparisonStatus.REPLICA_DRIFT and not row
    data = row.to_dict()
    assert data["status"] == "replica_drift" and type(data["status"]) is str
    assert TensorComparison.from_dict(data).status is ComparisonStatus.REPLICA_DRIFT
    with pytest.raises(TraceFormatError, match=r"field \$.status: Invalid enum value 'replica drift'"):
        TensorComparison.from_dict({**data, "status": "replica drift"})
    with pytest.raises(ValueError, match="not a valid ComparisonStatus"):
        _row("output", detectable=None, status="mis-match")


def test_replica_drift_is_a_record_checked_on_decode_and_written_as_before():
    """`replica_drift` is a ReplicaDrift, not a dict: the serialized form keeps its three fields (the table's
    drift_* columns, the JSON output), strict JSON's null for an infinite difference reads back as None, and
    decoding refuses a malformed one with one line naming the field."""
    import math

    from ttrace_core.canonicalize.replicas import ReplicaDrift
    from ttrace_core.errors import TraceFormatError

    drift = ReplicaDrift(ranks=(0, 1), max_abs_diff=math.inf, relative_diff=0.5)
    row = TensorComparison(key=KEYS["param_grad"], status="replica_drift", replica_drift=drift)
    data = row.to_dict()
    assert data["replica_drift"] == {"ranks": (0, 1), "max_abs_diff": math.inf, "relative_diff": 0.5}
    assert TensorComparison.from_dict(data).replica_drift == drift
    again = RunComparison.from_json(RunComparison(reference="r", candidate="c", comparisons=[row]).to_json())
    assert again.comparisons[0].replica_drift == ReplicaDrift(ranks=(0, 1), max_abs_diff=None, relative_diff=0.5)
    with pytest.raises(TraceFormatError, match=r"field \$.replica_drift.ranks: Expected `array`, got `str`"):
        TensorComparison.from_dict({**data, "replica_drift": {**data["replica_drift"], "ranks": "0,1"}})
