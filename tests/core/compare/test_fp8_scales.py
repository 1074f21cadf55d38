"""compare/fp8_scales.py: how far an fp8 scale may move, from the amax of the operand it scales (read from the
recorded statistics of both runs, no tensor read), and a candidate's own scales, which the reference cannot
have, judged by their replicas alone: one rounding of their dtype apart at most.

tests/core/compare/test_tolerances.py checks the input's bound through the tolerance provider
(step_scalars.with_step_scalars); here `amax_bounds` itself, on runs written with the real writer: the
weight's scales, an fp8 scale module recorded on its input and its output slots (as a real run records it),
and the scales only one run has."""

from __future__ import annotations

import pytest
import torch

from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.compare.fp8_scales import (
    amax_bounds, is_fp8_scale, logical_amax, replica_disagreements, scale_owner, scale_replica_rel,
)
from ttrace_core.compare.results import ComparisonStatus, Tolerance
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import (
    NO_MICRO_BATCH, PRE_STEP_SLOT, Layout, RunManifest, TensorKey, TensorMeta, TensorStats,
)
from ttrace_core.format.writer import RunWriter, stats_from_tensor, write_manifest

LINEAR = "layers.0.mlp.fc1"
SCALES = f"{LINEAR}.fp8_scale_inv"
F32_EPS = 2.0**-23


def _forward(fqn: str, slot: str, step: int = 0, micro_batch: int = 0, call: int = 0) -> TensorKey:
    return TensorKey(step=step, micro_batch=micro_batch, phase="forward", fqn=fqn, slot=slot, call=call)


def _weight(step: int, slot: str = "value") -> TensorKey:
    return TensorKey(step=step, micro_batch=NO_MICRO_BATCH, phase="param", fqn=f"{LINEAR}.weight", slot=slot)


def _stats_meta(amax_min: float, amax_max: float, *, scale: float = 1.0, placements=("R",), stats=True) -> TensorMeta:
    layout = Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(0,), placements=placements, mesh_axis_names=("tp",))
    return TensorMeta(key=_forward(LINEAR, "input.0"), rank=0, dtype="float32", local_shape=(4,), layout=layout, seq=0,
                      scale=scale, stats=TensorStats(numel=4, sum=0.0, sumsq=1.0, min=amax_min, max=amax_max, num_nan=0,
                                                     num_inf=0) if stats else None)


def test_the_logical_amax_is_the_largest_magnitude_over_the_shards_statistics():
    assert logical_amax([_stats_meta(-3.0, 1.0), _stats_meta(-0.5, 2.0)]) == 3.0
    assert logical_amax([_stats_meta(0.5, 7.0)]) == 7.0
    assert logical_amax([_stats_meta(-8.0, 4.0, scale=4.0)]) == 2.0  # recorded values times the loss scale: undone


@pytest.mark.parametrize("metas", [[_stats_meta(-3.0, 1.0), _stats_meta(-1.0, 1.0, stats=False)],
                                   [_stats_meta(-3.0, 1.0, placements=("P(sum)",))],
                                   [_stats_meta(-3.0, 1.0, placements=("P(avg)",))]],
                         ids=["a-shard-without-statistics", "partial-sum", "partial-average"])
def test_no_logical_amax_without_every_shards_statistics_or_from_partial_values(metas):
    assert logical_amax(metas) is None


@pytest.mark.parametrize("key, is_scale", [
    (_forward(SCALES, "input.0"), True), (_forward(SCALES, "output.0"), True), (_forward(SCALES, "input.1"), True),
    (_forward(SCALES, "output.1"), True), (_forward(SCALES, "input.2"), False), (_forward(LINEAR, "input.0"), False),
    (TensorKey(step=0, micro_batch=0, phase="backward", fqn=SCALES, slot="grad_input.0"), False),
    (_forward("fp8_scale_inv", "output.0"), True),
], ids=["input-scale", "input-scale-out", "weight-scale", "weight-scale-out", "third-slot", "the-linear", "backward",
        "the-roots"])
def test_an_fp8_scale_is_a_forward_slot_0_or_1_of_an_fp8_scale_module(key, is_scale):
    assert is_fp8_scale(key) is is_scale


def test_a_scale_row_goes_before_its_linears_forward_call():
    assert scale_owner(_forward(SCALES, "output.1", step=2, micro_batch=3, call=1)) == (2, 3, 1, LINEAR)


@pytest.mark.parametrize("dtype, rel", [("float32", F32_EPS), ("bfloat16", 2.0**-7), ("float16", 2.0**-10),
                                        ("float8_e4m3fn", 2.0**-3), ("float64", 2.0**-52), ("int64", 0.0)])
def test_replicas_of_a_scale_may_differ_by_one_rounding_of_its_own_dtype(dtype, rel):
    assert scale_replica_rel(dtype) == rel


