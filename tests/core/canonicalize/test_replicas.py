"""canonicalize/replicas.py: of the replicas of one block, `worst_drift` keeps the one that differs most from the
first, relative to the first's norm, as the tensor's ReplicaDrift (None when all are equal); the record is plain,
frozen data whose infinite differences strict JSON writes as null and reads back as None."""

import dataclasses
import json
import math

import pytest
import torch

from ttrace_core.canonicalize.replicas import ReplicaDifference, ReplicaDrift, worst_drift
from ttrace_core.format import strict_json
from ttrace_core.format.records import data_from_record, record_from_data
from ttrace_core.format.schema import Layout


def _difference(rank: int, max_abs: float, diff_norm: float, base_norm: float = 10.0) -> ReplicaDifference:
    return ReplicaDifference(ranks=(0, rank), max_abs_diff=max_abs, diff_norm=diff_norm, base_norm=base_norm)


@pytest.mark.parametrize("differences, expected", [
    ([], None),
    ([_difference(1, 0.0, 0.0), _difference(2, 0.0, 0.0)], None),
    ([_difference(1, 0.0, 0.0), _difference(2, 0.5, 1.0)], ReplicaDrift(ranks=(0, 2), max_abs_diff=0.5, relative_diff=0.1)),
    # The largest relative difference wins, not the largest absolute one.
    ([_difference(1, 3.0, 2.0, base_norm=100.0), _difference(2, 0.5, 1.0)],
     ReplicaDrift(ranks=(0, 2), max_abs_diff=0.5, relative_diff=0.1)),
    ([_difference(1, 0.5, 1.0), _difference(2, 3.0, 5.0)], ReplicaDrift(ranks=(0, 2), max_abs_diff=3.0, relative_diff=0.5)),
    # A tie keeps the first replica met.
    ([_difference(1, 0.5, 1.0), _difference(2, 0.7, 1.0)], ReplicaDrift(ranks=(0, 1), max_abs_diff=0.5, relative_diff=0.1)),
    # A first replica of zeros (or only non-finite values): any difference is infinitely large relative to it.
    ([_difference(1, 0.5, 1.0), _difference(3, 1e-9, 1e-9, base_norm=0.0)],
     ReplicaDrift(ranks=(0, 3), max_abs_diff=1e-9, relative_diff=math.inf)),
    # NaN or Inf at different places: an infinite difference norm.
    ([_difference(1, math.inf, math.inf), _difference(2, 3.0, 5.0)],
     ReplicaDrift(ranks=(0, 1), max_abs_diff=math.inf, relative_diff=math.inf)),
], ids=["no replicas", "all equal", "one differs", "relative, not absolute", "the larger", "a tie",
        "a base of zeros", "non-finite at different places"])
def test_worst_drift(differences, expected):
    assert worst_drift(differences) == expected


def test_the_ranks_say_which_block_replica_was_first():
    """A block whose replicas sit on ranks 2, 5 and 7: the drift names rank 2 (read first) and the worst, 7."""
    differences = [ReplicaDifference(ranks=(2, 5), max_abs_diff=0.1, diff_norm=0.1, base_norm=4.0),
                   ReplicaDifference(ranks=(2, 7), max_abs_diff=0.1, diff_norm=0.2, base_norm=4.0)]
    assert worst_drift(differences) == ReplicaDrift(ranks=(2, 7), max_abs_diff=0.1, relative_diff=0.05)


@pytest.mark.parametrize("record", [
    ReplicaDrift(ranks=(0, 1), max_abs_diff=0.5, relative_diff=0.1),
    ReplicaDifference(ranks=(0, 1), max_abs_diff=0.5, diff_norm=1.0, base_norm=10.0),
], ids=["drift", "difference"])
def test_the_records_are_frozen(record):
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.max_abs_diff = 0.0
    assert not hasattr(record, "__dict__")  # slots: a comparison row holds one per tensor


@pytest.mark.parametrize("drift, read_back", [
    (ReplicaDrift(ranks=(0, 3), max_abs_diff=0.5, relative_diff=0.1),
     ReplicaDrift(ranks=(0, 3), max_abs_diff=0.5, relative_diff=0.1)),
    (ReplicaDrift(ranks=(0, 3), max_abs_diff=1e-9, relative_diff=math.inf),
     ReplicaDrift(ranks=(0, 3), max_abs_diff=1e-9, relative_diff=None)),
    (ReplicaDrift(ranks=(0, 1), max_abs_diff=math.inf, relative_diff=math.inf),
     ReplicaDrift(ranks=(0, 1), max_abs_diff=None, relative_diff=None)),
], ids=["finite", "a base of zeros", "non-finite at different places"])
def test_an_infinite_difference_is_written_as_null_and_read_back_as_none(drift, read_back):
    text = strict_json.dumps(data_from_record(drift))
    assert "Infinity" not in text
    assert record_from_data(json.loads(text), ReplicaDrift, "drift", "replica drift", "") == read_back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("spoiled", [None, math.nan, math.inf], ids=["finite", "nan", "inf"])
def test_a_replicas_base_norm_is_the_norm_of_its_finite_values(dtype, spoiled):
    """shards._replica_differences: one float64 pass when every value is finite, the non-finite ones left out
    otherwise, in every stored dtype (fp8 included)."""
    from ttrace_core.canonicalize.shards import RecordedShard, _replica_differences

    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    if spoiled is not None:
        values[[3, 500]] = spoiled
    values = values.to(dtype) if dtype != torch.float8_e4m3fn or spoiled is None else values.clamp(-400, 400).to(dtype)
    as_float64 = values.double()
    expected = float(torch.linalg.vector_norm(torch.where(torch.isfinite(as_float64), as_float64, 0.0)))
    layout = Layout.replicated((1000,))
    replicas = [RecordedShard(rank=rank, layout=layout, value=values.clone()) for rank in range(2)]
    (difference,) = _replica_differences(replicas, every=True)
    assert difference.base_norm == expected and difference.diff_norm == 0.0
