"""Placement math: which slice of a logical tensor a mesh coordinate holds. Plain Python on tuples.

A layout assigns one placement to each mesh axis. Their meaning, once:

- "S(d)", shard along tensor dim d. The dim is cut in `torch.chunk` order: with size n over k
  ranks every chunk has ceil(n / k) elements and the last ones are shorter or empty. Rank 2 of 4
  on a dim of 8 holds rows 4:6; rank 3 of 4 on a dim of 5 holds nothing (a zero-size shard is legal).
  Several mesh axes sharding the same dim nest left to right, as DTensor does: on mesh (2, 2) with
  ("S(0)", "S(0)") and 8 rows, coordinate (1, 0) holds rows 4:6.
- "R", replicate: every coordinate along the axis holds the same values. Replicas that differ
  are a finding of their own (replica drift).
- "P(sum)" / "P(avg)", partial: the logical value is the sum (mean) over the axis of what each
  coordinate holds. A RowwiseParallel output before its all-reduce is P(sum) over the TP axis.
- "SB(d,b)", blocked shard: dim d is b equal blocks, each sharded along the axis, and a rank holds
  its chunk of every block, concatenated. Megatron's SwiGLU fc1 is SB(0,2): with 8 rows
  ([gate 0:4; up 4:8]) over 2 ranks, rank 1 holds rows [2:4, 6:8]. Mapped by viewing dim d as
  (b, d / b) and sharding the second of the two (`blocked_view`).
- "SS(d,f)", DTensor's _StridedShard(d, split_factor=f), which FSDP2 `fully_shard` puts on the DP
  axis of a parameter that TP already shards along d: the rows are cut for TP first and then for
  FSDP, the opposite of the left-to-right nesting of S(d). The current extent of dim d is cut into
  f `torch.chunk` pieces, each piece is cut into (axis size) `torch.chunk` chunks, and coordinate i
  holds chunk i of every piece, concatenated in piece order. Later placements on dim d cut that
  concatenation as usual. On a (dp=2, tp=2) mesh, an [8, 4] weight with (SS(0,2), S(0)): along dp
  the pieces are rows 0:4 and 4:8, so dp=1 holds rows [2:4, 6:8]; along tp, tp=0 holds the first
  half of that, rows 2:4, and (dp=0, tp=1) holds rows 4:6. Uneven sizes follow torch.chunk at both
  cuts, as DTensor does: 5 rows under SS(0,2) alone over 2 ranks give rank 0 rows [0:2, 3:4] and
  rank 1 rows [2:3, 4:5].

The gradient of a tensor is laid out like the tensor, except along a partial axis (`gradient_placement`):
each coordinate's share y_i of y = sum_i y_i gets the whole of dL/dy, so the gradient of a P(sum) tensor
is R; of a P(avg) tensor, each gets dL/dy / n, which add up to it: P(sum). (Under TP, the gradient of a
row-parallel output before its all-reduce is replicated: taken as P(sum), it would read as twice itself.)

Along each dim a coordinate holds a tuple of runs, (start, length) ranges of global indices in the
order the local tensor stores them (`local_runs`). Every placement but SS keeps that a single run;
an empty shard is one run of length 0 at the place it would start.

A layout is parsed once: the functions of a `Layout` (a frozen record) keep their answers
(`functools.lru_cache`), since a run repeats a few hundred layouts over thousands of tensors.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from ttrace_core.errors import LayoutError
from ttrace_core.format.schema import MAX_WORLD_SIZE, Layout

_SHARD = re.compile(r"^S\((-?\d+)\)$")
_STRIDED = re.compile(r"^SS\((-?\d+),(\d+)\)$")
_BLOCKED = re.compile(r"^SB\((-?\d+),(\d+)\)$")
_PARTIAL = re.compile(r"^P\((sum|avg)\)$")


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    kind: str
    """"shard", "replicate", "partial", "blocked" or "strided"."""
    dim: int | None = None
    reduce_op: str | None = None
    split_factor: int | None = None

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"S({self.dim})"
        if self.kind == "partial":
            return f"P({self.reduce_op})"
        if self.kind == "strided":
            return f"SS({self.dim},{self.split_factor})"
        if self.kind == "blocked":
            return f"SB({self.dim},{self.split_factor})"
        return "R"


LAYOUTS_KEPT = 1 << 16
"""Layouts whose parsed form each function keeps (a 48-layer run has a few thousand distinct ones)."""


def _kept(function):
    """`function` of a layout, its answers kept: by the layout object itself first (a tensor's shards ask
    several functions of the same object, and a frozen dataclass's hash and equality run in Python), then
    by its value; a layout built with lists (unhashable) is parsed each time."""
    cached = functools.lru_cache(maxsize=LAYOUTS_KEPT)(function)
    by_object: dict[tuple, tuple] = {}

    @functools.wraps(function)
    def kept(layout, *args):
        key = (id(layout), *args)
        if (found := by_object.get(key)) is not None and found[0] is layout:
            return found[1]
        try:
            answer = cached(layout, *args)
        except TypeError:
            return function(layout, *args)
        if len(by_object) >= LAYOUTS_KEPT:
            by_object.clear()
        by_object[key] = (layout, answer)  # holds the layout: its id cannot be another's while it is here
        return answer
    return kept


@functools.lru_cache(maxsize=4096)
def placement_from_str(text: str) -> PlacementSpec:
    text = text.replace(" ", "")
    if text == "R":
        return PlacementSpec("replicate")
    if match := _SHARD.match(text):
        return PlacementSpec("shard", dim=int(match.group(1)))
    if match := _PARTIAL.match(text):
        return PlacementSpec("partial", reduce_op=match.group(1))
    if match := _STRIDED.match(text):
        if int(match.group(2)) > MAX_WORLD_SIZE:  # the factor is a product of mesh sizes; a larger one is damage
            raise LayoutError(f"placement {text!r}: a split factor above {MAX_WORLD_SIZE}, the most ranks a run has")
        return PlacementSpec("strided", dim=int(match.group(1)), split_factor=int(match.group(2)))
    if match := _BLOCKED.match(text):
        return PlacementSpec("blocked", dim=int(match.group(1)), split_factor=int(match.group(2)))
    raise LayoutError(f"unknown placement {text!r}: expected one of R, S(d), SB(d,b), P(sum), P(avg), SS(d,f)")


GRADIENT_OF_PARTIAL = {"P(sum)": "R", "P(avg)": "P(sum)"}


def gradient_placement(text: str) -> str:
    """The placement of a tensor's gradient along an axis where the tensor has `text` (module docstring)."""
    spec = placement_from_str(text)
    return GRADIENT_OF_PARTIAL[str(spec)] if spec.kind == "partial" else text


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk `index` when `size` elements are cut into `num_chunks` torch.chunk pieces."""
    chunk = math.ceil(size / num_chunks) if num_chunks else 0
    start = min(index * chunk, size)
    return start, max(0, min(chunk, size - start))


def _normalized_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise LayoutError(f"a placement on dim {dim} names a dim a {ndim}-dim tensor does not have")
    return dim % ndim


def parsed_placements(layout: Layout) -> list[PlacementSpec]:
    return [placement_from_str(text) for text in layout.placements]


Runs = tuple[tuple[int, int], ...]
"""(start, length) ranges of global indices along one dim, in the order the local tensor holds them."""


def strided_chunk_positions(size: int, split_factor: int, num_chunks: int, index: int) -> Runs:
    """(start, length) positions within an extent of `size` that chunk `index` of an SS(d, split_factor)
    cut into `num_chunks` holds: chunk `index` of each of the `split_factor` pieces, in piece order."""
    positions = []
    for piece in range(split_factor):
        piece_start, piece_length = chunk_bounds(size, split_factor, piece)
        offset, length = chunk_bounds(piece_length, num_chunks, index)
        positions.append((piece_start + offset, length))
    return tuple(positions)


def _global_position(runs: Runs, position: int) -> int:
    """The global index at `position` of the concatenated runs (one past the last run at the end)."""
    for start, length in runs:
        if position < length:
            return start + position
        position -= length
    return runs[-1][0] + runs[-1][1]


def runs_at(runs: Runs, positions: Runs) -> Runs:
    """The global runs at `positions` ((start, length) ranges of the concatenation of `runs`), merged;
    a single run of length 0 at the first position when the positions hold nothing."""
    taken: list[tuple[int, int]] = []
    for position, length in positions:
        base = 0
        for start, run_length in runs:
            low, high = max(position, base), min(position + length, base + run_length)
            if low < high:
                if taken and taken[-1][0] + taken[-1][1] == start + low - base:
                    taken[-1] = (taken[-1][0], taken[-1][1] + high - low)
                else:
                    taken.append((start + low - base, high - low))
            base += run_length
    return tuple(taken) or ((_global_position(runs, positions[0][0]), 0),)


@_kept
def local_runs(layout: Layout) -> tuple[Runs, ...]:
    """Per tensor dim, the runs of global indices that `layout.coordinate` holds (see the module docstring).

    Placements apply left to right, each to the extent the previous ones left along its dim, as
    DTensor's compute_local_shape_and_global_offset does.
    """
    ndim = len(layout.global_shape)
    runs: list[Runs] = [((0, size),) for size in layout.global_shape]
    for axis, spec in enumerate(parsed_placements(layout)):
        if spec.kind not in ("shard", "strided"):
            continue
        dim = _normalized_dim(spec.dim, ndim)
        size = sum(length for _, length in runs[dim])
        num_chunks, index = layout.mesh_shape[axis], layout.coordinate[axis]
        if spec.kind == "shard":
            positions = (chunk_bounds(size, num_chunks, index),)
        else:
            positions = strided_chunk_positions(size, spec.split_factor, num_chunks, index)
        runs[dim] = runs_at(runs[dim], positions)
    return tuple(runs)


def local_region(layout: Layout) -> tuple[tuple[int, int], ...]:
    """(start, length) per tensor dim of the block that `layout.coordinate` holds, when it is one block."""
    region = []
    for dim, runs in enumerate(local_runs(layout)):
        if len(runs) != 1:
            raise LayoutError(
                f"placements {layout.placements} on mesh {layout.mesh_shape} give coordinate {layout.coordinate} "
                f"{len(runs)} separate ranges {list(runs)} along dim {dim} of global shape {layout.global_shape}, "
                "not one block: only canonicalize() and shard() map such a shard (by local_blocks)"
            )
        region.append(runs[0])
    return tuple(region)


def local_blocks(layout: Layout) -> list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]]:
    """(global region, local region) of every contiguous block `layout.coordinate` holds, each region
    (start, length) per dim: the local tensor at the local region equals the full one at the global."""
    return list(_local_blocks(layout))


@_kept
def _local_blocks(layout: Layout) -> tuple[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], ...]:
    blocks: list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = [((), ())]
    for runs in local_runs(layout):
        offsets = [sum(length for _, length in runs[:i]) for i in range(len(runs))]
        blocks = [(global_ + (run,), local + ((offset, run[1]),))
                  for global_, local in blocks for run, offset in zip(runs, offsets)]
    return tuple(blocks)


@_kept
def local_shape(layout: Layout) -> tuple[int, ...]:
    if layout.flat_range is not None:
        start, end = layout.flat_range
        return (end - start,)
    view = blocked_view(layout)
    if view is not None:
        shape, dim = list(local_shape(view)), _blocked_dim(layout)
        return tuple(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:])
    return tuple(sum(length for _, length in runs) for runs in local_runs(layout))


def _blocked_dim(layout: Layout) -> int:
    spec = next(placement_from_str(t) for t in layout.placements if t.startswith("SB"))
    return _normalized_dim(spec.dim, len(layout.global_shape))


@_kept
def blocked_view(layout: Layout) -> Layout | None:
    """For a layout with an SB(d,b) placement: the same layout on the tensor viewed with dim d split
    into (b, size / b), where SB becomes a plain S(d + 1); None when there is no SB placement."""
    specs = [placement_from_str(t) for t in layout.placements]
    blocked = [spec for spec in specs if spec.kind == "blocked"]
    if not blocked:
        return None
    dims = {_normalized_dim(spec.dim, len(layout.global_shape)) for spec in blocked}
    blocks = {spec.split_factor for spec in blocked}
    dim, num_blocks = dims.pop(), blocks.pop()
    if dims or blocks or layout.global_shape[dim] % num_blocks or layout.flat_range is not None:
        raise LayoutError(f"placements {layout.placements} of global shape {layout.global_shape}: SB(d,b) needs one "
                          "dim, one block count dividing it, and no flat range")
    shape = list(layout.global_shape)
    shape[dim:dim + 1] = [num_blocks, shape[dim] // num_blocks]
    placements = []
    for spec in specs:
        if spec.kind in ("shard", "blocked", "strided"):
            spec_dim = _normalized_dim(spec.dim, len(layout.global_shape))
            if spec.kind == "strided" and spec_dim == dim:
                raise LayoutError(f"placements {layout.placements} of global shape {layout.global_shape}: SS and SB "
                                  f"on the same dim {dim} cannot be mapped; record this tensor unblocked")
            view_dim = spec_dim + 1 if spec_dim > dim or spec.kind == "blocked" else spec_dim
            placements.append(str(PlacementSpec(spec.kind if spec.kind == "strided" else "shard", dim=view_dim,
                                                split_factor=spec.split_factor)))
        else:
            placements.append(str(spec))
    return Layout(global_shape=tuple(shape), mesh_shape=layout.mesh_shape, coordinate=layout.coordinate,
                  placements=tuple(placements), mesh_axis_names=layout.mesh_axis_names)


def axes_of_kind(layout: Layout, kind: str) -> list[int]:
    return list(_axes_of_kind(layout, kind))


@_kept
def _axes_of_kind(layout: Layout, kind: str) -> tuple[int, ...]:
    return tuple(axis for axis, spec in enumerate(parsed_placements(layout)) if spec.kind == kind)


def axes_cutting(layout: Layout, dim: int) -> list[int]:
    """The mesh axes whose placements cut tensor dim `dim`."""
    ndim = len(layout.global_shape)
    return [axis for axis, spec in enumerate(parsed_placements(layout))
            if spec.kind in ("shard", "strided", "blocked") and _normalized_dim(spec.dim, ndim) == dim % ndim]


def partial_coordinate(layout: Layout) -> tuple[int, ...]:
    """The coordinate along partial axes: shards that share a region but differ here are summed."""
    return tuple(layout.coordinate[axis] for axis in axes_of_kind(layout, "partial"))


def global_shape_from_local(local: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[str, ...]) -> tuple[int, ...]:
    """Global shape of evenly sharded data; used for plain tensors declared with an annotation."""
    shape = list(local)
    for axis, text in enumerate(placements):
        spec = placement_from_str(text)
        if spec.kind in ("shard", "blocked", "strided"):
            dim = _normalized_dim(spec.dim, len(shape))
            shape[dim] *= mesh_shape[axis]
    return tuple(shape)


def without_mesh_axes(layout: Layout, axis_names: tuple[str, ...], local_shape: tuple[int, ...]) -> Layout:
    """This rank's part of `layout` as if the mesh axes named `axis_names` were not there: a Shard over one
    becomes the whole of the dim this rank holds, a Replicate or Partial over one is dropped. What an
    activation sharded over data parallelism is under ttrace's micro-batch rule, where a data-parallel
    rank's local batch is a micro-batch of its own: activations (8, 16) laid out (S(0), S(1)) over
    (dp 2, tp 2) give rank (dp 1, tp 0) a (4, 8) block, and without dp a (4, 16) tensor, S(1) over tp.
    A strided or blocked placement over such an axis is kept as recorded."""
    dropped = [axis for axis, name in enumerate(layout.mesh_axis_names) if name in axis_names]
    specs = parsed_placements(layout)
    if not dropped or any(specs[axis].kind not in ("shard", "replicate", "partial") for axis in dropped):
        return layout
    kept = [axis for axis in range(len(layout.mesh_shape)) if axis not in dropped]
    ndim = len(layout.global_shape)
    global_shape = list(layout.global_shape)
    for dim in {_normalized_dim(specs[axis].dim, ndim) for axis in dropped if specs[axis].kind == "shard"}:
        still_sharding = [axis for axis in kept if specs[axis].dim is not None and _normalized_dim(specs[axis].dim, ndim) == dim]
        global_shape[dim] = local_shape[dim] * math.prod(layout.mesh_shape[axis] for axis in still_sharding)
    return Layout(global_shape=tuple(global_shape), mesh_shape=tuple(layout.mesh_shape[axis] for axis in kept),
                  coordinate=tuple(layout.coordinate[axis] for axis in kept),
                  placements=tuple(layout.placements[axis] for axis in kept),
                  mesh_axis_names=tuple(layout.mesh_axis_names[axis] for axis in kept), flat_range=layout.flat_range)


def all_coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coordinates: list[tuple[int, ...]] = [()]
    for size in mesh_shape:
        coordinates = [coord + (index,) for coord in coordinates for index in range(size)]
    return coordinates


def coordinate_from_rank(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinate of `rank` in a mesh laid out as torch.arange(world).view(mesh_shape)."""
    coordinate = []
    for size in reversed(mesh_shape):
        coordinate.append(rank % size)
        rank //= size
    return tuple(reversed(coordinate))