def _write(run_dir, steps: dict[int, dict[TensorKey, torch.Tensor]], *, world_size: int = 1,
           per_rank: dict[TensorKey, list[torch.Tensor]] | None = None, stats_only: frozenset[TensorKey] = frozenset(),
           layouts: dict[TensorKey, list[Layout]] | None = None) -> RunReader:
    """Each step's tensors, replicated on every rank (`per_rank`: each rank's own values; `layouts`: each rank's
    own layout); their statistics recorded, the keys of `stats_only` without values."""
    write_manifest(run_dir, RunManifest(role="candidate", world_size=world_size, precision="fp8"))
    for rank in range(world_size):
        writer = RunWriter(run_dir, rank)
        for step, tensors in steps.items():
            writer.begin_step(step)
            for seq, (key, value) in enumerate(tensors.items()):
                value = (per_rank or {}).get(key, [value] * world_size)[rank]
                layout = (layouts or {}).get(key, [Layout.replicated(tuple(value.shape))] * world_size)[rank]
                meta = TensorMeta(key=key, rank=rank, dtype=str(value.dtype).removeprefix("torch."),
                                  local_shape=tuple(value.shape), layout=layout, seq=seq, stats=stats_from_tensor(value),
                                  stats_only=key in stats_only)
                writer.write(meta, None if key in stats_only else value)
            writer.end_step()
    return RunReader(run_dir)


def _amax(amax: float) -> torch.Tensor:
    """A tensor whose largest magnitude is `amax`, at its minimum."""
    return torch.tensor([-amax, amax / 2, 0.0, amax / 4])


SLOTS = ("input.0", "output.0", "input.1", "output.1")
"""The fp8 scale module's forward is recorded on its inputs and its outputs (an identity): slot 0 the input's
scale, slot 1 the weight's."""


def _fp8_run(run_dir, inputs: dict[tuple[int, int], float], weights: dict[tuple[int, str], float],
             scales: dict[TensorKey, float] | None = None) -> RunReader:
    """The linear's input amax per (step, micro-batch), its weight's per (step, slot): value.initial or the
    post-step value; every scale slot of every call recorded (`scales`: other keys' or values)."""
    steps: dict[int, dict[TensorKey, torch.Tensor]] = {}
    for (step, micro_batch), amax in inputs.items():
        steps.setdefault(step, {})[_forward(LINEAR, "input.0", step, micro_batch)] = _amax(amax)
        for slot in SLOTS:
            steps[step][_forward(SCALES, slot, step, micro_batch)] = torch.tensor([amax / 448.0])
    for (step, slot), amax in weights.items():
        steps.setdefault(step, {})[_weight(step, slot)] = _amax(amax)
    for key, value in (scales or {}).items():
        steps.setdefault(key.step, {})[key] = torch.tensor([value])
    return _write(run_dir, steps)


def test_each_scale_is_bounded_by_its_operands_amax_difference_up_to_its_own_call(tmp_path):
    """Input amaxes (reference, candidate): step 0 mb 0 (10, 10), mb 1 (10, 12); step 1 mb 0 (10, 14). Weight amaxes:
    value.initial of step 0 (2, 2.5), its post-step value (2, 2.25), which step 1's forward used. A scale's bound is the
    largest difference of its operand over the calls up to its own (a delayed scale may come from any of them), the
    same for the scale recorded on the module's input and on its output; never a later call's."""
    reference = _fp8_run(tmp_path / "reference", {(0, 0): 10.0, (0, 1): 10.0, (1, 0): 10.0},
                         {(0, PRE_STEP_SLOT): 2.0, (0, "value"): 2.0})
    candidate = _fp8_run(tmp_path / "candidate", {(0, 0): 10.0, (0, 1): 12.0, (1, 0): 14.0},
                         {(0, PRE_STEP_SLOT): 2.5, (0, "value"): 2.25})
    with reference, candidate:
        bounds = amax_bounds(reference, candidate)
    expected = {}
    for (step, micro_batch), (input_bound, weight_bound) in {(0, 0): (0.0, 0.25), (0, 1): (0.2, 0.25),
                                                             (1, 0): (0.4, 0.25)}.items():
        for slot in SLOTS:
            expected[_forward(SCALES, slot, step, micro_batch)] = input_bound if slot.endswith(".0") else weight_bound
    assert bounds.keys() == expected.keys()
    assert {key: pytest.approx(bound) for key, bound in bounds.items()} == expected


def test_a_call_whose_operand_was_not_recorded_keeps_the_bound_so_far(tmp_path):
    """Step 1's input is recorded by the reference only: its scale keeps step 0's bound; the weight's scales have
    no recorded weight at all and no bound."""
    reference = _fp8_run(tmp_path / "reference", {(0, 0): 10.0, (1, 0): 10.0}, {})
    candidate = _fp8_run(tmp_path / "candidate", {(0, 0): 11.0}, {},
                         scales={_forward(SCALES, slot, 1, 0): 11.0 / 448.0 for slot in SLOTS})
    with reference, candidate:
        bounds = amax_bounds(reference, candidate)
    assert {key: pytest.approx(bound) for key, bound in bounds.items()} == {
        _forward(SCALES, slot, step, 0): 0.1 for slot in ("input.0", "output.0") for step in (0, 1)}


