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
- "SS(d,f)", DTensor's _StridedShard (FSDP2 over TP on a 2-D mesh). Recognized so that it can be
  rejected by name: its interleaved offsets are not mapped yet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ttrace_core.errors import LayoutError
from ttrace_core.schema import Layout

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


def placement_from_str(text: str) -> PlacementSpec:
    text = text.replace(" ", "")
    if text == "R":
        return PlacementSpec("replicate")
    if match := _SHARD.match(text):
        return PlacementSpec("shard", dim=int(match.group(1)))
    if match := _PARTIAL.match(text):
        return PlacementSpec("partial", reduce_op=match.group(1))
    if match := _STRIDED.match(text):
        return PlacementSpec("strided", dim=int(match.group(1)), split_factor=int(match.group(2)))
    if match := _BLOCKED.match(text):
        return PlacementSpec("blocked", dim=int(match.group(1)), split_factor=int(match.group(2)))
    raise LayoutError(f"unknown placement {text!r}: expected one of R, S(d), SB(d,b), P(sum), P(avg), SS(d,f)")


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk `index` when `size` elements are cut into `num_chunks` torch.chunk pieces."""
    chunk = math.ceil(size / num_chunks) if num_chunks else 0
    start = min(index * chunk, size)
    return start, max(0, min(chunk, size - start))


def _normalized_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise LayoutError(f"placement S({dim}) names a dim a {ndim}-dim tensor does not have")
    return dim % ndim


def parsed_placements(layout: Layout) -> list[PlacementSpec]:
    specs = [placement_from_str(text) for text in layout.placements]
    for axis, spec in enumerate(specs):
        if spec.kind == "strided":
            name = layout.mesh_axis_names[axis] if axis < len(layout.mesh_axis_names) else str(axis)
            raise LayoutError(
                f"placement _StridedShard(dim={spec.dim}, split_factor={spec.split_factor}) on mesh axis "
                f"{name!r} (FSDP2 over TP) is not supported yet; record these parameters on a 1-D mesh "
                "or exclude them with TracerConfig(exclude=...)"
            )
    return specs


def local_region(layout: Layout) -> tuple[tuple[int, int], ...]:
    """(start, length) per tensor dim of the block that `layout.coordinate` holds."""
    ndim = len(layout.global_shape)
    region = [(0, size) for size in layout.global_shape]
    for axis, spec in enumerate(parsed_placements(layout)):
        if spec.kind != "shard":
            continue
        dim = _normalized_dim(spec.dim, ndim)
        start, length = region[dim]
        offset, local_length = chunk_bounds(length, layout.mesh_shape[axis], layout.coordinate[axis])
        region[dim] = (start + offset, local_length)
    return tuple(region)


def local_shape(layout: Layout) -> tuple[int, ...]:
    if layout.flat_range is not None:
        start, end = layout.flat_range
        return (end - start,)
    view = blocked_view(layout)
    if view is not None:
        shape, dim = [length for _, length in local_region(view)], _blocked_dim(layout)
        return tuple(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:])
    return tuple(length for _, length in local_region(layout))


def _blocked_dim(layout: Layout) -> int:
    spec = next(placement_from_str(t) for t in layout.placements if t.startswith("SB"))
    return _normalized_dim(spec.dim, len(layout.global_shape))


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
        if spec.kind in ("shard", "blocked"):
            spec_dim = _normalized_dim(spec.dim, len(layout.global_shape))
            placements.append(f"S({spec_dim + 1 if spec_dim > dim or spec.kind == 'blocked' else spec_dim})")
        else:
            placements.append(str(spec))
    return Layout(global_shape=tuple(shape), mesh_shape=layout.mesh_shape, coordinate=layout.coordinate,
                  placements=tuple(placements), mesh_axis_names=layout.mesh_axis_names)


def axes_of_kind(layout: Layout, kind: str) -> list[int]:
    return [axis for axis, spec in enumerate(parsed_placements(layout)) if spec.kind == kind]


def partial_coordinate(layout: Layout) -> tuple[int, ...]:
    """The coordinate along partial axes: shards that share a region but differ here are summed."""
    return tuple(layout.coordinate[axis] for axis in axes_of_kind(layout, "partial"))


def global_shape_from_local(local: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[str, ...]) -> tuple[int, ...]:
    """Global shape of evenly sharded data; used for plain tensors declared with an annotation."""
    shape = list(local)
    for axis, text in enumerate(placements):
        spec = placement_from_str(text)
        if spec.kind in ("shard", "blocked"):
            dim = _normalized_dim(spec.dim, len(shape))
            shape[dim] *= mesh_shape[axis]
    return tuple(shape)


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
