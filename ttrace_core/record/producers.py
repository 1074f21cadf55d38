"""Part of stage 1 (record): the layout of a plain shard that a module only passes on, from the module that produced it.

Input: every plain (non-DTensor) forward tensor the Tracer records with a sharded layout (a declared
one, a parallel style's converted output, or one found here), and later the plain tensors that other
modules receive and return. Output: the layout of such a tensor when no declaration says it, read
from its producer instead of from the user. layouts.py consults it after declarations and converted
outputs, so a declaration always wins and a DTensor never reaches it.

Two rules, both about the values themselves, not about any framework:
- **The same storage**: a module input that is the producer's output, or a view of all of it that is
  contiguous or a permutation of a contiguous one (`q_proj(x).view(batch, seq, heads, head_dim)`, and
  Gemma's `.transpose(1, 2)` of it), has the producer's layout, mapped through the view
  (`layout_through_view`) and the permutation (`layout_through_permutation`), the dims taken in their order
  in memory (`memory_order`). A view that holds only part of a sharded tensor cannot be mapped: it
  is left out with a finding naming the producer, never recorded as a whole tensor.
- **Shape-preserving modules**: the output of a module that is not declared, whose inputs were found
  here (handed a producer's shard; an input declared at the module itself makes it a boundary whose
  output is its own, a rowwise linear's) all with one layout, and whose output has their local shape,
  keeps that layout. An activation
  between a colwise and a rowwise linear (`act_fn`), Qwen3's per-head `q_norm`, hold shards of the
  same logical tensor they were given.

Worked example (TP 2, `q_proj` colwise with 4 heads of 16): rank 1's output is [2, 32, 32], layout
S(2) of a global [2, 32, 64]; its view [2, 32, 2, 16] splits the sharded dim into (heads, head_dim),
and a rank's contiguous block of 32 features is 2 whole heads, so the view is S(2) of [2, 32, 4, 16]:
rank 1 holds heads 2:4. A view [2, 32, 8, 4] would be S(2) of [2, 32, 16, 4] (features 32:64 are
rows 8:16); a view [2, 1024] merges the sequence dim in front of the sharded one, so a rank's part is
not one block of the merged dim, and is not mapped.

Tensors are matched by storage (data pointer and offset), each entry guarded by a weak reference to
that storage: a storage freed and reused by another tensor is never mistaken for it. (Not to the
tensor object: a module's full backward hook hands on a new alias of its output, and the object the
forward hook saw is gone by the time the next module receives the alias.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import msgspec
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ttrace_core.canonicalize.placements import placement_from_str
from ttrace_core.format.schema import Layout, TensorKey
from ttrace_core.record.declarations import UnknownLayoutError

SHARDED_KINDS = ("shard", "strided", "blocked")


def is_sharded(layout: Layout) -> bool:
    """Whether some mesh axis cuts the tensor (S, SS, SB): a replicated or partial tensor is not passed on here."""
    return _cuts(layout.placements)


@functools.lru_cache(maxsize=1024)
def _cuts(placements: tuple[str, ...]) -> bool:
    return any(placement_from_str(text).kind in SHARDED_KINDS for text in placements)


def dim_groups(source: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """How a row-major reshape of `source` into `target` regroups dims: (source dims, target dims) with
    equal products. The groups are cut over the dims larger than 1; a size-1 dim joins the group of the
    next larger dim after it (the last group when none follows), so a view that splits 16 features into
    (1 head, 16) puts the head dim outermost in the group. None when the element counts differ, one is
    empty, or every dim is 1."""
    if math.prod(source) != math.prod(target) or math.prod(source) == 0:
        return None
    source_dims = [d for d, size in enumerate(source) if size != 1]
    target_dims = [d for d, size in enumerate(target) if size != 1]
    if not source_dims:
        return None
    groups, a, b = [], 0, 0
    while a < len(source_dims) and b < len(target_dims):
        group_source, group_target = [source_dims[a]], [target_dims[b]]
        product_source, product_target = source[source_dims[a]], target[target_dims[b]]
        a, b = a + 1, b + 1
        while product_source != product_target:
            if product_source < product_target:
                group_source.append(source_dims[a])
                product_source *= source[source_dims[a]]
                a += 1
            else:
                group_target.append(target_dims[b])
                product_target *= target[target_dims[b]]
                b += 1
        groups.append((group_source, group_target))
    for side, shape in ((0, source), (1, target)):
        for dim in (d for d, size in enumerate(shape) if size == 1):
            owner = next((g for g in groups if max(g[side]) > dim), groups[-1])
            owner[side].append(dim)
    return [(sorted(group_source), sorted(group_target)) for group_source, group_target in groups]


def layout_through_view(layout: Layout, source_local: tuple[int, ...], target_local: tuple[int, ...]) -> Layout | None:
    """The layout of a contiguous view, of local shape `target_local`, of a whole local tensor of shape
    `source_local` laid out as `layout`; None when the view does not keep each rank's part a block of
    one target dim (the module docstring's example).

    S(d) maps to S(t) when d is the outermost globally larger-than-1 dim of its reshape group (so a
    rank's part is one contiguous block of the group) and t the group's outermost target dim, a size-1
    dim in front included (`dim_groups`: 16 features viewed as (1, 16) are one of 2 heads of 16, the
    `view(..., -1, head_dim)` of attention code; not 1 head of 32); the cut must be even
    (a shorter last shard would not fall on target rows). SS and SB map only when their dim is kept
    whole (a group of one dim on each side). R and P are unchanged."""
    source_local, target_local = tuple(source_local), tuple(target_local)
    if source_local == target_local:
        return layout
    if layout.flat_range is not None or len(layout.global_shape) != len(source_local):
        return None
    groups = dim_groups(source_local, target_local)
    if groups is None:
        return None
    group_of = {d: (group_source, group_target) for group_source, group_target in groups for d in group_source}
    global_target, placements = list(target_local), []
    for axis, text in enumerate(layout.placements):
        spec = placement_from_str(text)
        if spec.kind not in SHARDED_KINDS:
            placements.append(text)
            continue
        dim = spec.dim % len(source_local)
        group_source, group_target = group_of[dim]
        whole_source = [d for d in group_source if layout.global_shape[d] != 1]
        if spec.kind != "shard":
            whole_target = [d for d in group_target if target_local[d] != 1]
            if whole_source != [dim] or len(whole_target) > 1:
                return None  # SS and SB keep their meaning only on a dim the view leaves whole
            if layout.global_shape[dim] != source_local[dim] * _num_shards(layout, dim) or _num_placements(layout, dim) > 1:
                return None
            target_dim = (whole_target or group_target)[0]
            global_target[target_dim] *= layout.mesh_shape[axis]
            placements.append(str(replace(spec, dim=target_dim)))
            continue
        if not whole_source or whole_source[0] != dim:
            return None  # a larger dim outside it in the group: its part is strided in the target
        if layout.global_shape[dim] != source_local[dim] * _num_shards(layout, dim):
            return None  # an uneven cut: a shorter last shard would not fall on whole target rows
        global_target[group_target[0]] *= layout.mesh_shape[axis]
        placements.append(f"S({group_target[0]})")
    try:
        return msgspec.structs.replace(layout, global_shape=tuple(global_target), placements=tuple(placements))
    except ValueError:
        return None


def memory_order(value: torch.Tensor) -> tuple[int, ...] | None:
    """`value`'s dims from the outermost in memory to the innermost, when it is a permutation of a contiguous
    tensor (for a contiguous one, its dims in order); None when it is not. A size-1 dim sits just inside the larger
    dim whose stride it shares, as in a contiguous tensor: Gemma's `q_proj(x).view(b, s, 1, d).transpose(1, 2)`,
    of shape [b, 1, s, d] and contiguous to torch, keeps its head dim inside the sequence dim in memory."""
    strides, shape = value.stride(), value.shape
    order = tuple(sorted(range(value.dim()), key=lambda dim: (-strides[dim], shape[dim] == 1)))
    return order if value.permute(order).is_contiguous() else None


def layout_through_permutation(layout: Layout, order: tuple[int, ...]) -> Layout:
    """The layout of `base.permute(inverse of order)`, `base` laid out as `layout`: base dim j is dim order[j] of
    the permuted tensor (a transpose of a view moves the sharded head dim, and the cut moves with it)."""
    if order == tuple(range(len(order))):
        return layout
    global_shape = [0] * len(order)
    for base_dim, dim in enumerate(order):
        global_shape[dim] = layout.global_shape[base_dim]
    placements = []
    for text in layout.placements:
        spec = placement_from_str(text)
        placements.append(str(replace(spec, dim=order[spec.dim % len(order)])) if spec.kind in SHARDED_KINDS else text)
    return msgspec.structs.replace(layout, global_shape=tuple(global_shape), placements=tuple(placements))


def _num_shards(layout: Layout, dim: int) -> int:
    """Into how many parts the placements of all mesh axes cut `dim`."""
    parts = 1
    for axis, text in enumerate(layout.placements):
        spec = placement_from_str(text)
        if spec.kind in SHARDED_KINDS and spec.dim % len(layout.global_shape) == dim:
            parts *= layout.mesh_shape[axis]
    return parts


def _num_placements(layout: Layout, dim: int) -> int:
    return sum(1 for text in layout.placements if (spec := placement_from_str(text)).kind in SHARDED_KINDS
               and spec.dim % len(layout.global_shape) == dim)


def _storage_of(value: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or None for one that has none to point at (a wrapper subclass, a storage
    FSDP2 has resized away): such a tensor is neither a producer nor found as one."""
    try:
        storage = value.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return storage


@dataclass(slots=True)
class _Produced:
    storage: StorageWeakRef
    key: TensorKey
    layout: Layout
    offset: int
    shape: tuple[int, ...]
    contiguous: bool


class UnmappedView(UnknownLayoutError):
    """A tensor shares storage with a sharded producer but is not a view of all of it."""


@dataclass(slots=True)
class ProducerLayouts:
    """The sharded plain tensors recorded in the current step, by storage, and the inputs of each module
    call that were found here. Entries of an earlier step are dropped when the step state changes."""

    _state: object = None
    _by_storage: dict[int, list[_Produced]] = field(default_factory=dict)
    _call_inputs: dict[tuple[str, int, int], list[tuple[tuple[int, ...], Layout]]] = field(default_factory=dict)

    def _for(self, state: object) -> None:
        if state is not self._state:
            self._state, self._by_storage, self._call_inputs = state, {}, {}

    def remember(self, state: object, key: TensorKey, value: torch.Tensor, layout: Layout) -> None:
        """A forward tensor was recorded with `layout`: keep it if it is a plain shard."""
        self._for(state)
        if key.phase != "forward" or not is_sharded(layout) or value.numel() == 0:
            return
        if (storage := _storage_of(value)) is None:
            return
        pointer = storage.data_ptr()
        alive = [entry for entry in self._by_storage.get(pointer, []) if not entry.storage.expired()]
        alive.append(_Produced(StorageWeakRef(storage), key, layout, value.storage_offset(), tuple(value.shape),
                               value.is_contiguous()))
        self._by_storage[pointer] = alive

    def layout_of(self, state: object, key: TensorKey, value: torch.Tensor) -> Layout | None:
        """The producer's layout of a plain forward tensor (see the module docstring), or None. Raises
        UnmappedView for a part of a sharded tensor that cannot be mapped."""
        self._for(state)
        if key.phase != "forward" or not self._by_storage or value.numel() == 0:
            return None  # no plain shard recorded this step: nothing to look up
        if (found := self._through_storage(key, value)) is not None:
            if key.slot.startswith("input."):  # this call was handed a shard: its output may pass it on
                self._call_inputs.setdefault((key.fqn, key.micro_batch, key.call), []).append((tuple(value.shape), found))
            return found
        if key.slot.startswith("output."):
            inputs = self._call_inputs.get((key.fqn, key.micro_batch, key.call), [])
            layouts = {layout for shape, layout in inputs if shape == tuple(value.shape)}
            if len(layouts) == 1 and len({layout for _, layout in inputs}) == 1:
                return layouts.pop()
        return None

    def _through_storage(self, key: TensorKey, value: torch.Tensor) -> Layout | None:
        storage = _storage_of(value)
        if storage is None:
            return None
        entries = [e for e in self._by_storage.get(storage.data_ptr(), []) if not e.storage.expired()]
        shape, offset = tuple(value.shape), value.storage_offset()
        for entry in entries:
            if entry.shape == shape and entry.offset == offset and value.is_contiguous() == entry.contiguous:
                return entry.layout
        order = memory_order(value)
        for entry in entries:
            if entry.offset == offset and entry.contiguous and order is not None and value.numel() == math.prod(entry.shape):
                mapped = layout_through_view(entry.layout, entry.shape, tuple(shape[dim] for dim in order))
                if mapped is not None:
                    return layout_through_permutation(mapped, order)
        if entries:
            producer = entries[0]
            raise UnmappedView(
                f"{key.fqn} {key.slot}: not recorded, it is a view of shape {list(shape)} (storage offset {offset}) of "
                f"{producer.key.fqn} {producer.key.slot}, a plain shard of shape {list(producer.shape)} laid out as "
                f"{list(producer.layout.placements)} of {list(producer.layout.global_shape)}, and ttrace cannot map "
                "that view; declare its layout with session.declare(fqn, slot, placements, mesh)")
        return None