def test_scales_only_one_run_recorded_and_operands_of_zero_amax_have_no_bound(tmp_path):
    only_candidate = _forward(f"{LINEAR}2.fp8_scale_inv", "input.0")
    reference = _fp8_run(tmp_path / "reference", {(0, 0): 0.0}, {})
    candidate = _fp8_run(tmp_path / "candidate", {(0, 0): 3.0}, {}, scales={only_candidate: 1.0})
    with reference, candidate:
        assert amax_bounds(reference, candidate) == {}  # (a reference amax of 0: no relative difference)


def test_the_weight_scale_of_a_root_linear_is_bounded_by_the_roots_weight(tmp_path):
    """A model that is itself an fp8 linear: its scale module is "fp8_scale_inv", its weight "weight"."""
    def run(run_dir, amax: float) -> RunReader:
        weight = TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="param", fqn="weight", slot=PRE_STEP_SLOT)
        return _write(run_dir, {0: {weight: _amax(amax), _forward("fp8_scale_inv", "input.1"): torch.tensor([amax / 448])}})

    with run(tmp_path / "reference", 2.0) as reference, run(tmp_path / "candidate", 2.5) as candidate:
        assert amax_bounds(reference, candidate) == {_forward("fp8_scale_inv", "input.1"): pytest.approx(0.25)}


SCALE = 2.0**-8
"""A power of two: the copies below are exactly 2**-20 and 2**-23 apart (relative) in fp32."""
DRIFTING, ONE_ROUNDING, EQUAL, STATS_ONLY, NO_LAYOUT = (_forward(f"layers.{i}.fc1.fp8_scale_inv", "output.0") for i in range(5))


@pytest.fixture
def candidate(tmp_path):
    """Two TP ranks' copies of five candidate-only scales: 2**-20 apart (8 roundings of fp32), 2**-23 apart (one),
    equal, recorded stats-only, and of shapes the two ranks disagree on."""
    scale = torch.tensor([SCALE])
    apart = {DRIFTING: [scale, scale * (1 + 2.0**-20)], ONE_ROUNDING: [scale, scale * (1 + 2.0**-23)],
             STATS_ONLY: [scale, scale * 2], NO_LAYOUT: [scale, torch.tensor([SCALE, SCALE])]}
    layouts = {NO_LAYOUT: [Layout.replicated((1,)), Layout.replicated((2,))]}
    with _write(tmp_path, {0: {key: scale for key in (DRIFTING, ONE_ROUNDING, EQUAL, STATS_ONLY, NO_LAYOUT)}}, world_size=2,
                per_rank=apart, stats_only=frozenset({STATS_ONLY}), layouts=layouts) as reader:
        yield reader


def test_a_scale_whose_replicas_differ_by_more_than_one_rounding_is_a_failing_row(candidate):
    (row,) = replica_disagreements(candidate, [DRIFTING, ONE_ROUNDING, EQUAL, STATS_ONLY, NO_LAYOUT])
    assert (row.key, row.status, row.dtype, row.shape, row.decided_by) == (
        DRIFTING, ComparisonStatus.REPLICA_DRIFT, "float32", (1,), "replica drift")
    assert row.replica_drift == ReplicaDrift(ranks=(0, 1), max_abs_diff=2.0**-28, relative_diff=2.0**-20)
    assert row.ratio == row.drift_ratio == 8.0
    assert row.tolerance == Tolerance(
        rel=F32_EPS, abs=0.0, drift_rel=F32_EPS, method="replicas", params=(("eps", F32_EPS),),
        source="candidate only: replicas of a quantization scale may differ by one rounding of its dtype (float32); the "
               "reference has no scale to compare with")
    assert row.message == ("replica drift ratio 8: ranks 0, 1 cast their shards with scales 9.54e-07 apart (relative), so "
                           "the amax was not reduced over the group that shares this tensor")
    assert not row


def test_no_row_for_scales_whose_replicas_agree_or_cannot_be_judged(candidate):
    """Within one rounding, bitwise equal, stats-only (no values) or a layout canonicalize refuses (reported where
    the key is compared with values): no row."""
    assert replica_disagreements(candidate, [ONE_ROUNDING, EQUAL, STATS_ONLY, NO_LAYOUT]) == []
    assert replica_disagreements(candidate, []) == []
    assert candidate.read(candidate.index[ONE_ROUNDING][1]).item() / SCALE - 1 == 2.0**-23  # exactly one rounding apart
