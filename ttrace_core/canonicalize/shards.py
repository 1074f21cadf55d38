"""Stage 2 of record -> canonicalize -> compare -> localize -> render.

Input: the recorded shards of one logical tensor (their `Layout` metadata and local values), from
every rank that holds it. Output: a `CanonicalTensor`, the full logical tensor plus a replica-drift
finding when ranks that should hold identical values do not. One generic function driven by the
recorded placements: no per-model or per-framework branch. `shard` is the inverse, used to give
every rank its slice of a logical tensor (consistent init, input rewriting).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from ttrace_core.canonicalize import placements as pl
from ttrace_core.canonicalize.replicas import ReplicaDifference, ReplicaDrift, worst_drift
from ttrace_core.errors import LayoutError
from ttrace_core.format.schema import Layout, TensorKey


CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""cgroup v2, then v1; "max" (v2) or a huge number (v1) means no limit."""


@functools.cache
def machine_memory_bytes() -> int:
    """The bound no tensor's assembly may exceed: the smaller of the physical memory and the cgroup's
    limit (a container's `memory.max`), read once. A tensor whose metadata claims more is refused with
    one line before anything is allocated, instead of dying in the allocator (MemoryError, or the
    kernel's OOM killer)."""
    limits = [psutil.virtual_memory().total]
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits)


@dataclass(frozen=True, slots=True)
class RecordedShard:
    """One rank's local values of a logical tensor, with the layout they were recorded under."""

    rank: int
    layout: Layout
    value: torch.Tensor


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    full: torch.Tensor
    replica_drift: ReplicaDrift | None
    num_shards: int
    replica_differences: tuple[ReplicaDifference, ...] = ()
    """Every replica's difference from the first of its block, when `canonicalize(every_replica=True)`."""


def _region_slices(region: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(start, start + length) for start, length in region)


