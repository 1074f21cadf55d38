"""The tensor transforms of a correspondence map (correspondence.py): how the reference's logical tensors
become one of the candidate's, and back.

Part of stage 2 (canonicalize). Input: the logical tensors a map rule names on the reference side (its
"pieces", in the rule's order) and the rule's ops; output: the candidate's logical tensor. Parameter rules
also run backwards (`reference_pieces`): the weight conversion that puts both runs on identical logical
weights is the same ops inverted, so the correspondence is stated once.

Ops act on the list of pieces: `select`, `permute`, `unflatten`, `flatten`, `rotary` and `scale` act on
each piece; `concat` and `sum` turn the list into one tensor. A worked example, megatron's fused QKV with 2 query
groups of 2 query heads (head_dim 1, so rows are heads):

    q_proj.weight rows [q0 q1 q2 q3], k_proj [k0 k1], v_proj [v0 v1]
    concat(dim=0, groups=2) -> [q0 q1 k0 v0 | q2 q3 k1 v1]: each piece cut into 2 groups, group g of every
    piece side by side, then the groups one after the other ("interleaved per query group").

With groups 1 it is a plain concatenation: megatron's SwiGLU fc1 [gate; up]. `rotary` moves the two halves
of each head's rotary pairs between the half-split layout (HF's rotate_half: [x0 x1 .. | y0 y1 ..]) and the
interleaved one ([x0 y0 x1 y1 ..]), as a checkpoint converter permutes q/k rows between the two.
Sizes may name facts of the model (`groups = "num_query_groups"`), resolved by the caller.

`select` takes one index of a fused parameter: HF's Mixtral stores its experts as 3-D tensors
(`experts.gate_up_proj` [experts, 2 x intermediate, hidden]), megatron one module per expert
(`local_experts.{expert}.linear_fc1.weight` [2 x intermediate, hidden]). Its `index` names the candidate's
placeholder, which one rule binds to every index below `count` (`select_bindings`, `bind`); the weight
conversion puts each expert's tensor back at its index, and all of them make the whole:

    gate_up_proj [4, 512, 64]  select(dim=0, index="expert", count=4)  ->  local_experts.{0,1,2,3}.linear_fc1.weight
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

ROTARY_LAYOUTS = ("half-split", "interleaved")


class Op(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="op"):
    """One step of a rule's transform."""

    combines = False
    """Whether it turns the list of pieces into one tensor."""
    invertible = True
    """Whether the reference's pieces can be recovered from its result (parameter rules need that)."""


class Permute(Op, tag="permute"):
    """torch.permute of each piece: [b, s, h] -> [s, b, h] is dims [1, 0, 2]."""

    dims: list[int]


class Unflatten(Op, tag="unflatten"):
    """torch.unflatten of each piece: dim into `sizes` (ints, fact names, at most one -1)."""

    dim: int
    sizes: list[int | str]


class Flatten(Op, tag="flatten"):
    """torch.flatten of each piece, dims start..end (inclusive)."""

    start: int
    end: int


class Concat(Op, tag="concat"):
    """The pieces side by side along `dim`, per group: each piece is cut into `groups` equal chunks and the
    result holds group g of every piece, then group g + 1 (groups 1: a plain concatenation)."""

    dim: int
    groups: int | str = 1
    combines = True


class Sum(Op, tag="sum"):
    """The pieces added: a gradient that reaches one fused module's input from several separate modules."""

    combines = True
    invertible = False


class Rotary(Op, tag="rotary"):
    """Each head's rotary pairs along `dim` moved from layout `source` to `target` (ROTARY_LAYOUTS)."""

    dim: int
    head_dim: int | str
    source: Literal["half-split", "interleaved"]
    target: Literal["half-split", "interleaved"]
    pieces: list[int] | None = None
    """The pieces it acts on, by index in the rule's reference list; all when unset. torchtitan's fused
    wqkv rotates q and k, not v: `pieces = [0, 1]`."""


class Select(Op, tag="select"):
    """Index `index` of each piece along `dim`, that dim dropped: one expert's weight of a fused 3-D parameter.
    `index` names a placeholder of the candidate's name, bound to each of 0 .. `count` - 1 (an int or a fact)
    in turn, or is an int. It comes first in a transform (correspondence.check_map): its inverse is a slice of
    the reference's tensor as recorded, which the weight conversion fills in (`reference_pieces`)."""

    dim: int
    index: int | str
    count: int | str


