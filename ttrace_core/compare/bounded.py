"""Part of stage 3 (compare): one tensor compared in bounded memory, slab by slab.

Comparing a tensor holds its canonical values and their float64 differences at once, about
BYTES_PER_ELEMENT bytes per element (measured: benchmarks/compare_memory.py). A tensor that would
take more than the budget (`ttrace compare --max-memory`) is cut along a dim that no placement of
either run shards: every shard then holds the whole extent of that dim, so each slab is read from
every shard as a hyperslab (HDF5 reads only its bytes), canonicalized and compared on its own, and
the slabs' sums (compare.ValueSums, canonicalize.replicas.ReplicaDifference) give the row the whole tensor
would. A tensor with every dim sharded, flat ranges or blocked placements cannot be cut this way and
is compared whole (`compare_runs` says so in a note).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

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


def _sharded_dims(layout: Layout) -> set[int] | None:
    """Dims any placement cuts; None when the layout cannot be cut into slabs at all."""
    if layout.flat_range is not None:
        return None
    dims = set()
    for spec in pl.parsed_placements(layout):
        if spec.kind == "blocked":
            return None
        if spec.dim is not None:
            dims.add(spec.dim % len(layout.global_shape))
    return dims


def free_dims(reference: list[TensorMeta], candidate: list[TensorMeta]) -> list[int]:
    """Dims (of extent > 1) no shard of either run has cut, outermost first; none when a layout cannot be cut."""
    cut: set[int] = set()
    for meta in (*reference, *candidate):
        dims = _sharded_dims(meta.layout)
        if dims is None:
            return []
        cut |= dims
    shape = reference[0].layout.global_shape
    return [dim for dim, extent in enumerate(shape) if extent > 1 and dim not in cut]


def slab_dims(reference: list[TensorMeta], candidate: list[TensorMeta], budget: int | None) -> list[int] | None:
    """How a tensor is compared under `budget`: None, whole (no budget, or within it); else the free dims
    to cut it along, [] when it is over the budget but cannot be cut (it is compared whole all the same)."""
    if budget is None or candidate[0].stats_only or working_bytes(candidate) <= budget:
        return None
    return free_dims(reference, candidate)


def slab_lengths(shape: tuple[int, ...], dims: list[int], budget: int) -> dict[int, int]:
    """How many indices of each free dim one slab spans: the outermost free dims are cut first, down to
    one index each while a slab is still over the budget."""
    elements, lengths = math.prod(shape), {}
    for dim in dims:
        if elements * BYTES_PER_ELEMENT <= budget:
            break
        per_index = elements // shape[dim]
        lengths[dim] = max(1, budget // (per_index * BYTES_PER_ELEMENT))
        elements = per_index * lengths[dim]
    return lengths


def _slabs(shape: tuple[int, ...], lengths: dict[int, int]) -> list[tuple[slice, ...]]:
    """Every slab, as a slice per leading dim up to the innermost cut one (slice(None): not cut)."""
    depth = max(lengths) + 1
    ranges = [[slice(start, min(shape[dim], start + lengths[dim])) for start in range(0, shape[dim], lengths[dim])]
              if dim in lengths else [slice(None)] for dim in range(depth)]
    return list(itertools.product(*ranges))


def _slab_shards(reader: RunReader, metas: list[TensorMeta], region: tuple[slice, ...]) -> list[RecordedShard]:
    shards = []
    for meta in metas:
        shape = list(meta.layout.global_shape)
        for dim, part in enumerate(region):
            if part.start is not None:
                shape[dim] = part.stop - part.start
        layout = msgspec.structs.replace(meta.layout, global_shape=tuple(shape))
        shards.append(RecordedShard(rank=meta.rank, layout=layout, value=reader.read(meta, region)))
    return shards


def _slab_values(reader: RunReader, metas: list[TensorMeta], key: TensorKey,
                 region: tuple[slice, ...]) -> tuple[torch.Tensor, tuple[ReplicaDifference, ...]]:
    """One slab's logical values as stored (value_sums promotes them and undoes the loss scale chunk
    by chunk) and its replicas' differences."""
    canonical = canonicalize(_slab_shards(reader, metas, region), key, every_replica=True)
    return canonical.full, canonical.replica_differences


def compare_in_slabs(key: TensorKey, reference: RunReader, candidate: RunReader, tolerance, budget: int,
                     dims: list[int]) -> tuple[ValueMetrics, ReplicaDrift | None]:
    """The metrics and candidate replica drift of `key`, compared slab by slab over its free `dims` so
    that a slab takes at most `budget` bytes (or one index of every free dim)."""
    ref_metas, cand_metas = reference.index[key], candidate.index[key]
    shape = ref_metas[0].layout.global_shape
    sums = ValueSums(shape=shape)
    by_pair: dict[tuple[int, int], list[ReplicaDifference]] = defaultdict(list)
    for region in _slabs(shape, slab_lengths(shape, dims, budget)):
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
