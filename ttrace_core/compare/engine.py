"""Stage 3 of record -> canonicalize -> compare -> localize -> render.

Input: a reference and a candidate `RunReader` and a `ToleranceProvider`. Output: a
`RunComparison`, one `TensorComparison` per logical tensor in execution order (forward, backward,
reduced parameter gradients, post-step parameters), each truthy when it passes and carrying the
numbers behind its verdict. Structure is checked before values: key sets, then shape and dtype,
then values promoted to float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ttrace_core.canonicalize import placements as pl
from ttrace_core.compare.bounded import compare_in_slabs, slab_dims, working_bytes
from ttrace_core.compare.batched import SmallPair, batchable, batched_sums
from ttrace_core.compare.metrics import ValueMetrics, ValueSums, metrics_from_sums, torch_on_one_thread, value_sums
from ttrace_core.canonicalize.logical_value import canonical_tensor
from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.compare.exact_inputs import ExactInputs
from ttrace_core.errors import LayoutError, TtraceError
from ttrace_core.compare.results import (
    VALUE_STATUSES, ComparisonStatus, RunComparison, StructureTest, TensorComparison, Tolerance,
)
from ttrace_core.compare.fp8_scales import replica_disagreements, scale_owner
from ttrace_core.compare.module_bias import module_bias
from ttrace_core.compare.shard_errors import candidate_shards, worst_shard
from ttrace_core.compare.routed_rows import TokenAlignment, token_alignment
from ttrace_core.compare.plan import ComparePlan, plan_comparison
from ttrace_core.compare.roundoff_steps import SEEN_PHASES, RoundoffSteps
from ttrace_core.compare.window import window_sums
from ttrace_core.compare.structure import (REPLICA_UPDATE, bias_to_value, detectable_error, replica_update_test, rounding_spread,
                                          statistics, structure_tests, with_exact_inputs)
from ttrace_core.compare.settings import CompareSettings
from ttrace_core.compare.evidence import (
    data_mismatch_finding, inconsistency, micro_batch_mismatch_finding, quantization_only, shape_mismatch_message, tally_coverage,
)
from ttrace_core.format.schema import TensorKey, TensorMeta
from ttrace_core.format.reader import RunReader, pre_step_key
from ttrace_core.format.tensor_index import collector_paused
from ttrace_core.compare.tolerances import (
    DEFAULT_EXACT_INPUTS_K, ToleranceProvider, exact_inputs_tolerance, near_miss_note, storage_epsilon, untightened,
    within_of_zero,
)
from ttrace_core.compare.step_scalars import tolerances_from_settings


@dataclass(frozen=True, slots=True)
class ScaledValues:
    """A logical tensor as stored (its recorded dtype, the recording's loss scale still applied): the
    comparison promotes it to float64 chunk by chunk (metrics.py), so no float64 copy of it is made
    unless a structure test needs one."""

    values: torch.Tensor
    scale: float

    def float64(self) -> torch.Tensor:
        """The logical values in float64 with the loss scale undone."""
        return self.values.double() / self.scale


def compare_values(actual: torch.Tensor | ScaledValues, expected: torch.Tensor | ScaledValues,
                   tolerance: Tolerance) -> ValueMetrics:
    """Metrics of actual vs expected (same shape) under one tolerance; a plain tensor has scale 1."""
    actual, expected = (v if isinstance(v, ScaledValues) else ScaledValues(v, 1.0) for v in (actual, expected))
    sums = value_sums(actual.values, expected.values, tolerance, scales=(actual.scale, expected.scale))
    return metrics_from_sums(sums, tolerance)


def _verdict(metrics: ValueMetrics, drift: ReplicaDrift | None, tolerance: Tolerance) -> tuple[ComparisonStatus, str]:
    """The status and its message. A tensor can fail two ways at once, against the reference
    (mismatch) and between its own replicas (replica drift); the message gives both ratios and the
    larger one decides, so the status, the `ratio` column and the text always agree."""
    (nan_candidate, nan_reference), (inf_candidate, inf_reference) = metrics.num_nan, metrics.num_inf
    if nan_candidate or nan_reference or inf_candidate or inf_reference or metrics.num_nonfinite_apart:
        counts = f"candidate {nan_candidate}/{inf_candidate}, reference {nan_reference}/{inf_reference}"
    if nan_candidate != nan_reference or inf_candidate != inf_reference:
        return ComparisonStatus.NONFINITE, f"NaN/Inf counts differ: {counts}"
    if apart := metrics.num_nonfinite_apart:
        return ComparisonStatus.NONFINITE, f"NaN/Inf in other places: {apart} elements are NaN or Inf in one run and " \
                                           f"not the same value in the other (counts {counts})"
    value_ratio, drift_ratio = metrics.ratio, _drift_ratio(drift, tolerance)
    if value_ratio <= 1 and drift_ratio <= 1:  # (most rows: nothing to word)
        return ComparisonStatus.PASS, ""
    mismatch = f"mismatch ratio {value_ratio:.3g} (relative error {metrics.error:.3g}, tolerance {tolerance.rel:.3g})"
    if drift_ratio > 1:
        drifting = f"replica drift ratio {drift_ratio:.3g} (replicas on ranks {drift.ranks} differ by " \
                   f"{drift.relative_diff:.3g} relative)"
        if value_ratio > 1:
            decided = "replica drift" if drift_ratio > value_ratio else "mismatch"
            return (ComparisonStatus.REPLICA_DRIFT if decided == "replica drift" else ComparisonStatus.MISMATCH), \
                f"{mismatch}; {drifting}; decided by {decided}"
        return ComparisonStatus.REPLICA_DRIFT, f"{drifting}; {mismatch}"
    if value_ratio > 1:
        return ComparisonStatus.MISMATCH, mismatch
    return ComparisonStatus.PASS, ""


def _judged_row(key: TensorKey, metrics: ValueMetrics, drift: ReplicaDrift | None, tolerance: Tolerance, dtype: str,
               note: str = "") -> TensorComparison:
    """The row of a tensor compared by value: its metrics and replica drift judged under `tolerance`
    (`note` goes before the verdict's message)."""
    status, message = _verdict(metrics, drift, tolerance)
    drift_ratio = _drift_ratio(drift, tolerance)
    return TensorComparison(
        key=key, status=status, message=f"{note}; {message}" if note and message else note or message, dtype=dtype,
        shape=metrics.shape, numel=metrics.numel, error=metrics.error, abs_error=metrics.abs_error,
        reference_norm=metrics.reference_norm, tolerance=tolerance, ratio=max(metrics.ratio, drift_ratio),
        value_ratio=metrics.ratio, drift_ratio=drift_ratio, min_rel_tolerance=metrics.min_rel_tolerance,
        max_abs_diff=metrics.max_abs_diff, max_abs_index=metrics.max_abs_index, max_rel_diff=metrics.max_rel_diff,
        max_rel_index=metrics.max_rel_index, num_mismatched=metrics.num_mismatched, num_nan=metrics.num_nan,
        num_inf=metrics.num_inf, num_nonfinite_apart=metrics.num_nonfinite_apart, replica_drift=drift)


def _drift_ratio(drift: ReplicaDrift | None, tolerance: Tolerance) -> float:
    """How far candidate replicas disagree, in units of the tensor's relative tolerance (0 within abs)."""
    if drift is None or drift.max_abs_diff <= tolerance.abs:
        return 0.0
    allowed = tolerance.rel if tolerance.drift_rel is None else tolerance.drift_rel
    if allowed > 0:
        return drift.relative_diff / allowed
    return 0.0 if drift.relative_diff == 0 else math.inf


def _canonical_norm(metas: list[TensorMeta], key: TensorKey) -> float:
    """Frobenius norm of the logical tensor from per-shard stats (stats-only traces)."""
    layout = metas[0].layout
    if pl.axes_of_kind(layout, "partial"):
        raise LayoutError(f"{key}: partial placements cannot be combined from stats; record this tensor with values")
    sumsq_by_region = {pl.local_region(m.layout): m.stats.sumsq / m.scale**2 for m in metas if m.stats}
    return math.sqrt(sum(sumsq_by_region.values()))


def _norm_of(reader: RunReader, metas: list[TensorMeta], key: TensorKey) -> float:
    """The logical tensor's Frobenius norm (finite values, loss scale undone): from its shards'
    statistics, or from its values when the shards hold them (a partial sum in a stats-only trace)."""
    if metas[0].stats_only:
        return _canonical_norm(metas, key)
    values = canonical_tensor(reader, metas, key).full.double() / metas[0].scale
    return float(torch.linalg.vector_norm(torch.where(torch.isfinite(values), values, 0.0))) if values.numel() else 0.0


def _compare_stats(key: TensorKey, reference: RunReader, candidate: RunReader, tolerance: Tolerance) -> TensorComparison:
    ref, cand = reference.index[key], candidate.index[key]
    expected, actual = _norm_of(reference, ref, key), _norm_of(candidate, cand, key)
    numel = math.prod(ref[0].layout.global_shape)
    abs_error = abs(actual - expected)
    allowed = tolerance.rel * expected + tolerance.abs * math.sqrt(numel)
    ratio = abs_error / allowed if allowed > 0 else (0.0 if abs_error == 0 else math.inf)
    status = ComparisonStatus.PASS if ratio <= 1 else ComparisonStatus.MISMATCH
    return TensorComparison(
        key=key, status=status, dtype=cand[0].dtype, shape=ref[0].layout.global_shape, numel=numel,
        error=abs_error / expected if expected > 0 else math.inf, abs_error=abs_error, reference_norm=expected,
        tolerance=tolerance, ratio=ratio, value_ratio=ratio, stats_only=True, decided_by="mismatch",
        message="stats-only: compares norms, a lower bound of the error"
        + ("" if status == ComparisonStatus.PASS else " (exceeds tolerance)"),
    )


@dataclass(slots=True)
class AssembledPair:
    """A tensor's logical values in both runs, read and assembled: what compare_tensor judges. A small tensor
    summed straight from its shards' bytes (window.py) comes without them (None): compare_tensor reads and
    assembles it again only when a structure test or another tolerance needs its values."""

    actual: ScaledValues | None
    expected: ScaledValues | None
    replica_drift: ReplicaDrift | None
    sums: ValueSums | None = None
    """Computed ahead with other small tensors (batched.py), under `sums_tolerance`."""
    sums_tolerance: Tolerance | None = None
    tightened: tuple[Tolerance, ValueSums] | None = None
    """The sums computed ahead under the tighter tolerance the exact-inputs rule would give the tensor, should the
    rule apply when its turn comes (`prepare_small`)."""

    def _ahead(self, tolerance: Tolerance) -> ValueSums | None:
        for taken, sums in ((self.sums_tolerance, self.sums), self.tightened or (None, None)):
            if sums is not None and (taken is tolerance or taken == tolerance):
                return sums
        return None

    def holds_sums_under(self, tolerance: Tolerance) -> bool:
        """Whether sums under `tolerance` were computed ahead (the values need not be read again)."""
        return self._ahead(tolerance) is not None

    def sums_under(self, tolerance: Tolerance) -> ValueSums:
        """The value sums under `tolerance` (its mismatch count depends on it): those computed ahead when
        they were taken under it, else computed now. A small tensor is summed as in a batch wherever it is
        compared, so that its row is the same bits whichever tensors it was batched with, if any (partition.py's
        workers compare a share of the keys each)."""
        if (ahead := self._ahead(tolerance)) is not None:
            return ahead
        actual, expected = self.actual, self.expected
        if batchable(expected.values.numel()):
            found = batched_sums([SmallPair(actual.values, expected.values, actual.scale, expected.scale, tolerance)])[0]
            if found is not None:
                return found
        return value_sums(actual.values, expected.values, tolerance, scales=(actual.scale, expected.scale))


def assemble_pair(key: TensorKey, reference: RunReader, candidate: RunReader) -> AssembledPair | TensorComparison:
    """Both runs' logical tensors of `key` (their metadata agreeing in shape and dtype), or a SHAPE row when the
    assembled tensors still differ in shape; LayoutError when the shards cannot be assembled."""
    ref_metas, cand_metas = reference.index[key], candidate.index[key]
    cand_full = canonical_tensor(candidate, cand_metas, key)
    actual = ScaledValues(cand_full.full, cand_metas[0].scale)
    expected = ScaledValues(canonical_tensor(reference, ref_metas, key).full, ref_metas[0].scale)
    if actual.values.shape != expected.values.shape:
        return TensorComparison(key=key, status=ComparisonStatus.SHAPE, dtype=cand_metas[0].dtype,
                                shape=tuple(actual.values.shape),
                                message=f"shape {tuple(actual.values.shape)} in the candidate, "
                                        f"{tuple(expected.values.shape)} in the reference")
    return AssembledPair(actual, expected, cand_full.replica_drift)


def compare_tensor(key: TensorKey, reference: RunReader, candidate: RunReader, tolerances: ToleranceProvider,
                   *, ignore_dtype: bool = False, exact_inputs: tuple[float, int] | None = None,
                   max_bytes: int | None = None, assembled: AssembledPair | None = None) -> TensorComparison:
    """`exact_inputs` (k, n): everything this tensor is computed from was exact and it combines at
    most n partial results, so it is also held to k * sqrt(n) * eps (exact_inputs.py) when tighter.
    `max_bytes`: compare a tensor whose values would take more, slab by slab (bounded.py).
    `assembled`: its values, already read (`prepare_small`)."""
    ref_metas, cand_metas = reference.index[key], candidate.index[key]
    ref_dtype, cand_dtype = ref_metas[0].dtype, cand_metas[0].dtype
    # (a key read ahead was summed under its own tolerance, asked of the provider then)
    tolerance = own = assembled.sums_tolerance if assembled is not None and assembled.sums_tolerance is not None \
        else tolerances.tolerance_for(key, cand_dtype)
    if exact_inputs:
        tolerance = exact_inputs_tolerance(own, candidate.manifest.precision, cand_dtype, *exact_inputs)
    if ref_dtype != cand_dtype and not ignore_dtype:
        return TensorComparison(key=key, status=ComparisonStatus.DTYPE, dtype=cand_dtype,
                                message=f"dtype {cand_dtype} in the candidate, {ref_dtype} in the reference")
    reshaped = ref_metas[0].layout.global_shape != cand_metas[0].layout.global_shape
    if reshaped or (reference.tokens and candidate.tokens):  # a routed expert sent other tokens (routed_rows.py)
        if (aligned := token_alignment(key, reference, candidate)) is not None and \
                not ref_metas[0].stats_only and not cand_metas[0].stats_only:
            return _compare_aligned_rows(key, reference, candidate, tolerance, aligned)
    if reshaped:
        return TensorComparison(key=key, status=ComparisonStatus.SHAPE, dtype=cand_dtype, shape=cand_metas[0].layout.global_shape,
                                message=shape_mismatch_message(key, ref_metas[0].layout, cand_metas[0].layout))
    dims, structure, units = None, [], StructureUnits()
    try:
        if ref_metas[0].stats_only or cand_metas[0].stats_only:
            return _compare_stats(key, reference, candidate, tolerance)
        if assembled is None and (dims := slab_dims(ref_metas, cand_metas, max_bytes)):  # (prepare_small took none cut in slabs)
            metrics, replica_drift = compare_in_slabs(key, reference, candidate, tolerance, max_bytes, dims)
        else:
            pair = assembled or assemble_pair(key, reference, candidate)
            shape = ref_metas[0].layout.global_shape  # (what its shards assemble into)
            if isinstance(pair, AssembledPair) and pair.actual is None and (
                    not pair.holds_sums_under(tolerance) or _has_structure_tests(tolerances, key, cand_dtype, shape)):
                pair = assemble_pair(key, reference, candidate)  # its values are needed after all
            if isinstance(pair, TensorComparison):
                return pair
            actual, expected, replica_drift = pair.actual, pair.expected, pair.replica_drift
            metrics = metrics_from_sums(pair.sums_under(tolerance), tolerance)
            if tolerance is not own and metrics.ratio > 1 and within_of_zero(own, metrics.reference_norm, metrics.numel):
                tolerance = untightened(own)
                metrics = metrics_from_sums(pair.sums_under(own), tolerance)
            structure, units = [], StructureUnits()
            if actual is not None:
                structure, units = _structure(key, actual, expected, reference, candidate, tolerances, cand_dtype,
                                              tolerance, replica_drift)
    except LayoutError as error:
        return TensorComparison(key=key, status=ComparisonStatus.LAYOUT, dtype=cand_dtype, message=str(error))
    comparison = _judged_row(key, metrics, replica_drift, tolerance, cand_dtype)
    _judge_structure(comparison, structure, units)  # (none on slabs: bounded.py reads no whole tensor)
    return comparison


def _compare_aligned_rows(key: TensorKey, reference: RunReader, candidate: RunReader, tolerance: Tolerance,
                          aligned: TokenAlignment) -> TensorComparison:
    """A routed expert's tensor on the tokens both runs sent it (routed_rows.py); no structure tests, whose
    statistics assume the whole tensor."""
    ref_metas, cand_metas = reference.index[key], candidate.index[key]
    try:
        cand_full = canonical_tensor(candidate, cand_metas, key)
        expected_full = canonical_tensor(reference, ref_metas, key).full
    except LayoutError as error:
        return TensorComparison(key=key, status=ComparisonStatus.LAYOUT, dtype=cand_metas[0].dtype, message=str(error))
    actual = ScaledValues(cand_full.full.index_select(0, aligned.candidate_rows), cand_metas[0].scale)
    expected = ScaledValues(expected_full.index_select(0, aligned.reference_rows), ref_metas[0].scale)
    return _judged_row(key, compare_values(actual, expected, tolerance), cand_full.replica_drift, tolerance,
                      cand_metas[0].dtype, note=aligned.note)


@dataclass(frozen=True, slots=True)
class StructureUnits:
    """What turns a structure test's tolerance into a relative error of the tensor (detectable_error)."""

    update_to_value: float | None = None
    """||E - E_before|| / ||E|| of a post-step parameter."""
    bias_ratio: float | None = None
    """sqrt(R) ||b|| / ||E|| of a forward output whose module has a bias b."""


def _structure(key: TensorKey, actual: ScaledValues, expected: ScaledValues, reference: RunReader, candidate: RunReader,
               tolerances: ToleranceProvider, dtype: str, tolerance: Tolerance, replica_drift: ReplicaDrift | None
               ) -> tuple[list[StructureTest], StructureUnits]:
    """The structure tests of one tensor (compare/structure.py) and the units of its update and bias tests.
    `tolerance`: the norm test's, whose exact-inputs bound (when it applies) tightens the structure tests
    too; a post-step parameter's `replica_drift` is also judged in units of its update."""
    derive = getattr(tolerances, "structure_tolerances", None)
    shape = tuple(expected.values.shape)
    if not _has_structure_tests(tolerances, key, dtype, shape):
        return [], StructureUnits()
    actual, expected = actual.float64(), expected.float64()  # only here: most tolerances have no structure tests
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return [], StructureUnits()
    before = _values_before_step(key, reference, candidate)
    bias = module_bias(reference, key)
    units = StructureUnits(bias_ratio=bias_to_value(expected, bias))
    if before is not None and (norm := float(torch.linalg.vector_norm(expected))) > 0:
        units = StructureUnits(update_to_value=float(torch.linalg.vector_norm(expected - before[1])) / norm,
                               bias_ratio=units.bias_ratio)
    allowed = derive(key, dtype, shape, units.update_to_value)
    if tolerance.method == "exact-inputs":
        allowed = with_exact_inputs(allowed, tolerance.rel, shape, rounding_spread(expected))
    diff = actual - expected
    measured = statistics(diff, expected, None if before is None else (before[0] - before[1], before[1]), bias)
    shards = candidate_shards(candidate.index[key])
    worst = worst_shard(diff, expected, shards) if shards else None
    if worst is not None:
        measured["shard"] = worst[0]
    tests = [_with_shard_owner(test, worst) for test in structure_tests(measured, allowed, units.bias_ratio)]
    if units.update_to_value and replica_drift is not None and (replicas := replica_update_test(
            replica_drift.relative_diff, replica_drift.ranks, units.update_to_value, expected.numel(), storage_epsilon(dtype))):
        tests.append(replicas)
    return tests, units


def _has_structure_tests(tolerances: ToleranceProvider, key: TensorKey, dtype: str, shape: tuple[int, ...]) -> bool:
    derive = getattr(tolerances, "structure_tolerances", None)
    return derive is not None and bool(derive(key, dtype, shape))


def _with_shard_owner(test: StructureTest, worst: tuple[float, tuple[int, ...], float] | None) -> StructureTest:
    """A failing shard test's finding names the ranks that held the shard and how the other shards fared."""
    if test.name != "shard" or not test.finding or worst is None:
        return test
    _, ranks, others = worst
    owner = f"rank {ranks[0]}'s shard" if len(ranks) == 1 else f"the shard of ranks {', '.join(map(str, ranks))}"
    where = f"{owner} only" if others <= test.tolerance else f"every shard, the worst {owner}"
    return dataclasses.replace(test, finding=f"{where}: {test.finding}; the other shards' errors are at most {others:.3g}")


def _values_before_step(key: TensorKey, reference: RunReader, candidate: RunReader
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(candidate, reference) values of a post-step parameter before its step, when both runs hold them."""
    ref_key, cand_key = pre_step_key(reference, key), pre_step_key(candidate, key)
    if ref_key is None or cand_key is None:
        return None
    values = []
    for reader, before in ((candidate, cand_key), (reference, ref_key)):
        metas = reader.index[before]
        if metas[0].stats_only:
            return None
        values.append(canonical_tensor(reader, metas, before).full.double() / metas[0].scale)
    if not all(torch.isfinite(v).all() for v in values):
        return None
    return values[0], values[1]


def _judge_structure(comparison: TensorComparison, tests: list[StructureTest], units: StructureUnits) -> None:
    """Fold the structure tests into the row: the largest ratio decides, the message names the test and
    states the transform it found; `detectable` is the smallest error any test catches."""
    comparison.structure = tests
    if comparison.error is not None and comparison.tolerance is not None:
        comparison.detectable = detectable_error(comparison.tolerance.rel, tests, units.update_to_value, units.bias_ratio)
    if not tests or comparison.status not in VALUE_STATUSES:
        return
    worst = max(tests, key=lambda t: t.ratio)
    if worst.ratio <= 1:
        if worst.ratio > (comparison.ratio or 0.0):  # a pass's headroom is that of its closest test
            comparison.ratio, comparison.decided_by = worst.ratio, worst.name
        return
    said = f"{worst.name} ratio {worst.ratio:.3g}: {worst.finding}"
    failed_as = ComparisonStatus.REPLICA_DRIFT if worst.name == REPLICA_UPDATE else ComparisonStatus.MISMATCH
    if worst.ratio > (comparison.ratio or 0.0):
        before = comparison.message.split("; decided by ")[0]
        comparison.ratio, comparison.decided_by, comparison.status = worst.ratio, worst.name, failed_as
        comparison.message = f"{said}; {before or 'norm ratio ' + format(comparison.value_ratio, '.3g')}; decided by {worst.name}"
    else:
        comparison.message = f"{comparison.message}; {said}"
        if comparison.status == ComparisonStatus.PASS:
            comparison.status = failed_as


def compare_key(key: TensorKey, reference: RunReader, candidate: RunReader, plan: ComparePlan,
                num_terms: int | None = None, assembled: AssembledPair | None = None) -> TensorComparison:
    """One row: inconsistent metadata first, then values; held to the exact-inputs rule when `num_terms`.
    `assembled`: its values read ahead by `prepare_small`, which checked its metadata."""
    comparison = None if assembled is not None else _inconsistent(key, reference, candidate)
    if comparison is not None:
        return comparison
    exact_inputs = (plan.exact_inputs_k, num_terms) if num_terms and plan.exact_inputs_k else None
    return compare_tensor(key, reference, candidate, plan.tolerances, ignore_dtype=plan.ignore_dtype,
                          exact_inputs=exact_inputs, max_bytes=plan.max_bytes, assembled=assembled)


WINDOW_KEYS = 1024
"""Keys `compare_runs` reads ahead of its rows, so that their small tensors are compared in one batch."""


def read_ahead(keys: list[TensorKey], reference: RunReader, candidate: RunReader, plan: ComparePlan,
               wanted: set[TensorKey] | None = None, exact: ExactInputs | None = None
               ) -> Iterator[tuple[TensorKey, AssembledPair | None]]:
    """Each of `keys` in order, with its values when `prepare_small` read them ahead (only keys in `wanted`,
    all by default), WINDOW_KEYS keys at a time; `exact`: the comparison's exact-inputs rule, if on."""
    for start in range(0, len(keys), WINDOW_KEYS):
        window = keys[start:start + WINDOW_KEYS]
        ready = prepare_small([key for key in window if wanted is None or key in wanted], reference, candidate, plan,
                              exact)
        for key in window:
            yield key, ready.pop(key, None)


def prepare_small(keys: list[TensorKey], reference: RunReader, candidate: RunReader, plan: ComparePlan,
                  exact: ExactInputs | None = None) -> dict[TensorKey, AssembledPair]:
    """The keys among `keys` whose tensors are small enough to batch (batched.py) and whose comparison
    reaches their values, read and assembled, with their value sums computed together. The rest, and any
    key that fails on the way (metadata, layout, shape), are left to `compare_key` to compare and word.
    With `exact` (the exact-inputs rule on), a key the rule may tighten is also summed under the tolerance it
    would give: whether it applies is known only once the keys before it are compared, the count of partial
    results it would combine is known now."""
    small: list[TensorKey] = []
    for key in keys:
        ref_metas, cand_metas = reference.index[key], candidate.index[key]
        ref_first, cand_first = ref_metas[0], cand_metas[0]
        shape = ref_first.layout.global_shape
        if ref_first.stats_only or cand_first.stats_only or cand_first.layout.global_shape != shape \
                or not batchable(math.prod(shape)) or (ref_first.dtype != cand_first.dtype and not plan.ignore_dtype) \
                or slab_dims(ref_metas, cand_metas, plan.max_bytes) or _inconsistent(key, reference, candidate) is not None:
            continue
        small.append(key)
    tolerances = {key: plan.tolerances.tolerance_for(key, candidate.index[key][0].dtype) for key in small}
    found = window_sums(small, reference, candidate, tolerances, plan.max_bytes)
    tight: dict[TensorKey, Tolerance] = {}
    if exact is not None and plan.exact_inputs_k:
        precision, world_size = candidate.manifest.precision, candidate.manifest.world_size
        for key in found:
            if num_terms := exact.partial_terms(key, world_size):
                own = tolerances[key]
                tighter = exact_inputs_tolerance(own, precision, candidate.index[key][0].dtype, plan.exact_inputs_k, num_terms)
                if tighter is not own:
                    tight[key] = tighter
    tightened = window_sums(list(tight), reference, candidate, tight, plan.max_bytes) if tight else {}
    return {key: AssembledPair(actual=None, expected=None, replica_drift=None, sums=sums, sums_tolerance=tolerances[key],
                               tightened=(tight[key], tightened[key]) if key in tightened else None)
            for key, sums in found.items()}


# The cyclic collector would walk every index entry and every row made so far again and again as the rows
# accumulate (a fifth of comparing 27,200 tiny tensors, measured); comparing forms no cycle worth collecting
# before it returns, and the collector runs again when it does.
@collector_paused()
@torch_on_one_thread()
def compare_runs(reference: RunReader, candidate: RunReader, tolerances: ToleranceProvider | None = None, *,
                 ignore_dtype: bool = False, progress: Callable[[int, int], None] | None = None,
                 exact_inputs_k: float | None = DEFAULT_EXACT_INPUTS_K, partial: bool = False,
                 precomputed: dict[TensorKey, TensorComparison] | None = None, max_bytes: int | None = None,
                 on_row: Callable[[TensorComparison], None] | None = None) -> RunComparison:
    """`exact_inputs_k` (None or 0: off) tightens derived tolerances (perturbation, theorem) where a
    tensor's inputs were exact (exact_inputs.py); the flat dtype table is left as it is. `partial`: a
    verdict on what was recorded, when the evidence is incomplete (RunComparison.partial_allowed).
    `precomputed`: rows already compared without the exact-inputs rule (partition.py's workers); only
    the tensors the rule applies to are compared again, so the result is the same as without them.
    `max_bytes`: compare each tensor within that many bytes (bounded.py), slab by slab where needed.
    `on_row`: called with each row as soon as it is final, in the order of `result.comparisons` (a row's
    verdict never depends on later rows, so a streamed table is the final one's prefix)."""
    result, plan = plan_comparison(reference, candidate, tolerances, ignore_dtype=ignore_dtype,
                                   exact_inputs_k=exact_inputs_k, partial=partial, max_bytes=max_bytes)
    total = len(plan.ordered) + len(plan.extras)
    # A tensor the map declares without counterpart is a source never compared: no exact-inputs rule through it.
    exact = ExactInputs(plan.common | set(plan.unmapped))
    crossed = reference.manifest.precision != candidate.manifest.precision
    scales_only = [key for key in plan.extras if crossed and quantization_only(key)]
    pending: dict[tuple, list[TensorComparison]] = {}
    for row in replica_disagreements(candidate, scales_only):
        pending.setdefault(scale_owner(row.key), []).append(row)
    wanted = plan.common.difference(precomputed) if precomputed else plan.common
    roundoff = RoundoffSteps(reference, candidate)  # an adaptive optimizer's step on round-off (roundoff_steps.py)
    for done, (key, assembled) in enumerate(read_ahead(plan.ordered, reference, candidate, plan, wanted, exact), start=1):
        if pending and key.phase == "forward" and key.slot.startswith("output"):
            for row in pending.pop((key.step, key.micro_batch, key.call, key.fqn), []):
                _append(result, row, on_row)
        if key in plan.common:
            num_terms = exact.num_partial_terms(key, candidate.manifest.world_size) if plan.exact_inputs_k else None
            known = None if precomputed is None or num_terms else precomputed.get(key)
            # (a failing row is falsy: no `or` here)
            comparison = known if known is not None else compare_key(key, reference, candidate, plan, num_terms, assembled)
            if comparison.status is ComparisonStatus.MISMATCH:
                comparison = _roundoff_judged(comparison, reference, candidate, plan, roundoff)
            if key.phase in SEEN_PHASES:
                roundoff.seen(comparison)
            # noted here, not where it was compared: a row a partitioned worker compared counts too
            if comparison.status != ComparisonStatus.INCONSISTENT and \
                    slab_dims(reference.index[key], candidate.index[key], plan.max_bytes) == []:
                plan.compared_whole[key] = working_bytes(candidate.index[key])
            exact.mark(key, comparison.exact)
            result.comparisons.append(comparison)
        else:
            result.comparisons.append(TensorComparison(key=key, status=ComparisonStatus.MISSING,
                                                       message="recorded in the reference only"))
        if on_row:
            on_row(result.comparisons[-1])
        if progress:
            progress(done, total)
    for rows in pending.values():
        for row in rows:
            _append(result, row, on_row)
    result.notes.extend(roundoff.notes())
    if scales_only:
        result.notes.append(f"{len(scales_only)} tensors only the {candidate.manifest.precision} candidate records "
                            f"(its quantization scales, e.g. {scales_only[0]}) were not compared with values: the "
                            f"{reference.manifest.precision} reference has none; their replicas were checked against "
                            f"each other")
    mapping = reference.manifest.correspondence.get("map")
    extra = "recorded in the candidate only" + (f": map {mapping} gives it no counterpart; relate it in the map or "
                                                 "declare it [[unmapped]] (docs/porting.md)" if mapping else "")
    for key in plan.extras:
        if key not in scales_only:
            _append(result, TensorComparison(key=key, status=ComparisonStatus.EXTRA, message=extra), on_row)
    if plan.compared_whole:
        key, needed = max(plan.compared_whole.items(), key=lambda item: item[1])
        result.notes.append(f"{len(plan.compared_whole)} tensors over the memory budget could not be cut into slabs "
                            f"(flat ranges, blocked placements, or every dim strided) and were compared whole, the largest {key} "
                            f"with about {needed / 2**20:.0f} MiB")
    scale_rows = set(scales_only)
    result.coverage = tally_coverage([row for row in result.comparisons if row.key not in scale_rows], reference, candidate,
                                     result.steps_compared, plan.unmapped)
    if (note := near_miss_note(plan.tolerances, reference, candidate, result.failures)) is not None:
        result.notes.append(note)
    if (finding := data_mismatch_finding(result)) is not None:
        result.notes.insert(0, finding)
    if (finding := micro_batch_mismatch_finding(reference, candidate, result.steps_compared)) is not None:
        result.notes.insert(0, finding)
    return result


def _roundoff_judged(row: TensorComparison, reference: RunReader, candidate: RunReader, plan: ComparePlan,
                     roundoff: RoundoffSteps) -> TensorComparison:
    """A failing `row`, judged again where an adaptive optimizer's step on a round-off gradient explains it
    (roundoff_steps.py): a post-step parameter under a wider tolerance, a later forward output with its module's
    bias difference taken out. The row stays as it was where that does not make it pass."""
    again, said = None, ""
    try:
        if (relaxed := roundoff.allowance(row)) is not None:
            again = compare_tensor(row.key, reference, candidate, relaxed, ignore_dtype=plan.ignore_dtype,
                                   max_bytes=plan.max_bytes)
            said = f"judged with {relaxed.extra:.3g} more per element: {relaxed.why}"
        elif (shift := roundoff.bias_shift(row)) is not None:
            again = _without_bias_shift(row, reference, candidate, shift, plan.max_bytes)
            said = (f"compared with its module's bias difference taken out (norm {float(shift.norm()):.3g}), a step "
                    "an adaptive optimizer took on round-off")
    except TtraceError:  # (unreadable now: the row stays as it was judged)
        again = None
    if again is None or not again.passed:
        return row
    roundoff.accept(again)
    return dataclasses.replace(again, message=said)


def _without_bias_shift(row: TensorComparison, reference: RunReader, candidate: RunReader, shift: torch.Tensor,
                        max_bytes: int | None) -> TensorComparison | None:
    """A forward output's row compared after `shift` (along its last dim) is taken out of the candidate's values;
    None for a tensor compared slab by slab (its whole values are over the memory budget)."""
    key = row.key
    if slab_dims(reference.index[key], candidate.index[key], max_bytes):
        return None
    pair = assemble_pair(key, reference, candidate)
    if not isinstance(pair, AssembledPair) or not pair.actual.values.dim() or pair.actual.values.shape[-1] != shift.numel():
        return None
    metrics = compare_values(pair.actual.float64() - shift, pair.expected.float64(), row.tolerance)
    return _judged_row(key, metrics, pair.replica_drift, row.tolerance, row.dtype)


def _append(result: RunComparison, row: TensorComparison, on_row: Callable[[TensorComparison], None] | None) -> None:
    result.comparisons.append(row)
    if on_row:
        on_row(row)


def _inconsistent(key: TensorKey, reference: RunReader, candidate: RunReader) -> TensorComparison | None:
    """A row for a tensor whose shards' metadata disagree, checked before any value is read."""
    for name, reader in (("candidate", candidate), ("reference", reference)):
        why = (reader.misplaced and reader.misplaced.get(key)) or inconsistency(key, reader.index[key], reader.manifest)
        if why is not None:
            return TensorComparison(key=key, status=ComparisonStatus.INCONSISTENT, dtype=reader.index[key][0].dtype,
                                    message=f"{name} metadata disagree: {why}")
    return None


def compare_readers(reference: RunReader, candidate: RunReader, settings: CompareSettings, *,
                    progress: Callable[[int, int], None] | None = None,
                    precomputed: dict[TensorKey, TensorComparison] | None = None) -> RunComparison:
    """Compare two open runs as `settings` say: the one place settings become a comparison."""
    return compare_runs(reference, candidate, tolerances_from_settings(settings, reference, candidate), progress=progress, precomputed=precomputed,
                        **settings.engine_options())
