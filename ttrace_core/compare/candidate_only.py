"""Part of stage 3 (compare): what a candidate's own tensors show when the reference has no counterpart.

An fp8 candidate judged against a bf16 reference records quantization scales (integrations/fp8.py's
`fp8_scale_inv`) that the reference cannot have. Their values have nothing to be compared with, but
their replicas do: every TP rank of a linear must cast its shard of a logical tensor with the scale of
the whole tensor (an amax all-reduced over the right group, then the same fp32 arithmetic), so a
correct run's replicas of a scale are bitwise equal. A scale whose replicas differ, by more than one
rounding of its dtype, is an amax reduced over the wrong group (or not at all): TP ranks quantize
their shards differently, which the values downstream hide under the fp8 quantization noise.
"""

from __future__ import annotations

from ttrace_core.canonicalize.logical_value import canonical_tensor
from ttrace_core.compare.results import ComparisonStatus, TensorComparison, Tolerance
from ttrace_core.compare.fp8_scales import scale_replica_rel
from ttrace_core.errors import LayoutError
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TensorKey


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
