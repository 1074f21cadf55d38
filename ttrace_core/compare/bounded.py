"""Part of stage 3 (compare): one tensor compared in bounded memory, slab by slab.

Comparing a tensor holds its canonical values and their float64 differences at once, about
BYTES_PER_ELEMENT bytes per element (measured: benchmarks/compare_memory.py). A tensor that would
take more than the budget (`ttrace compare --max-memory`) is cut into slabs along dims where every shard
of both runs holds one run of indices: a dim no placement shards, or one cut by plain shards (even uneven
ones), whose slabs then never straddle a bound between shards. Each slab is read from every shard that
holds it as a hyperslab of that shard's own indices (a row-sharded weight cut by rows reads each row once,
contiguously, instead of a slab of columns reading every row again), canonicalized and compared on its
own, and the slabs' sums (compare.ValueSums, canonicalize.replicas.ReplicaDifference) give the row the
whole tensor would. A tensor with a blocked placement or a flat range, or whose every dim is strided, cannot be cut
this way and is compared whole (`compare_runs` says so in a note).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import NamedTuple

import msgspec
import torch

from ttrace_core.canonicalize import placements as pl
from ttrace_core.canonicalize.replicas import ReplicaDifference, ReplicaDrift, worst_drift
from ttrace_core.canonicalize.shards import RecordedShard, canonicalize
from ttrace_core.format.schema import Layout, TensorKey, TensorMeta
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.metrics import ValueMetrics, ValueSums, metrics_from_sums, value_sums

BYTES_PER_ELEMENT = 160
"""Peak bytes per element of comparing one fp32 tensor whole. The value sums now promote chunk by
chunk (metrics.py): canonical values and shards of both runs, 45-48 measured (benchmarks/compare_memory.py,
was 91-122 with whole float64 copies). Kept at 160 because the structure tests (perturbation
tolerances) still build float64 copies and differences of the whole tensor, which compare_memory.py
does not measure yet."""


def working_bytes(metas: list[TensorMeta]) -> int:
    return math.prod(metas[0].layout.global_shape) * BYTES_PER_ELEMENT


class Cut(NamedTuple):
    """A dim a tensor can be cut along, and where slabs must not straddle: the bounds of the shards that
    hold it (0 and its extent for a dim no placement shards)."""

    dim: int
    bounds: tuple[int, ...]


def _held_runs(layout: Layout) -> list[tuple[int, int] | None] | None:
    """Per dim, the one run (start, length) of global indices this shard holds, or None where its placements
    leave it more than one run or a strided one; None for a layout no slab can cut (flat range, blocked)."""
    if layout.flat_range is not None:
        return None
    ndim, strided = len(layout.global_shape), set()
    for spec in pl.parsed_placements(layout):
        if spec.kind == "blocked":
            return None
        if spec.kind == "strided":
            strided.add(spec.dim % ndim)
    return [runs[0] if len(runs) == 1 and dim not in strided else None
            for dim, runs in enumerate(pl.local_runs(layout))]


def cuts(reference: list[TensorMeta], candidate: list[TensorMeta]) -> list[Cut]:
    """Dims (of extent > 1) a tensor can be cut along, outermost first, with their shards' bounds: a dim no
    placement shards, or one every shard of both runs holds a single run of (plain shards, however uneven);
    none when a layout cannot be cut."""
    shape = reference[0].layout.global_shape
    bounds = [{0, extent} for extent in shape]
    for meta in (*reference, *candidate):
        held = _held_runs(meta.layout)
        if held is None:
            return []
        for dim, run in enumerate(held):
            if run is None:
                bounds[dim] = None
            elif bounds[dim] is not None and run[1]:
                bounds[dim] |= {run[0], run[0] + run[1]}
    return [Cut(dim, tuple(sorted(bounds[dim]))) for dim, extent in enumerate(shape) if extent > 1 and bounds[dim]]


def slab_dims(reference: list[TensorMeta], candidate: list[TensorMeta], budget: int | None) -> list[Cut] | None:
    """How a tensor is compared under `budget`: None, whole (no budget, or within it); else the dims to cut it
    along, [] when it is over the budget but cannot be cut (it is compared whole all the same)."""
    if budget is None or candidate[0].stats_only or working_bytes(candidate) <= budget:
        return None
    return cuts(reference, candidate)


def slab_lengths(shape: tuple[int, ...], dims: list[int], budget: int) -> dict[int, int]:
    """How many indices of each cut dim one slab spans: the outermost dims are cut first, down to
    one index each while a slab is still over the budget."""
    elements, lengths = math.prod(shape), {}
    for dim in dims:
        if elements * BYTES_PER_ELEMENT <= budget:
            break
        per_index = elements // shape[dim]
        lengths[dim] = max(1, budget // (per_index * BYTES_PER_ELEMENT))
        elements = per_index * lengths[dim]
    return lengths


def _slabs(lengths: dict[int, int], dims: list[Cut]) -> list[tuple[slice, ...]]:
    """Every slab, as a slice per leading dim up to the innermost cut one (slice(None): not cut); a slab
    never straddles a bound of its dim's shards, so each shard holds all of it or none."""
    bounds = {cut.dim: cut.bounds for cut in dims}
    depth = max(lengths) + 1
    ranges = [[slice(start, min(end, start + lengths[dim]))
               for begin, end in zip(bounds[dim], bounds[dim][1:]) for start in range(begin, end, lengths[dim])]
              if dim in lengths else [slice(None)] for dim in range(depth)]
    return list(itertools.product(*ranges))


