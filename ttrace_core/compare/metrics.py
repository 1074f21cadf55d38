"""Part of stage 3 (compare): what comparing actual with expected values reads off them, as sums
that add up over slabs of one tensor (`ValueSums`), and the metrics of a comparison row from them.

Both are float64 tensors of the same shape; NaN and Inf are counted and left out of the norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ttrace_core.compare.tolerances import Tolerance


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size if size else 0)
        flat_index = flat_index // size if size else 0
    return tuple(reversed(index))


def _all_finite(values: torch.Tensor) -> bool:
    """One reduction instead of an elementwise mask: a float64 norm of finite values that came from at
    most 64-bit floats is finite unless they exceed 1e154, where the masked path takes over."""
    return not values.numel() or math.isfinite(float(torch.linalg.vector_norm(values)))


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

    def add(self, other: ValueSums) -> None:
        self.numel += other.numel
        self.num_nan = (self.num_nan[0] + other.num_nan[0], self.num_nan[1] + other.num_nan[1])
        self.num_inf = (self.num_inf[0] + other.num_inf[0], self.num_inf[1] + other.num_inf[1])
        self.abs_error = math.hypot(self.abs_error, other.abs_error)
        self.reference_norm = math.hypot(self.reference_norm, other.reference_norm)
        self.max_abs = _larger_first(self.max_abs, other.max_abs)
        self.max_rel = _larger_first(self.max_rel, other.max_rel)
        self.num_mismatched += other.num_mismatched


def _larger_first(a: tuple[float, tuple] | None, b: tuple[float, tuple] | None) -> tuple[float, tuple] | None:
    """The larger difference; of equal ones the first in row-major order (index tuples compare that
    way), as argmax over the whole tensor picks."""
    if a is None or b is None:
        return a or b
    return b if b[0] > a[0] or (b[0] == a[0] and b[1] < a[1]) else a


def value_sums(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, *,
               shape: tuple[int, ...] | None = None, offset: tuple[int, ...] | None = None) -> ValueSums:
    """The sums of actual vs expected (both float64, same shape); `offset` (the index of their first
    element) places them as a slab of a tensor of `shape`."""
    numel = expected.numel()
    sums = ValueSums(shape=shape or tuple(expected.shape), numel=numel)
    if not numel:
        return sums
    if _all_finite(actual) and _all_finite(expected):  # the common case: no masks to build
        diff, expected_finite = actual - expected, expected
    else:
        sums.num_nan = (int(torch.isnan(actual).sum()), int(torch.isnan(expected).sum()))
        sums.num_inf = (int(torch.isinf(actual).sum()), int(torch.isinf(expected).sum()))
        both_finite = torch.isfinite(actual) & torch.isfinite(expected)
        diff = torch.where(both_finite, actual - expected, torch.zeros((), dtype=torch.float64))
        expected_finite = torch.where(both_finite, expected, torch.zeros((), dtype=torch.float64))
    sums.abs_error = float(torch.linalg.vector_norm(diff))
    sums.reference_norm = float(torch.linalg.vector_norm(expected_finite))

    def placed(flat_index: int) -> tuple[int, ...]:
        index = _unravel(flat_index, tuple(expected.shape))
        return index if offset is None else tuple(i + o for i, o in zip(index, offset))

    abs_diff = diff.abs().flatten()
    magnitude = expected_finite.abs().flatten()
    position = int(abs_diff.argmax())
    # where the reference is 0 the relative difference counts as 0: 0 / inf
    rel_diff = abs_diff / torch.where(magnitude == 0, math.inf, magnitude).clamp_min_(torch.finfo(torch.float64).tiny)
    rel_position = int(rel_diff.argmax())
    sums.max_abs = (float(abs_diff[position]), placed(position))
    sums.max_rel = (float(rel_diff[rel_position]), placed(rel_position))
    sums.num_mismatched = int((abs_diff > tolerance.abs + tolerance.rel * magnitude).sum())
    return sums


def metrics_from_sums(sums: ValueSums, tolerance: Tolerance) -> dict:
    """The metrics of a comparison (TensorComparison's fields) from its sums under one tolerance."""
    numel, abs_error, reference_norm = sums.numel, sums.abs_error, sums.reference_norm
    allowed = tolerance.rel * reference_norm + tolerance.abs * math.sqrt(numel)
    metrics = {
        "shape": sums.shape, "numel": numel, "num_nan": sums.num_nan, "num_inf": sums.num_inf, "abs_error": abs_error,
        "reference_norm": reference_norm,
        "error": abs_error / reference_norm if reference_norm > 0 else (0.0 if abs_error == 0 else math.inf),
        "ratio": abs_error / allowed if allowed > 0 else (0.0 if abs_error == 0 else math.inf),
        "min_rel_tolerance": max(0.0, abs_error - tolerance.abs * math.sqrt(numel)) / reference_norm
        if reference_norm > 0 else (0.0 if abs_error <= tolerance.abs * math.sqrt(numel) else math.inf),
    }
    if numel:
        metrics |= {"max_abs_diff": sums.max_abs[0], "max_abs_index": sums.max_abs[1],
                    "max_rel_diff": sums.max_rel[0], "max_rel_index": sums.max_rel[1],
                    "num_mismatched": sums.num_mismatched}
    return metrics