class Scale(Op, tag="scale"):
    """Each piece times `factor` (a loss normalized otherwise on one side)."""

    factor: float


AnyOp = Select | Permute | Unflatten | Flatten | Concat | Sum | Rotary | Scale
Facts = dict[str, int]


def size_of(value: int | str, facts: Facts, where: str) -> int:
    """An op's size: an int, or the value of a named fact."""
    if isinstance(value, int):
        return value
    if value not in facts:
        raise KeyError(f"{where}: names fact {value!r}, which the run does not state")
    return facts[value]


def leading_select(ops: list[AnyOp]) -> Select | None:
    """The rule's `select`, which check_map allows first only, or None."""
    return ops[0] if ops and isinstance(ops[0], Select) else None


def select_bindings(ops: list[AnyOp], facts: Facts, where: str) -> list[dict[str, str]]:
    """The placeholder bindings a rule's `select` adds, one per index ([{}] without one): a rule whose select
    names placeholder "expert" with count 4 gives [{"expert": "0"}, .., {"expert": "3"}]."""
    select = leading_select(ops)
    if select is None or isinstance(select.index, int):
        return [{}]
    return [{select.index: str(index)} for index in range(size_of(select.count, facts, where))]


def bind(ops: list[AnyOp], binding: dict[str, str]) -> list[AnyOp]:
    """The ops with a `select` index that names a placeholder replaced by its bound value."""
    select = leading_select(ops)
    if select is None or isinstance(select.index, int):
        return list(ops)
    return [msgspec.structs.replace(select, index=int(binding[select.index])), *ops[1:]]


