"""Part of stage 3 (compare): what comparing actual with expected values reads off them, as sums
that add up over slabs of one tensor (`ValueSums`), and the metrics of a comparison row from them.

Values arrive in their stored dtype with the recording's loss scale still applied. They are
promoted to float64 one chunk of CHUNK_ELEMENTS at a time into buffers reused from tensor to tensor,
and every number of a row is read off each chunk while it sits in cache: no float64 copy of a whole
tensor is made and no fresh buffer is allocated per tensor (a fresh half-megabyte buffer costs more
in page faults than the arithmetic on it). NaN and Inf are counted and left out of the norms.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ttrace_core.compare.tolerances import Tolerance

CHUNK_ELEMENTS = 1 << 16
"""Elements promoted to float64 at a time: three float64 buffers of this size (1.5 MiB) stay in cache."""
TINY = torch.finfo(torch.float64).tiny


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """Compare's arithmetic runs torch on one thread, and gives the process's thread count back after.
    The sums of squares are numpy's `dot`, whose BLAS keeps a thread pool of its own; each pool's threads
    spin while they wait, and with torch's OpenMP pool beside it they starved each other: on 2 cores, with
    torch's default 2 threads, comparing the 986 MB pair took 43.5 s against 0.9 s on one thread (torch
    2.13, numpy's OpenBLAS; benchmarks/results/compare_throughput.md). Torch's threads gain nothing here:
    a chunk is promoted to float64 on one thread faster than split (batched.py), and comparing in parallel
    is done by processes (partition.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def relative_difference(actual: float, expected: float) -> float:
    """|actual - expected| / |expected| for one element, 0 where the reference is 0: the rule of every
    relative number ttrace shows (the table's max_rel_diff, the tensor page's worst elements). An element
    whose reference is 0 still counts in the absolute error and the norm test."""
    return abs(actual - expected) / abs(expected) if expected != 0 else 0.0


def unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`flat_index`'s place in a row-major tensor of `shape` (0 along a dim of size 0)."""
    if len(shape) == 2 and shape[0] and shape[1]:  # (most rows: a call per largest difference, two per row)
        outer, inner = divmod(flat_index, shape[1])
        return outer % shape[0], inner
    index = []
    for size in reversed(shape):
        index.append(flat_index % size if size else 0)
        flat_index = flat_index // size if size else 0
    return tuple(reversed(index))


@dataclass(kw_only=True, slots=True)
class ValueSums:
    """What comparing actual with expected reads off the values, in parts that add up over slabs of
    one tensor (bounded.py compares a tensor too large for memory slab by slab)."""

    shape: tuple[int, ...]
    """Of the whole tensor; indices are within it."""
    numel: int = 0
    num_nan: tuple[int, int] = (0, 0)
    num_inf: tuple[int, int] = (0, 0)
    abs_error: float = 0.0
    reference_norm: float = 0.0
    max_abs: tuple[float, tuple[int, ...]] | None = None
    max_rel: tuple[float, tuple[int, ...]] | None = None
    num_mismatched: int = 0
    num_nonfinite_apart: int = 0
    """Elements NaN or Inf on one side and not the same non-finite value on the other: counts that agree
    can still sit in other places ([nan, 1] against [1, nan])."""

    def add(self, other: ValueSums) -> None:
        self.numel += other.numel
        self.num_nan = (self.num_nan[0] + other.num_nan[0], self.num_nan[1] + other.num_nan[1])
        self.num_inf = (self.num_inf[0] + other.num_inf[0], self.num_inf[1] + other.num_inf[1])
        self.abs_error = math.hypot(self.abs_error, other.abs_error)
        self.reference_norm = math.hypot(self.reference_norm, other.reference_norm)
        self.max_abs = _larger_first(self.max_abs, other.max_abs)
        self.max_rel = _larger_first(self.max_rel, other.max_rel)
        self.num_mismatched += other.num_mismatched
        self.num_nonfinite_apart += other.num_nonfinite_apart


def _larger_first(a: tuple[float, tuple] | None, b: tuple[float, tuple] | None) -> tuple[float, tuple] | None:
    """The larger difference; of equal ones the first in row-major order (index tuples compare that
    way), as argmax over the whole tensor picks."""
    if a is None or b is None:
        return a or b
    return b if b[0] > a[0] or (b[0] == a[0] and b[1] < a[1]) else a


class Workspace(threading.local):
    """float64 buffers of one chunk, one set per thread, reused by every comparison in it (here, and
    batched.py's batches, which are at most a chunk); numpy views of the same memory, because numpy's
    argmax, comparisons and dot products on a cache-sized chunk are 3 to 6 times faster than torch's
    (torch promotes: it reads bfloat16 and fp8, numpy cannot)."""

    def __init__(self) -> None:
        self.actual = torch.empty(CHUNK_ELEMENTS, dtype=torch.float64)
        self.expected = torch.empty(CHUNK_ELEMENTS, dtype=torch.float64)
        self.scratch = torch.empty(CHUNK_ELEMENTS, dtype=torch.float64)
        self.mask = np.empty(CHUNK_ELEMENTS, dtype=np.bool_)
        self.other_mask = np.empty(CHUNK_ELEMENTS, dtype=np.bool_)
        self.indices = np.arange(CHUNK_ELEMENTS, dtype=np.int64)
        self.candidates = np.empty(CHUNK_ELEMENTS, dtype=np.int64)
        """(batched.py: where each segment's largest value may first occur)"""


WORKSPACE = Workspace()


def _promoted(values: torch.Tensor, into: torch.Tensor, scale: float) -> torch.Tensor:
    """`values` in float64 with the loss scale undone, written into `into` (the same arithmetic as
    `values.double() / scale`)."""
    into.copy_(values)
    if scale != 1:
        into.div_(scale)
    return into


def value_sums(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, *,
               shape: tuple[int, ...] | None = None, offset: tuple[int, ...] | None = None,
               scales: tuple[float, float] = (1.0, 1.0)) -> ValueSums:
    """The sums of actual vs expected (same shape, any dtype; compared in float64 after dividing by
    `scales`, the actual's and the expected's loss scale); `offset` (the index of their first element)
    places them as a slab of a tensor of `shape`."""
    numel = expected.numel()
    slab_shape = tuple(expected.shape)
    flat = ValueSums(shape=(numel,))
    actual_flat, expected_flat = actual.reshape(-1), expected.reshape(-1)
    work = WORKSPACE
    with np.errstate(all="ignore"):  # |a - e| / tiny overflows where e == 0: see _finite_chunk_sums
        for start in range(0, numel, CHUNK_ELEMENTS):
            flat.add(_chunk_sums(actual_flat, expected_flat, start, min(numel, start + CHUNK_ELEMENTS), tolerance, scales, work))
    return _placed(flat, shape or slab_shape, slab_shape, offset)


def _chunk_sums(actual_flat: torch.Tensor, expected_flat: torch.Tensor, start: int, stop: int, tolerance: Tolerance,
                scales: tuple[float, float], work: Workspace) -> ValueSums:
    """The sums of elements start:stop of two flat tensors, with flat indices within them."""
    a = _promoted(actual_flat[start:stop], work.actual[:stop - start], scales[0])
    e = _promoted(expected_flat[start:stop], work.expected[:stop - start], scales[1])
    chunk = _finite_chunk_sums(a, e, tolerance, work)
    if chunk is None:  # NaN or Inf in the chunk (or values over 1e154): compare where both are finite
        a = _promoted(actual_flat[start:stop], a, scales[0])
        num_nan, num_inf, apart = _without_nonfinite(a, e, work)
        chunk = _finite_chunk_sums(a, e, tolerance, work, cleaned=True)
        chunk.num_nan, chunk.num_inf, chunk.num_nonfinite_apart = num_nan, num_inf, apart
    if start:
        chunk.max_abs = (chunk.max_abs[0], (chunk.max_abs[1][0] + start,))
        chunk.max_rel = (chunk.max_rel[0], (chunk.max_rel[1][0] + start,))
    return chunk


def _placed(flat: ValueSums, shape: tuple[int, ...], slab_shape: tuple[int, ...],
            offset: tuple[int, ...] | None) -> ValueSums:
    """`flat`'s flat indices as indices of the whole tensor of `shape`."""
    def placed(found: tuple[float, tuple[int]] | None) -> tuple[float, tuple[int, ...]] | None:
        if found is None:
            return None
        index = unravel(found[1][0], slab_shape)
        return found[0], index if offset is None else tuple(i + o for i, o in zip(index, offset))

    flat.shape, flat.max_abs, flat.max_rel = shape, placed(flat.max_abs), placed(flat.max_rel)
    return flat


def _finite_chunk_sums(a: torch.Tensor, e: torch.Tensor, tolerance: Tolerance, work: Workspace, *,
                       cleaned: bool = False) -> ValueSums | None:
    """The sums of one float64 chunk when all its values are finite (else None, unless `cleaned`:
    its values are finite, its norms may overflow), with flat indices. Overwrites `a` with |a - e| and
    `e` with |e|. Two sums of squares tell whether everything is finite: those of a - e and of e are
    finite only if a and e are (and below 1e154, past which a norm overflows all the same)."""
    n = a.numel()
    abs_diff, magnitude = a.numpy(), e.numpy()
    scratch_tensor = work.scratch[:n]
    scratch, mask = scratch_tensor.numpy(), work.mask[:n]
    np.subtract(abs_diff, magnitude, out=abs_diff)
    abs_error_sq, reference_sq = float(np.dot(abs_diff, abs_diff)), float(np.dot(magnitude, magnitude))
    if not cleaned and not (math.isfinite(abs_error_sq) and math.isfinite(reference_sq)):
        return None
    np.abs(abs_diff, out=abs_diff)
    np.abs(magnitude, out=magnitude)
    position = int(np.argmax(abs_diff))
    max_abs = float(abs_diff[position])
    num_mismatched = 0
    if max_abs > tolerance.abs:  # else no element exceeds abs + rel * |e| >= abs
        np.add(np.multiply(magnitude, tolerance.rel, out=scratch), tolerance.abs, out=scratch)
        num_mismatched = int(np.count_nonzero(np.greater(abs_diff, scratch, out=mask)))
    # |e| clamped to tiny differs from the rule (0 where the reference is 0) only where e == 0 and
    # only upwards, so an argmax that lands where e != 0 is the rule's argmax too
    torch.clamp_min(e, TINY, out=scratch_tensor)  # (numpy's NaN-aware maximum is 5 times slower)
    relative = np.divide(abs_diff, scratch, out=scratch)
    rel_position = int(np.argmax(relative))
    if magnitude[rel_position] == 0:
        np.copyto(relative, 0.0, where=np.equal(magnitude, 0.0, out=mask))
        rel_position = int(np.argmax(relative))
    return ValueSums(shape=(n,), numel=n, abs_error=math.sqrt(abs_error_sq), reference_norm=math.sqrt(reference_sq),
                     max_abs=(max_abs, (position,)), max_rel=(float(relative[rel_position]), (rel_position,)),
                     num_mismatched=num_mismatched)


def _without_nonfinite(a: torch.Tensor, e: torch.Tensor, work: Workspace) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(NaN counts, Inf counts) of a and e, and how many places hold a non-finite value on one side and not
    the same one on the other; then 0 on both sides wherever either is not finite, so those places add
    nothing to the norms."""
    actual, expected = a.numpy(), e.numpy()
    mask, other = work.mask[:actual.size], work.other_mask[:actual.size]
    counts = [int(np.count_nonzero(test(values, out=mask))) for test in (np.isnan, np.isinf) for values in (actual, expected)]
    alike = (np.isnan(actual) & np.isnan(expected)) | (np.isinf(actual) & (actual == expected))
    np.logical_or(np.logical_not(np.isfinite(actual, out=mask), out=mask),
                  np.logical_not(np.isfinite(expected, out=other), out=other), out=mask)
    apart = int(np.count_nonzero(mask & ~alike))
    np.copyto(actual, 0.0, where=mask)
    np.copyto(expected, 0.0, where=mask)
    return (counts[0], counts[1]), (counts[2], counts[3]), apart


@dataclass(kw_only=True, slots=True)
class ValueMetrics:
    """What comparing actual with expected values gives under one tolerance: the numbers a comparison row
    (TensorComparison) carries from its values, which the engine judges and puts into the row. (Not frozen: one is
    made for every row, and a frozen dataclass sets each field through object.__setattr__, twice the cost.)"""

    shape: tuple[int, ...]
    numel: int
    num_nan: tuple[int, int]
    """(candidate, reference)."""
    num_inf: tuple[int, int]
    num_nonfinite_apart: int
    """Elements NaN or Inf in one run and not the same value in the other."""
    abs_error: float
    """||actual - expected||_F over the places where both are finite."""
    reference_norm: float
    error: float
    """abs_error / reference_norm (0 or inf for a zero reference)."""
    ratio: float
    """abs_error / (rel * reference_norm + abs * sqrt(numel)): <= 1 passes the norm test."""
    min_rel_tolerance: float
    """The smallest rel that would have passed with the same abs."""
    max_abs_diff: float | None = None
    """None for a tensor of no elements, like the four fields below."""
    max_abs_index: tuple[int, ...] | None = None
    max_rel_diff: float | None = None
    """Under `relative_difference`'s rule: 0 where the reference is 0."""
    max_rel_index: tuple[int, ...] | None = None
    num_mismatched: int | None = None
    """Elements outside abs + rel * |expected|."""


def metrics_from_sums(sums: ValueSums, tolerance: Tolerance) -> ValueMetrics:
    """The metrics of a comparison from its sums under one tolerance."""
    numel, abs_error, reference_norm = sums.numel, sums.abs_error, sums.reference_norm
    allowed = tolerance.rel * reference_norm + tolerance.abs * math.sqrt(numel)
    absolute_part = tolerance.abs * math.sqrt(numel)
    max_abs, max_rel = sums.max_abs or (None, None), sums.max_rel or (None, None)  # None: no element
    return ValueMetrics(
        shape=sums.shape, numel=numel, num_nan=sums.num_nan, num_inf=sums.num_inf,
        num_nonfinite_apart=sums.num_nonfinite_apart, abs_error=abs_error, reference_norm=reference_norm,
        error=abs_error / reference_norm if reference_norm > 0 else (0.0 if abs_error == 0 else math.inf),
        ratio=abs_error / allowed if allowed > 0 else (0.0 if abs_error == 0 else math.inf),
        min_rel_tolerance=max(0.0, abs_error - absolute_part) / reference_norm if reference_norm > 0
        else (0.0 if abs_error <= absolute_part else math.inf),
        max_abs_diff=max_abs[0], max_abs_index=max_abs[1], max_rel_diff=max_rel[0], max_rel_index=max_rel[1],
        num_mismatched=sums.num_mismatched if numel else None)
