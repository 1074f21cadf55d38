"""Part of stage 3 (compare): the value sums of many small tensors in a few vectorized passes.

Input: pairs of (actual, expected) logical tensors as stored (any dtype, loss scale still applied), each
with the tolerance it will most likely be judged under. Output: each pair's `ValueSums` (metrics.py),
the same numbers `value_sums` gives it to float rounding (the norms here are summed in another order),
or None where a pair holds NaN, Inf or values too large to square, which `value_sums` then compares
where both are finite.

Why: a typical layer holds dozens of tensors of a few thousand elements, and comparing one of them with
`value_sums` costs about fifteen numpy calls whatever its size, so a model's small tensors cost their
count, not their bytes. Here every small tensor of a batch is one segment of one float64 array, and each
number of a row is one segment-wise reduction over the whole batch (`np.add.reduceat`,
`np.maximum.reduceat`): the calls are per batch, the per-element work is what `value_sums` does.
Only tensors of at most `CHUNK_ELEMENTS` are batched: `value_sums` compares a larger one chunk by chunk,
where its per-call cost is already small against its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ttrace_core.compare.metrics import CHUNK_ELEMENTS, TINY, WORKSPACE, ValueSums, Workspace, unravel
from ttrace_core.compare.tolerances import Tolerance

SMALL_ELEMENTS = 1 << 12
"""The largest tensor batched: past it, `value_sums`'s per-call cost is small against its bytes."""
BATCH_ELEMENTS = 1 << 15
"""Elements of one batch: its float64 arrays (256 KiB each) stay in cache and are reused from batch to
batch, and torch converts it to float64 on one thread (it splits a longer copy across threads, which costs
more than it saves at this size and stalls on a busy machine)."""


assert BATCH_ELEMENTS <= CHUNK_ELEMENTS  # a batch uses metrics.py's per-thread chunk buffers


@dataclass(frozen=True, slots=True)
class SmallPair:
    """One small tensor's values in both runs, as stored, with their loss scales."""

    actual: torch.Tensor
    expected: torch.Tensor
    actual_scale: float
    expected_scale: float
    tolerance: Tolerance
    """The tolerance its mismatch count is taken under (the row's, unless the exact-inputs rule tightens it)."""


def batchable(numel: int) -> bool:
    """Whether a tensor of `numel` elements is compared in a batch (else alone, by `value_sums`)."""
    return 0 < numel <= SMALL_ELEMENTS


def batched_sums(pairs: list[SmallPair]) -> list[ValueSums | None]:
    """The sums of each pair (all `batchable`, each pair's tensors of one shape), in order."""
    found: list[ValueSums | None] = [None] * len(pairs)
    by_dtypes: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for position, pair in enumerate(pairs):
        by_dtypes.setdefault((pair.actual.dtype, pair.expected.dtype), []).append(position)
    for positions in by_dtypes.values():
        batch: list[int] = []
        elements = 0
        for position in positions:
            numel = pairs[position].expected.numel()
            assert batchable(numel), "only tensors `batchable` says are batched"  # (each fits the workspace)
            if elements + numel > BATCH_ELEMENTS:
                _batch_sums([pairs[p] for p in batch], batch, found)
                batch, elements = [], 0
            batch.append(position)
            elements += numel
        if batch:
            _batch_sums([pairs[p] for p in batch], batch, found)
    return found


def _promoted(tensors: list[torch.Tensor], scales: list[float], into: torch.Tensor, segments: np.ndarray) -> np.ndarray:
    """The tensors flattened into `into` in float64, each divided by its scale (as `values.double() / scale`)."""
    into.copy_(torch.cat([tensor.reshape(-1) for tensor in tensors]))
    values = into.numpy()
    if any(scale != 1 for scale in scales):
        np.divide(values, np.asarray(scales, dtype=np.float64)[segments], out=values)
    return values


