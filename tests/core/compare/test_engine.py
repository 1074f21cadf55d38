import math

import pytest
import torch

from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.compare.engine import RunComparison, TensorComparison, compare_values
from ttrace_core.format.schema import TensorKey
from ttrace_core.compare.tolerances import DtypeTolerances, Tolerance

TOL = Tolerance(rel=1e-3, abs=1e-6, source="test")
KEY = TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0", slot="output.0")


@pytest.mark.parametrize(
    "actual, expected, error, ratio",
    [
        ([1.0, 2.0], [1.0, 2.0], 0.0, 0.0),
        ([3.0, 4.0], [3.0, 4.004], 0.004 / math.hypot(3, 4.004), 0.004 / (1e-3 * math.hypot(3, 4.004) + 1e-6 * math.sqrt(2))),
        ([0.0, 1e-7], [0.0, 0.0], math.inf, 1e-7 / (1e-6 * math.sqrt(2))),
    ],
    ids=["equal", "relative", "near-zero-reference-uses-abs"],
)
def test_metrics_table(actual, expected, error, ratio):
    metrics = compare_values(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), TOL)
    assert metrics.error == pytest.approx(error)
    assert metrics.ratio == pytest.approx(ratio)


def test_metrics_locate_the_worst_element_and_the_minimum_tolerance():
    expected = torch.ones(3, 4, dtype=torch.float64)
    actual = expected.clone()
    actual[2, 1] += 0.5
    metrics = compare_values(actual, expected, TOL)
    assert metrics.max_abs_index == (2, 1) and metrics.max_abs_diff == pytest.approx(0.5)
    assert metrics.max_rel_index == (2, 1) and metrics.num_mismatched == 1
    # the smallest passing rel tolerance passes exactly
    tight = Tolerance(rel=metrics.min_rel_tolerance * (1 + 1e-12), abs=TOL.abs, source="min")
    assert compare_values(actual, expected, tight).ratio <= 1


def test_a_tensor_of_no_elements_passes_and_has_no_worst_element():
    metrics = compare_values(torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, 3, dtype=torch.float64), TOL)
    assert (metrics.shape, metrics.numel, metrics.ratio, metrics.max_abs_diff, metrics.max_rel_index, metrics.num_mismatched) \
        == ((0, 3), 0, 0.0, None, None, None)


def test_nan_counts_are_reported():
    actual = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    metrics = compare_values(actual, torch.tensor([1.0, 2.0], dtype=torch.float64), TOL)
    assert metrics.num_nan == (1, 0)


def test_verdict_is_truthy_and_round_trips_through_json():
    good = TensorComparison(key=KEY, status="pass", error=1e-9, ratio=0.1, tolerance=TOL, max_abs_index=(0, 1))
    bad = TensorComparison(key=KEY, status="mismatch", error=0.5, ratio=500.0, tolerance=TOL)
    result = RunComparison(reference="r", candidate="c", comparisons=[good, bad], steps_compared=[0])
    assert good and not bad and not result
    assert result.first_divergence is bad and result.worst(1) == [bad]
    again = RunComparison.from_json(result.to_json())
    assert again.comparisons == result.comparisons and not again


def test_dtype_table_is_the_default_tolerance():
    tolerance = DtypeTolerances().tolerance_for(KEY, "bfloat16")
    assert (tolerance.rel, tolerance.source) == (4e-2, "dtype default (bfloat16)")
    assert DtypeTolerances(overrides={"float32": (1e-3, 0.0)}).tolerance_for(KEY, "float32").rel == 1e-3


def test_compute_precision_loosens_fp32_storage():
    """Megatron keeps bf16-computed gradients in fp32 main_grad: they carry bf16 round-off."""
    tolerance = DtypeTolerances(precision="bf16").tolerance_for(KEY, "float32")
    assert tolerance.rel == 4e-2 and "computed in bfloat16" in tolerance.source
    assert DtypeTolerances(precision="fp32").tolerance_for(KEY, "float32").rel == 1e-5
    assert DtypeTolerances(precision="fp8").tolerance_for(KEY, "float32").rel == 4e-2


@pytest.mark.parametrize("dtype, slot, named", [
    ("int64", "input.0", True),          # token ids differ: the runs were fed different micro-batches
    ("float32", "input.0", False),       # a float input is computed: a numerical divergence
    ("int64", "output.0", False),        # an integer output is computed too
], ids=["token-ids", "float-input", "int-output"])
def test_a_first_divergence_in_integer_inputs_is_named_a_data_mismatch(dtype, slot, named):
    from ttrace_core.compare.evidence import data_mismatch_finding

    key = TensorKey(step=0, micro_batch=1, phase="forward", fqn="", slot=slot)
    result = RunComparison(reference="ref", candidate="cand",
                           comparisons=[TensorComparison(key=key, status="mismatch", dtype=dtype)])
    finding = data_mismatch_finding(result)
    assert (finding is not None and finding.startswith("data-mismatch: step 0 / mb 1")) == named