def _rotary_index(size: int, head_dim: int, source: str, target: str) -> torch.Tensor:
    """Positions along a dim of `size` (whole heads of `head_dim`) that take a tensor from `source` to `target`."""
    half = head_dim // 2
    interleaved_from_half = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).reshape(-1)
    within = interleaved_from_half if (source, target) == ("half-split", "interleaved") else \
        torch.argsort(interleaved_from_half)
    if source == target:
        within = torch.arange(head_dim)
    return (torch.arange(size // head_dim)[:, None] * head_dim + within[None, :]).reshape(-1)


def _select(op: Select, pieces: list[torch.Tensor], facts: Facts, where: str) -> list[torch.Tensor]:
    if isinstance(op.index, str):
        raise ValueError(f"{where}: select's index {op.index!r} is not bound to a value (bind the rule's placeholders)")
    count = size_of(op.count, facts, where)
    for piece in pieces:
        if piece.shape[op.dim] != count or not 0 <= op.index < count:
            raise ValueError(f"{where}: select index {op.index} of {count} along dim {op.dim}, but a piece of shape "
                             f"{tuple(piece.shape)} has {piece.shape[op.dim]} there")
    return [piece.select(op.dim, op.index) for piece in pieces]


def _apply(op: AnyOp, pieces: list[torch.Tensor], facts: Facts, where: str) -> list[torch.Tensor]:
    if isinstance(op, Select):
        return _select(op, pieces, facts, where)
    if isinstance(op, Permute):
        return [piece.permute(*op.dims) for piece in pieces]
    if isinstance(op, Unflatten):
        sizes = [size_of(size, facts, where) for size in op.sizes]
        return [piece.unflatten(op.dim, sizes) for piece in pieces]
    if isinstance(op, Flatten):
        return [piece.flatten(op.start, op.end) for piece in pieces]
    if isinstance(op, Scale):
        return [piece * op.factor for piece in pieces]
    if isinstance(op, Rotary):
        head_dim = size_of(op.head_dim, facts, where)
        out = []
        for index, piece in enumerate(pieces):
            if op.pieces is not None and index not in op.pieces:
                out.append(piece)
                continue
            size = piece.shape[op.dim]
            if head_dim % 2 or size % head_dim:
                raise ValueError(f"{where}: rotary head_dim {head_dim} must be even and divide dim {op.dim} "
                                 f"(size {size}) of a piece of shape {tuple(piece.shape)}")
            out.append(piece.index_select(op.dim, _rotary_index(size, head_dim, op.source, op.target).to(piece.device)))
        return out
    if isinstance(op, Sum):
        shapes = {tuple(piece.shape) for piece in pieces}
        if len(shapes) != 1:
            raise ValueError(f"{where}: sum of pieces of different shapes {sorted(shapes)}")
        total = pieces[0]
        for piece in pieces[1:]:
            total = total + piece
        return [total]
    groups = size_of(op.groups, facts, where)
    for piece in pieces:
        if piece.shape[op.dim] % groups:
            raise ValueError(f"{where}: concat in {groups} groups, but a piece of shape {tuple(piece.shape)} has "
                             f"{piece.shape[op.dim]} along dim {op.dim}")
    chunks = [piece.chunk(groups, dim=op.dim) if groups > 1 else (piece,) for piece in pieces]
    return [torch.cat([chunk[g] for g in range(groups) for chunk in chunks], dim=op.dim)]


def candidate_tensor(ops: list[AnyOp], pieces: list[torch.Tensor], facts: Facts, where: str) -> torch.Tensor:
    """The candidate's tensor from the reference's pieces. Raises ValueError (a piece that does not fit an
    op: wrong size, wrong count) or KeyError (a fact the run does not state), both naming `where`."""
    for op in ops:
        pieces = _apply(op, pieces, facts, where)
    if len(pieces) != 1:
        raise ValueError(f"{where}: the transform leaves {len(pieces)} pieces; combine them (concat or sum) into one")
    return pieces[0]


def _stage_shapes(ops: list[AnyOp], shapes: list[tuple[int, ...]], facts: Facts, where: str) -> list[list[tuple[int, ...]]]:
    """The pieces' shapes before each op and after the last (run on shapes alone, no values)."""
    pieces = [torch.empty(shape, device="meta") for shape in shapes]
    stages = [[tuple(p.shape) for p in pieces]]
    for op in ops:
        pieces = _apply(op, pieces, facts, where)
        stages.append([tuple(p.shape) for p in pieces])
    return stages


def candidate_shape(ops: list[AnyOp], shapes: list[tuple[int, ...]], facts: Facts, where: str) -> tuple[int, ...]:
    final = _stage_shapes(ops, shapes, facts, where)[-1]
    if len(final) != 1:
        raise ValueError(f"{where}: the transform leaves {len(final)} pieces; combine them (concat or sum) into one")
    return final[0]


def _invert(op: AnyOp, pieces: list[torch.Tensor], before: list[tuple[int, ...]], facts: Facts,
            where: str) -> list[torch.Tensor]:
    """The pieces before `op` from those after it; `before`: their shapes before it."""
    if isinstance(op, Permute):
        order = [d % len(op.dims) for d in op.dims]
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return [piece.permute(*inverse) for piece in pieces]
    if isinstance(op, Unflatten):
        return [piece.reshape(shape) for piece, shape in zip(pieces, before)]
    if isinstance(op, Flatten):
        return [piece.reshape(shape) for piece, shape in zip(pieces, before)]
    if isinstance(op, Scale):
        return [piece / op.factor for piece in pieces]
    if isinstance(op, Rotary):
        return _apply(Rotary(dim=op.dim, head_dim=op.head_dim, source=op.target, target=op.source, pieces=op.pieces),
                      pieces, facts, where)
    assert isinstance(op, Concat), f"{type(op).__name__} has no inverse"  # decoding refuses others in parameter rules
    groups = size_of(op.groups, facts, where)
    (whole,) = pieces
    sizes = [shape[op.dim] // groups for shape in before]
    parts: list[list[torch.Tensor]] = [[] for _ in before]
    for group in whole.chunk(groups, dim=op.dim) if groups > 1 else (whole,):
        for index, part in enumerate(group.split(sizes, dim=op.dim)):
            parts[index].append(part)
    return [torch.cat(chunks, dim=op.dim) for chunks in parts]


def reference_pieces(ops: list[AnyOp], value: torch.Tensor, shapes: list[tuple[int, ...]], facts: Facts,
                     where: str) -> list[torch.Tensor]:
    """The reference's pieces (of `shapes`) whose transform is `value`: the inverse of `candidate_tensor`,
    for rules whose ops are all invertible. A transform that opens with a bound `select` gives the pieces'
    slices at its index instead (of `shapes` without its dim): the caller puts them in place."""
    stages = _stage_shapes(ops, shapes, facts, where)
    if stages[-1] != [tuple(value.shape)]:
        raise ValueError(f"{where}: a candidate tensor of shape {tuple(value.shape)}, but the reference's pieces "
                         f"{shapes} give {stages[-1]}")
    pieces = [value]
    for op, before in zip(reversed(ops), reversed(stages[:-1])):
        if isinstance(op, Select):  # first (check_map): what is left are the slices
            break
        pieces = _invert(op, pieces, before, facts, where)
    return [piece.contiguous() for piece in pieces]
