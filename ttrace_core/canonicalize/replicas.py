"""Part of stage 2 (canonicalize): how the replicas of one block of a logical tensor differ.

A correct run gives every rank that holds the same block bitwise equal values (a replicated weight,
an all-reduced gradient); shards.py measures each replica against the first of its block
(`ReplicaDifference`, sums that add up over slabs of the tensor), and `worst_drift` keeps the replica
that differs most as the tensor's `ReplicaDrift`, which its comparison row carries (compare/results.py).

Plain Python, no torch: the dashboard reads comparison rows, with their drift, without the tensor stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaDifference:
    """How one replica differs from the first of its block, in sums that add up over slabs of the
    tensor (bounded.py compares a large tensor slab by slab)."""

    ranks: tuple[int, int]
    max_abs_diff: float
    diff_norm: float
    """||replica - first||_F over the finite differences (inf when NaN/Inf sit at different places)."""
    base_norm: float
    """||first||_F over its finite values."""


@dataclass(frozen=True, slots=True)
class ReplicaDrift:
    """Replicas of one block that are not bitwise equal: the replica that differs most from the first.

    In the serialized form (`data_from_record`) an infinite difference (NaN or Inf in one replica only)
    is written as null by strict JSON, and read back as None."""

    ranks: tuple[int, ...]
    """The rank whose values were used first, then the rank that differs most from it."""
    max_abs_diff: float | None
    relative_diff: float | None
    """||replica - first||_F / ||first||_F of the most different replica."""


def worst_drift(differences: list[ReplicaDifference]) -> ReplicaDrift | None:
    """The replica that differs most, relative to the first of its block; None when all are equal."""
    worst: ReplicaDrift | None = None
    for difference in differences:
        if difference.diff_norm == 0.0:
            continue  # equal (but for NaNs at the same places: torch.equal is false on NaN)
        relative = difference.diff_norm / difference.base_norm if difference.base_norm > 0 else math.inf
        if worst is None or relative > worst.relative_diff:
            worst = ReplicaDrift(ranks=difference.ranks, max_abs_diff=difference.max_abs_diff, relative_diff=relative)
    return worst