def _first_at_max(values: np.ndarray, starts: np.ndarray, segments: np.ndarray, spare: np.ndarray, work: Workspace
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Each segment's largest value and the flat index within it of its first occurrence (argmax's pick);
    `spare`, a float64 buffer of the batch's size that it overwrites."""
    n = values.size
    largest = np.maximum.reduceat(values, starts)
    at, mask = work.candidates[:n], work.mask[:n]
    np.equal(values, np.take(largest, segments, out=spare), out=mask)
    at.fill(n)
    np.copyto(at, work.indices[:n], where=mask)
    return largest, np.minimum.reduceat(at, starts) - starts


def _batch_sums(pairs: list[SmallPair], where: list[int], found: list[ValueSums | None]) -> None:
    work = WORKSPACE
    lengths = np.fromiter((pair.expected.numel() for pair in pairs), dtype=np.int64, count=len(pairs))
    n = int(lengths.sum())
    segments = np.repeat(np.arange(len(pairs)), lengths)
    actual = _promoted([p.actual for p in pairs], [p.actual_scale for p in pairs], work.actual[:n], segments)
    expected = _promoted([p.expected for p in pairs], [p.expected_scale for p in pairs], work.expected[:n], segments)
    sums = segment_sums(actual, expected, lengths, segments, [p.tolerance for p in pairs],
                        [tuple(p.expected.shape) for p in pairs])
    for index, found_sums in zip(where, sums):
        found[index] = found_sums


def segment_sums(actual: np.ndarray, expected: np.ndarray, lengths: np.ndarray, segments: np.ndarray,
                 tolerances: list[Tolerance], shapes: list[tuple[int, ...]]) -> list[ValueSums | None]:
    """The sums of each segment (`lengths` of them, `segments` the segment of each element) of a batch: two
    float64 arrays, the loss scales undone, in WORKSPACE's buffers (overwritten). None for a segment holding
    NaN, Inf or values too large to square."""
    work = WORKSPACE
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    n = actual.size
    scratch, mask = work.scratch[:n].numpy(), work.mask[:n]
    with np.errstate(all="ignore"):  # a segment that overflows or holds NaN is left to value_sums
        diff = np.subtract(actual, expected, out=actual)
        error_sq = np.add.reduceat(np.multiply(diff, diff, out=scratch), starts)
        reference_sq = np.add.reduceat(np.multiply(expected, expected, out=scratch), starts)
        finite = np.isfinite(error_sq) & np.isfinite(reference_sq)
        abs_diff, magnitude = np.abs(diff, out=diff), np.abs(expected, out=expected)
        max_abs, max_abs_at = _first_at_max(abs_diff, starts, segments, scratch, work)
        rel = np.fromiter((tolerance.rel for tolerance in tolerances), dtype=np.float64, count=len(tolerances))
        absolute = np.fromiter((tolerance.abs for tolerance in tolerances), dtype=np.float64, count=len(tolerances))
        allowed = np.multiply(np.take(rel, segments, out=scratch), magnitude, out=scratch)
        np.add(allowed, absolute[segments], out=allowed)
        num_mismatched = np.add.reduceat(np.greater(abs_diff, allowed, out=mask).view(np.uint8), starts, dtype=np.int64)
        # the rule of relative_difference: 0 where the reference is 0 (|e| < tiny as tiny, as value_sums does)
        relative = np.divide(abs_diff, np.maximum(magnitude, TINY, out=scratch), out=scratch)
        np.copyto(relative, 0.0, where=np.equal(magnitude, 0.0, out=mask))
        max_rel, max_rel_at = _first_at_max(relative, starts, segments, abs_diff, work)  # (|a - e| is done with)
    # each number as a Python one, a column at a time (indexing numpy arrays element by element costs more)
    columns = zip(finite.tolist(), lengths.tolist(), np.sqrt(error_sq).tolist(), np.sqrt(reference_sq).tolist(),
                  max_abs.tolist(), max_abs_at.tolist(), max_rel.tolist(), max_rel_at.tolist(), num_mismatched.tolist())
    return [ValueSums(shape=shape, numel=numel, abs_error=abs_error, reference_norm=reference_norm,
                      max_abs=(largest, unravel(largest_at, shape)), max_rel=(worst, unravel(worst_at, shape)),
                      num_mismatched=mismatched) if ok else None
            for shape, (ok, numel, abs_error, reference_norm, largest, largest_at, worst, worst_at, mismatched)
            in zip(shapes, columns)]