def _judged(value_error: float, drift_relative: float | None) -> TensorComparison:
    """A tensor whose candidate is off the reference by `value_error` (relative) and whose two
    replicas differ by `drift_relative`, judged like compare_tensor does."""
    from ttrace_core.compare.engine import _judged_row

    tolerance = Tolerance(rel=1e-3, abs=0.0, source="test", drift_rel=1e-5)
    expected = torch.ones(4, dtype=torch.float64)
    metrics = compare_values(expected * (1 + value_error), expected, tolerance)
    drift = None if drift_relative is None else ReplicaDrift(ranks=(0, 1), max_abs_diff=drift_relative, relative_diff=drift_relative)
    return _judged_row(KEY, metrics, drift, tolerance, "float64")


@pytest.mark.parametrize(
    "value_error, drift, status, decided_by, in_message",
    [
        (0.0192, 1.68e-3, "replica_drift", "replica drift", ["mismatch ratio 19.2", "replica drift ratio 168", "decided by replica drift"]),
        (0.168, 1.92e-4, "mismatch", "mismatch", ["mismatch ratio 168", "replica drift ratio 19.2", "decided by mismatch"]),
        (0.0192, None, "mismatch", "mismatch", ["mismatch ratio 19.2"]),
        (0.0, 1.68e-3, "replica_drift", "replica drift", ["replica drift ratio 168", "mismatch ratio 0"]),
    ],
    ids=["both-drift-larger", "both-mismatch-larger", "mismatch-only", "drift-only"],
)
def test_one_ratio_per_row_the_status_column_and_message_agree(value_error, drift, status, decided_by, in_message):
    from ttrace_core.cli.report import comparison_row, ratios_text

    c = _judged(value_error, drift)
    assert (c.status, c.decided_by) == (status, decided_by)
    assert c.ratio == pytest.approx(c.drift_ratio if decided_by == "replica drift" else c.value_ratio)
    for text in in_message:
        assert text in c.message
    assert f"{c.value_ratio:.3g}" in comparison_row(c) and f"FAILED[{status}]" in comparison_row(c)
    assert ratios_text(c).startswith(f"mismatch ratio {c.value_ratio:.3g}")
    data = TensorComparison.from_dict(c.to_dict())
    assert c.to_dict()["decided_by"] == decided_by and data.decided_by == decided_by


def _write_partial_pair(root, *, candidate_error: float):
    """A stats-only reference of one tensor, and a 2-rank candidate that holds it as partial sums (P(sum))."""
    from ttrace_core.format.schema import Layout, RunManifest, TensorMeta
    from ttrace_core.format.writer import RunWriter, stats_from_tensor, write_manifest

    key = TensorKey(step=0, micro_batch=0, phase="backward", fqn="mlp.fc2", slot="grad_output.1")
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    halves = (full * 0.25, full * 0.75 * (1 + candidate_error))
    for role, world_size in (("reference", 1), ("candidate", 2)):
        write_manifest(root / role, RunManifest(role=role, world_size=world_size, degrees={"tp": world_size},
                                                mesh_shape=[world_size], mesh_axis_names=["tp"],
                                                rank_coordinates=[[r] for r in range(world_size)]))
        for rank in range(world_size):
            writer = RunWriter(root / role, rank)
            writer.begin_step(0)
            if role == "reference":
                meta = TensorMeta(key=key, rank=0, dtype="float32", local_shape=(6, 4), layout=Layout.replicated((6, 4)),
                                  seq=0, stats=stats_from_tensor(full), stats_only=True)
                writer.write(meta, None)
            else:
                layout = Layout(global_shape=(6, 4), mesh_shape=(2,), coordinate=(rank,), placements=("P(sum)",),
                                mesh_axis_names=("tp",))
                writer.write(TensorMeta(key=key, rank=rank, dtype="float32", local_shape=(6, 4), layout=layout, seq=0,
                                        stats=stats_from_tensor(halves[rank])), halves[rank])
            writer.end_step()
    return root / "reference", root / "candidate"


@pytest.mark.parametrize("candidate_error, status", [(0.0, "pass"), (0.5, "mismatch")])
def test_a_partial_sum_with_values_is_compared_with_statistics_by_its_norm(tmp_path, candidate_error, status):
    """A stats-only trace keeps partial sums' values (their statistics cannot be combined): the norm of
    the summed values is compared with the statistics of the other run."""
    from ttrace_core.compare.engine import compare_runs
    from ttrace_core.format.reader import RunReader

    reference, candidate = _write_partial_pair(tmp_path, candidate_error=candidate_error)
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        row = compare_runs(ref, cand).comparisons[0]
    assert (row.status, row.stats_only) == (status, True)
