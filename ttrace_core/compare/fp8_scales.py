"""Part of stage 3 (compare): how far an fp8 scale may move, from the amax it follows.

An fp8 cast scales its operand by fp8_max / amax (TE's current scaling: this call's amax; delayed
scaling: the largest amax of a history of earlier calls). The inverse scale a linear used is
recorded through its identity child `<linear>.fp8_scale_inv` (integrations/fp8.py): slot 0 scales
the linear's input, slot 1 its weight. A scale is one heavy-tailed number, and a few perturbed
re-runs give a few draws of it; but whatever recipe computed it, a correct scale differs between
two runs by no more than the amaxes it was computed from differ. Both runs recorded those operands,
so their amaxes (the largest |value| over the shards' recorded min and max, no tensor read) bound
the scale's deviation: the largest relative amax difference of every call up to this one.
"""

from __future__ import annotations

import dataclasses

from ttrace_core.compare.tolerances import storage_epsilon
from ttrace_core.format.naming import fp8_scale_linear
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
        return dataclasses.replace(key, fqn=linear, slot="input.0")
    return pre_step_key(reader, TensorKey(step=key.step, micro_batch=NO_MICRO_BATCH, phase="param",
                                          fqn=f"{linear}.weight", slot="value"))


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
    to this one (a delayed scale may come from any of them), for the scales both runs recorded."""
    scales = sorted((k for k in reference.index if is_fp8_scale(k) and k in candidate.index),
                    key=lambda k: (k.fqn, k.slot, k.step, k.micro_batch, k.call))
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
