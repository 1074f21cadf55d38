"""Part of stage 3 (compare): how far an fp8 scale may move, from the amax it follows.

An fp8 cast scales its operand by fp8_max / amax (TE's current scaling: this call's amax; delayed
scaling: the largest amax of a history of earlier calls). The inverse scale a linear used is
recorded through its identity child `<linear>.fp8_scale_inv` (integrations/fp8.py): slot 0 scales
the linear's input, slot 1 its weight. A scale is one heavy-tailed number, and a few perturbed
re-runs give a few draws of it; but whatever recipe computed it, a correct scale differs between
two runs by no more than the amaxes it was computed from differ. Both runs recorded those operands,
so their amaxes (the largest |value| over the shards' recorded min and max, no tensor read) bound
the scale's deviation: the largest relative amax difference of every call up to this one.

A candidate's own scales, when the reference has none: an fp8 candidate judged against a bf16
reference records quantization scales (`fp8_scale_inv`) that the reference cannot have. Their values have nothing to be compared with, but
their replicas do: every TP rank of a linear must cast its shard of a logical tensor with the scale of
the whole tensor (an amax all-reduced over the right group, then the same fp32 arithmetic), so a
correct run's replicas of a scale are bitwise equal. A scale whose replicas differ, by more than one
rounding of its dtype, is an amax reduced over the wrong group (or not at all): TP ranks quantize
their shards differently, which the values downstream hide under the fp8 quantization noise.
"""

from __future__ import annotations

import msgspec

from ttrace_core.canonicalize.logical_value import canonical_tensor
from ttrace_core.compare.results import ComparisonStatus, TensorComparison, Tolerance
from ttrace_core.compare.tolerances import storage_epsilon
from ttrace_core.errors import LayoutError
from ttrace_core.format.naming import fp8_scale_linear, parameter_of
from ttrace_core.format.reader import RunReader, pre_step_key
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey, TensorMeta

OPERAND_OF_SLOT = {"input.0": "input", "output.0": "input", "input.1": "weight", "output.1": "weight"}
"""Which operand of the linear each slot of its `fp8_scale_inv` child is the inverse scale of."""


def logical_amax(metas: list[TensorMeta]) -> float | None:
    """max |value| of a logical tensor from its shards' recorded statistics; None when a shard has none
    or holds partial values (the amax of a sum is not the amax of its terms)."""
    largest = 0.0
    for meta in metas:
        if meta.stats is None or any(p.startswith("P") for p in meta.layout.placements):
            return None
        largest = max(largest, abs(meta.stats.min) / meta.scale, abs(meta.stats.max) / meta.scale)
    return largest


def _operand_key(key: TensorKey, reader: RunReader) -> TensorKey | None:
    """Where the operand a scale key scales is recorded in `reader`: the linear's forward input, or its
    weight as it was before this step."""
    linear = fp8_scale_linear(key.fqn)
    if OPERAND_OF_SLOT[key.slot] == "input":
        return msgspec.structs.replace(key, fqn=linear, slot="input.0")
    return pre_step_key(reader, TensorKey(step=key.step, micro_batch=NO_MICRO_BATCH, phase="param",
                                          fqn=parameter_of(linear, "weight"), slot="value"))


def _amax_deviation(key: TensorKey, reference: RunReader, candidate: RunReader) -> float | None:
    """|amax_candidate / amax_reference - 1| of the operand `key` scales, None when either run lacks it."""
    ref_key, cand_key = _operand_key(key, reference), _operand_key(key, candidate)
    if ref_key is None or cand_key is None or ref_key not in reference.index or cand_key not in candidate.index:
        return None
    expected, actual = logical_amax(reference.index[ref_key]), logical_amax(candidate.index[cand_key])
    if expected is None or actual is None or expected == 0.0:
        return None
    return abs(actual / expected - 1.0)


def scale_replica_rel(dtype: str) -> float:
    """How far replicas of a scale may differ, relative: one rounding of its own dtype. Every rank that shares a
    logical tensor casts it with the scale of the whole tensor, an amax all-reduced over that group and then
    the same fp32 arithmetic, so a correct run's replicas are bitwise equal; the compute dtype's eps, which
    the other tensors' replicas get, would hide per-rank scales a few percent apart."""
    return storage_epsilon(dtype)


def is_fp8_scale(key: TensorKey) -> bool:
    return key.phase == "forward" and fp8_scale_linear(key.fqn) is not None and key.slot in OPERAND_OF_SLOT


def amax_bounds(reference: RunReader, candidate: RunReader) -> dict[TensorKey, float]:
    """Scale key -> the largest relative amax difference of its operand over every call of the linear up
    to this one (a delayed scale may come from any of them), for the scales both runs recorded. The calls in
    order, each scale module's slots side by side: a scale recorded on the module's output (the same scale as
    its input, an identity) is bounded by the same calls, never by later ones."""
    scales = sorted((k for k in reference.index if is_fp8_scale(k) and k in candidate.index),
                    key=lambda k: (k.fqn, k.step, k.micro_batch, k.call, k.slot))
    bounds: dict[TensorKey, float] = {}
    running: dict[tuple[str, str], float] = {}
    for key in scales:
        operand = (key.fqn, OPERAND_OF_SLOT[key.slot])
        deviation = _amax_deviation(key, reference, candidate)
        if deviation is not None:
            running[operand] = max(running.get(operand, 0.0), deviation)
        if operand in running:
            bounds[key] = running[operand]
    return bounds


def replica_disagreements(candidate: RunReader, keys: list[TensorKey]) -> list[TensorComparison]:
    """A failing row for each of `keys` (candidate-only scales) whose replicas differ by more than one
    rounding of the stored dtype; the keys whose replicas agree give no row (the comparison notes them)."""
    rows = []
    for key in keys:
        metas = candidate.index[key]
        if metas[0].stats_only:
            continue
        try:
            drift = canonical_tensor(candidate, metas, key).replica_drift
        except LayoutError:
            continue  # (a layout the canonicalizer refuses is reported where the key is compared with values)
        allowed = scale_replica_rel(metas[0].dtype)
        if drift is None or drift.relative_diff <= allowed:
            continue
        ratio = drift.relative_diff / allowed if allowed > 0 else float("inf")
        tolerance = Tolerance(rel=allowed, abs=0.0, drift_rel=allowed, method="replicas",
                              params=(("eps", allowed),),
                              source="candidate only: replicas of a quantization scale may differ by one rounding of "
                                     f"its dtype ({metas[0].dtype}); the reference has no scale to compare with")
        rows.append(TensorComparison(
            key=key, status=ComparisonStatus.REPLICA_DRIFT, dtype=metas[0].dtype, shape=metas[0].layout.global_shape,
            tolerance=tolerance, replica_drift=drift, ratio=ratio, drift_ratio=ratio, decided_by="replica drift",
            message=f"replica drift ratio {ratio:.3g}: ranks {', '.join(map(str, drift.ranks))} cast their shards with "
                    f"scales {drift.relative_diff:.3g} apart (relative), so the amax was not reduced over the group "
                    f"that shares this tensor"))
    return rows


def scale_owner(key: TensorKey) -> tuple[int, int, int, str]:
    """(step, micro-batch, call, linear fqn): the forward call whose outputs a scale row goes before."""
    return key.step, key.micro_batch, key.call, key.fqn.rsplit(".", 1)[0]