def _slab_shards(reader: RunReader, metas: list[TensorMeta], region: tuple[slice, ...]) -> list[RecordedShard]:
    """The shards of the slab `region` (global indices): each shard holding it, read at its local indices, its
    layout that of the slab, in which the mesh axes that cut a cut dim have one member (it holds all of the slab
    there; the shards on the other members hold none of it and are left out)."""
    shards = []
    for meta in metas:
        layout = meta.layout
        held = _held_runs(layout)
        shape, local, mesh = list(layout.global_shape), [], list(layout.mesh_shape)
        for dim, part in enumerate(region):
            if part.start is None:
                local.append(part)
                continue
            start, length = held[dim]
            if not start <= part.start < part.stop <= start + length:
                break  # (bounds never split a slab: this shard holds none of it)
            shape[dim] = part.stop - part.start
            local.append(slice(part.start - start, part.stop - start))
            if length != layout.global_shape[dim]:
                for axis in pl.axes_cutting(layout, dim):
                    mesh[axis] = 1
        else:
            coordinate = tuple(0 if size == 1 else c for size, c in zip(mesh, layout.coordinate))
            slab = msgspec.structs.replace(layout, global_shape=tuple(shape), mesh_shape=tuple(mesh), coordinate=coordinate)
            shards.append(RecordedShard(rank=meta.rank, layout=slab, value=reader.read(meta, tuple(local))))
    return shards


def _slab_values(reader: RunReader, metas: list[TensorMeta], key: TensorKey,
                 region: tuple[slice, ...]) -> tuple[torch.Tensor, tuple[ReplicaDifference, ...]]:
    """One slab's logical values as stored (value_sums promotes them and undoes the loss scale chunk
    by chunk) and its replicas' differences."""
    canonical = canonicalize(_slab_shards(reader, metas, region), key, every_replica=True)
    return canonical.full, canonical.replica_differences


def compare_in_slabs(key: TensorKey, reference: RunReader, candidate: RunReader, tolerance, budget: int,
                     dims: list[Cut]) -> tuple[ValueMetrics, ReplicaDrift | None]:
    """The metrics and candidate replica drift of `key`, compared slab by slab over its `dims` so
    that a slab takes at most `budget` bytes (or one index of every cut dim, within a shard)."""
    ref_metas, cand_metas = reference.index[key], candidate.index[key]
    shape = ref_metas[0].layout.global_shape
    sums = ValueSums(shape=shape)
    by_pair: dict[tuple[int, int], list[ReplicaDifference]] = defaultdict(list)
    for region in _slabs(slab_lengths(shape, [cut.dim for cut in dims], budget), dims):
        actual, differences = _slab_values(candidate, cand_metas, key, region)
        for difference in differences:
            by_pair[difference.ranks].append(difference)
        expected, _ = _slab_values(reference, ref_metas, key, region)
        offset = tuple(part.start or 0 for part in region) + (0,) * (len(shape) - len(region))
        sums.add(value_sums(actual, expected, tolerance, shape=shape, offset=offset,
                            scales=(cand_metas[0].scale, ref_metas[0].scale)))
        del actual, expected  # before the next slab is read
    return metrics_from_sums(sums, tolerance), worst_drift([_merged(parts) for parts in by_pair.values()])


def _merged(parts: list[ReplicaDifference]) -> ReplicaDifference:
    """One replica's difference over the whole tensor from its differences per slab."""
    return ReplicaDifference(ranks=parts[0].ranks, max_abs_diff=max(p.max_abs_diff for p in parts),
                             diff_norm=math.hypot(*(p.diff_norm for p in parts)),
                             base_norm=math.hypot(*(p.base_norm for p in parts)))