def _held_values(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A copy of the values of `full` that `layout.coordinate` holds, in its local order (flat range not applied)."""
    blocks = pl.local_blocks(layout)
    if len(blocks) == 1:
        return full[_region_slices(blocks[0][0])].clone()
    local = full.new_empty(tuple(sum(length for _, length in runs) for runs in pl.local_runs(layout)))
    for global_region, local_region in blocks:
        local[_region_slices(local_region)] = full[_region_slices(global_region)]
    return local


def _check_consistent(key: TensorKey | None, shards: list[RecordedShard]) -> Layout:
    first = shards[0].layout
    for shard_ in shards[1:]:
        other = shard_.layout
        if (other.global_shape, other.mesh_shape, other.placements) != (first.global_shape, first.mesh_shape, first.placements):
            raise LayoutError(
                f"{key}: rank {shards[0].rank} recorded global shape {first.global_shape} with placements "
                f"{first.placements} on mesh {first.mesh_shape}, rank {shard_.rank} recorded "
                f"{other.global_shape} with {other.placements} on {other.mesh_shape}; the ranks disagree on the layout"
            )
    for shard_ in shards:
        expected = pl.local_shape(shard_.layout)
        if tuple(shard_.value.shape) != expected:
            raise LayoutError(
                f"{key}: rank {shard_.rank} holds shape {tuple(shard_.value.shape)} but placements "
                f"{shard_.layout.placements} on mesh {shard_.layout.mesh_shape} at coordinate "
                f"{shard_.layout.coordinate} imply {expected}; fix the layout annotation of this tensor"
            )
    return first


def _finite_norm(values: torch.Tensor) -> float:
    """The float64 norm of the finite values. One pass when all are finite (the norm of finite values of up to 32
    bits cannot overflow in float64, so a finite norm says they all are); else the non-finite ones masked out."""
    if not values.numel():
        return 0.0
    if values.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        norm = float(torch.linalg.vector_norm(values, dtype=torch.float64))
        if math.isfinite(norm):
            return norm
    values = values.double()
    return float(torch.linalg.vector_norm(torch.where(torch.isfinite(values), values, 0.0)))


def _replica_differences(replicas: list[RecordedShard], *, every: bool = False) -> list[ReplicaDifference]:
    """The differences of each replica from the first; replicas bitwise equal to it are left out
    unless `every` (a slab's equal replicas still add their base norm to the whole tensor's)."""
    first, found = replicas[0], []
    base = base_norm = None  # computed at the first replica that differs: most replicas are equal
    for other in replicas[1:]:
        equal = torch.equal(first.value, other.value)
        if equal and not every:
            continue
        if base_norm is None:
            base_norm = _finite_norm(first.value)
        if equal:
            found.append(ReplicaDifference(ranks=(first.rank, other.rank), max_abs_diff=0.0, diff_norm=0.0, base_norm=base_norm))
            continue
        if base is None:
            base = first.value.double()
        values = other.value.double()  # (isfinite has no fp8 kernel)
        diff = values - base
        if not torch.equal(torch.isfinite(base), torch.isfinite(values)):
            # a NaN or Inf in one replica only: NaN compares false with every bound, so say infinite
            max_abs, diff_norm = math.inf, math.inf
        else:
            diff = torch.where(torch.isfinite(diff), diff, torch.zeros((), dtype=diff.dtype))
            max_abs = float(diff.abs().max()) if diff.numel() else 0.0
            diff_norm = float(torch.linalg.vector_norm(diff))
        found.append(ReplicaDifference(ranks=(first.rank, other.rank), max_abs_diff=max_abs, diff_norm=diff_norm, base_norm=base_norm))
    return found


def _replica_drift(replicas: list[RecordedShard]) -> ReplicaDrift | None:
    return worst_drift(_replica_differences(replicas))


def _check_coverage(key: TensorKey | None, layout: Layout, shards: list[RecordedShard]) -> None:
    replicate_axes = set(pl.axes_of_kind(layout, "replicate"))
    kept_axes = [axis for axis in range(len(layout.mesh_shape)) if axis not in replicate_axes]
    if not kept_axes:  # every axis replicated, or no mesh: any shard holds it all
        return
    held = {tuple(s.layout.coordinate[axis] for axis in kept_axes) for s in shards}
    needed_shape = tuple(layout.mesh_shape[axis] for axis in kept_axes)
    if len(held) == math.prod(needed_shape):  # as many distinct coordinates as the mesh has, each inside it (schema)
        return
    # the first missing coordinate, found lazily: at most one past the coordinates held (a damaged mesh may claim 10**9)
    coordinates = (pl.coordinate_from_rank(index, needed_shape) for index in range(math.prod(needed_shape)))
    missing = next((coord for coord in coordinates if coord not in held), None)
    if missing is not None:
        raise LayoutError(
            f"{key}: no rank holds mesh coordinate {missing} (non-replicated axes) of mesh {layout.mesh_shape} "
            f"with placements {layout.placements}; ranks present: {sorted(s.rank for s in shards)}. "
            "Re-record with every rank, or check that no rank file is missing"
        )


def _check_fits_in_memory(key: TensorKey | None, layout: Layout, shards: list[RecordedShard]) -> None:
    """Before the full tensor is allocated (after its coverage is checked: every element is held by a
    recorded shard, so its size is not a claim of the metadata alone)."""
    numel = math.prod(layout.global_shape)
    itemsize = 8 if pl.axes_of_kind(layout, "partial") else shards[0].value.element_size()
    if numel * itemsize > machine_memory_bytes():
        raise LayoutError(f"{key}: assembling it takes {numel * itemsize / 2**30:.1f} GiB, more than this machine's "
                          f"{machine_memory_bytes() / 2**30:.1f} GiB; compare it with --max-memory (slab by slab) "
                          "or on a larger machine")


@dataclass(frozen=True, slots=True)
class Assembly:
    """How one set of shards assembles into its logical tensor, decided from their layouts alone: a run
    repeats a few dozen sets of layouts (every layer's projection is cut the same way) over thousands of
    tensors, so each set's placements are parsed and checked once (`_assembly`)."""

    whole: bool
    """Every shard holds the whole tensor in order (unsharded, or over mesh axes of size 1): the first by rank is it."""
    groups: tuple[tuple[tuple[int, ...], tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]], ...]
    """Per region held (and partial coordinate): the indices of its replicas in rank order, and the (global
    slices, local slices) of each block the first of them holds."""
    num_avg: int = 0
    """0: no partial placement; else partial sums are added in float64 and divided by this (P(avg) axes)."""


_ASSEMBLIES: dict[tuple, Assembly | None] = {}
"""(rank, layout, local shape, dtype) of each shard -> its Assembly; None: flat ranges or an SB view."""


def _assembly(shards: list[RecordedShard], key: TensorKey | None) -> Assembly | None:
    """The assembly of `shards`, checked (consistent layouts, every coordinate held, room in memory); None for
    flat ranges or an SB view. A LayoutError names `key`, and a failed plan is not kept (the next tensor cut that
    way is checked again, and named)."""
    signature = tuple((s.rank, s.layout, s.value.shape, s.value.dtype) for s in shards)
    try:
        if (found := _ASSEMBLIES.get(signature, _NOT_KEPT)) is not _NOT_KEPT:
            return found
    except TypeError:  # a layout built with lists: planned each time
        signature = None
    layout = _check_consistent(key, shards)
    if pl.blocked_view(layout) is not None or any(s.layout.flat_range is not None for s in shards):
        assembly = None
    else:
        _check_coverage(key, layout, shards)
        assembly = _planned(layout, shards, key)
    if signature is not None:
        if len(_ASSEMBLIES) >= pl.LAYOUTS_KEPT:
            _ASSEMBLIES.clear()
        _ASSEMBLIES[signature] = assembly
    return assembly


_NOT_KEPT = object()


def _planned(layout: Layout, shards: list[RecordedShard], key: TensorKey | None) -> Assembly:
    order = sorted(range(len(shards)), key=lambda i: shards[i].rank)
    if _each_holds_the_whole(layout, shards):
        return Assembly(whole=True, groups=((tuple(order), ()),))
    _check_fits_in_memory(key, layout, shards)
    by_region: dict[tuple, list[int]] = defaultdict(list)
    for index in order:
        by_region[pl.local_runs(shards[index].layout), pl.partial_coordinate(shards[index].layout)].append(index)
    groups = tuple((tuple(indices), tuple((_region_slices(global_region), _region_slices(local_region))
                                          for global_region, local_region in pl.local_blocks(shards[indices[0]].layout)))
                   for indices in by_region.values())
    partial_axes, specs = pl.axes_of_kind(layout, "partial"), pl.parsed_placements(layout)
    num_avg = math.prod(layout.mesh_shape[axis] for axis in partial_axes if specs[axis].reduce_op == "avg")
    return Assembly(whole=False, groups=groups, num_avg=num_avg if partial_axes else 0)


@dataclass(frozen=True, slots=True)
class GatherPlan:
    """A logical tensor's elements read straight out of its shards' values, decided from their layouts alone (one
    per set of layouts, like Assembly): element g of the logical tensor (row-major) is element `local[g]` (flat)
    of shard `shard[g]`, the shards in the order the plan was asked for. What `canonicalize` assembles by copies,
    as one index map: compare gathers a batch of small tensors with it (compare/window.py)."""

    shard: np.ndarray
    local: np.ndarray
    replicas: tuple[tuple[int, int], ...]
    """(first, other) shards holding the same block: `canonicalize` keeps the first (by rank) and compares the
    other with it, so a caller that gathers from the first must find the other's values equal."""


_GATHER_PLANS: dict[tuple, GatherPlan | None] = {}


def gather_plan(shards: tuple[tuple[int, Layout, tuple[int, ...]], ...]) -> GatherPlan | None:
    """The plan of shards given as (rank, layout, local shape); None when `canonicalize` does more than copy their
    values into place (partial sums, flat ranges, a blocked view) or their layouts do not assemble (it says why)."""
    try:
        found = _GATHER_PLANS.get(shards, _NOT_KEPT)
    except TypeError:  # a layout built with lists: planned each time
        return _planned_gather(shards)
    if found is _NOT_KEPT:
        if len(_GATHER_PLANS) >= pl.LAYOUTS_KEPT:
            _GATHER_PLANS.clear()
        found = _GATHER_PLANS[shards] = _planned_gather(shards)
    return found


def _planned_gather(shards: tuple[tuple[int, Layout, tuple[int, ...]], ...]) -> GatherPlan | None:
    """Assembled by `canonicalize`'s own plan from shards whose values are their elements' places in the shards
    laid end to end: the logical tensor it gives is the index map."""
    starts = np.zeros(len(shards), dtype=np.int64)
    np.cumsum([math.prod(shape) for _, _, shape in shards[:-1]], out=starts[1:])
    placed = [RecordedShard(rank, layout, torch.arange(int(start), int(start) + math.prod(shape),
                                                       dtype=torch.int64).reshape(shape))
              for (rank, layout, shape), start in zip(shards, starts)]
    try:
        assembly = _assembly(placed, None)
    except LayoutError:
        return None
    if assembly is None or assembly.num_avg:
        return None
    places = _assembled(placed, assembly, every_replica=False).full.reshape(-1).numpy()
    shard = np.searchsorted(starts, places, side="right") - 1
    return GatherPlan(shard=shard, local=places - starts[shard],
                      replicas=tuple((indices[0], other) for indices, _ in assembly.groups for other in indices[1:]))


def canonicalize(shards: list[RecordedShard], key: TensorKey | None = None, *,
                 every_replica: bool = False) -> CanonicalTensor:
    """Assemble the full logical tensor from its recorded shards.

    Shard placements put each block at its global offset (several blocks per shard under SS,
    see placements.py); partial placements are summed in
    float64 (and divided for avg); replicas are compared, and the first one is used.
    `every_replica`: keep every replica's difference, equal ones included (a slab of a larger tensor).
    """
    if not shards:
        raise LayoutError(f"{key}: no shard was recorded")
    if len(shards) == 1 and not (layout := shards[0].layout).mesh_shape and layout.flat_range is None \
            and tuple(shards[0].value.shape) == layout.global_shape:
        return CanonicalTensor(full=shards[0].value, replica_drift=None, num_shards=1)  # one rank's whole tensor
    assembly = _assembly(shards, key)
    if assembly is not None:
        return _assembled(shards, assembly, every_replica)
    layout = shards[0].layout  # (consistent: checked by _assembly)
    if pl.blocked_view(layout) is not None:
        viewed = [RecordedShard(s.rank, pl.blocked_view(s.layout),
                                s.value.reshape(pl.local_shape(pl.blocked_view(s.layout)))) for s in shards]
        result = canonicalize(viewed, key, every_replica=every_replica)
        return CanonicalTensor(full=result.full.reshape(layout.global_shape), replica_drift=result.replica_drift,
                               num_shards=result.num_shards, replica_differences=result.replica_differences)
    return _canonicalize_flat_ranges(shards, key)


def _assembled(shards: list[RecordedShard], assembly: Assembly, every_replica: bool) -> CanonicalTensor:
    differences: list[ReplicaDifference] = []
    if assembly.whole:
        # One rank's tensor, or replicas of it: the first (by rank) is the logical tensor as it is, no
        # copy and nothing to allocate; the others are compared with it.
        ordered = [shards[index] for index in assembly.groups[0][0]]
        differences = _replica_differences(ordered, every=every_replica)
        full = ordered[0].value
    else:
        global_shape, dtype = shards[0].layout.global_shape, shards[0].value.dtype
        full = torch.zeros(global_shape, dtype=torch.float64) if assembly.num_avg else torch.empty(global_shape, dtype=dtype)
        for indices, blocks in assembly.groups:
            replicas = [shards[index] for index in indices]
            differences += _replica_differences(replicas, every=every_replica)
            value = replicas[0].value
            for global_slices, local_slices in blocks:
                if assembly.num_avg:
                    full[global_slices] += value[local_slices].double()
                else:
                    full[global_slices] = value[local_slices]
        if assembly.num_avg:
            full = (full / assembly.num_avg).to(dtype)
    return CanonicalTensor(full=full, replica_drift=worst_drift(differences), num_shards=len(shards),
                           replica_differences=tuple(differences) if every_replica else ())


def _each_holds_the_whole(layout: Layout, shards: list[RecordedShard]) -> bool:
    """Every shard holds the whole tensor in order (unsharded, or sharded over a mesh axis of size 1) and
    nothing is a partial sum still to be reduced."""
    whole = tuple(((0, size),) for size in layout.global_shape)
    return not pl.axes_of_kind(layout, "partial") and all(pl.local_runs(s.layout) == whole for s in shards)


def _canonicalize_flat_ranges(shards: list[RecordedShard], key: TensorKey | None) -> CanonicalTensor:
    """Blocks assembled from flat element ranges (distributed-optimizer gradient shards)."""
    layout = shards[0].layout
    if pl.axes_of_kind(layout, "partial"):
        raise LayoutError(f"{key}: flat ranges over partial placements are not supported")
    _check_flat_coverage(key, shards)
    _check_fits_in_memory(key, layout, shards)
    full = torch.empty(layout.global_shape, dtype=shards[0].value.dtype)
    by_region: dict[tuple, list[RecordedShard]] = defaultdict(list)
    for shard_ in shards:
        by_region[pl.local_region(shard_.layout)].append(shard_)
    drifts = []
    for region, pieces in by_region.items():
        numel = 1
        for _, length in region:
            numel *= length
        flat = torch.empty(numel, dtype=full.dtype)
        owner = torch.full((numel,), -1, dtype=torch.int64)
        for piece in sorted(pieces, key=lambda s: s.rank):
            start, end = piece.layout.flat_range or (0, numel)
            held = owner[start:end] >= 0
            if held.any() and not torch.equal(flat[start:end][held], piece.value[held]):
                drifts.append(_replica_drift([RecordedShard(int(owner[start:end][held][0]), piece.layout, flat[start:end][held]),
                                              RecordedShard(piece.rank, piece.layout, piece.value[held])]))
            flat[start:end] = torch.where(held, flat[start:end], piece.value)
            owner[start:end] = torch.where(held, owner[start:end], torch.full_like(owner[start:end], piece.rank))
        full[_region_slices(region)] = flat.view(tuple(length for _, length in region))
    worst = max((d for d in drifts if d is not None), key=lambda d: d.relative_diff, default=None)
    return CanonicalTensor(full=full, replica_drift=worst, num_shards=len(shards))


def _check_flat_coverage(key: TensorKey | None, shards: list[RecordedShard]) -> None:
    """Every element of every block is in some rank's flat range, and no range runs past its block:
    found from the ranges alone, before anything is allocated (a damaged block may claim 10**12 elements)."""
    by_region: dict[tuple, list[RecordedShard]] = defaultdict(list)
    for shard_ in shards:
        by_region[pl.local_region(shard_.layout)].append(shard_)
    for region, pieces in by_region.items():
        numel, covered = math.prod(length for _, length in region), 0
        for piece in sorted(pieces, key=lambda p: (p.layout.flat_range or (0, numel))[0]):
            start, end = piece.layout.flat_range or (0, numel)
            if end > numel:
                raise LayoutError(f"{key}: rank {piece.rank} holds flat range [{start}, {end}) of block {region}, "
                                  f"which has {numel} elements; its metadata is damaged, re-record this tensor")
            if start > covered:
                break
            covered = max(covered, end)
        if covered < numel:
            raise LayoutError(f"{key}: no rank holds flat element {covered} of block {region}; ranks present: "
                              f"{sorted(p.rank for p in pieces)}. Re-record with every rank (if every rank is there, its metadata is damaged)")


def shard(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The local tensor that `layout.coordinate` holds of `full`: the inverse of `canonicalize`.

    Along partial axes coordinate 0 holds the value and the others hold zeros (sum) or every
    coordinate holds the value (avg), so that reducing gives `full` back.
    """
    if tuple(full.shape) != tuple(layout.global_shape):
        raise LayoutError(f"cannot shard a tensor of shape {tuple(full.shape)} with a layout of global shape {layout.global_shape}")
    if (view := pl.blocked_view(layout)) is not None:
        return shard(full.reshape(view.global_shape), view).reshape(pl.local_shape(layout))
    local = _held_values(full, layout)
    if layout.flat_range is not None:
        start, end = layout.flat_range
        return local.reshape(-1)[start:end].clone()
    specs = pl.parsed_placements(layout)
    for axis in pl.axes_of_kind(layout, "partial"):
        if specs[axis].reduce_op == "sum" and layout.coordinate[axis] != 0:
            local.zero_()
    return local
