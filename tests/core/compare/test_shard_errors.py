"""compare/shard_errors.py: the error of each shard against that shard's values. The estimate's side measures
every equal partition of a tensor (`largest_block_error`), the compare side the candidate's own shards, read
from its recorded layouts (`candidate_shards`, `shard_error`, `worst_shard`).

tests/core/compare/test_structure.py checks the `shard` test end to end (one stale TP4 shard fires it, noise
stays under half) and one case of `largest_block_error`; here each function on small exact tables."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from ttrace_core.canonicalize.placements import coordinate_from_rank, local_shape
from ttrace_core.compare.shard_errors import candidate_shards, largest_block_error, shard_error, worst_shard
from ttrace_core.format.schema import Layout, TensorKey, TensorMeta

KEY = TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.mlp", slot="output.0")


def _f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("diff, expected, largest", [
    # 4 elements: halves [0, 0] / [0, 1] give sqrt(1/2), quarters give the last element alone: 1
    ([0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], 1.0),
    # 6 elements: halves only (4 and 8 do not divide 6)
    ([0.0, 0.0, 0.0, 0.0, 0.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], math.sqrt(9 / 3)),
    # 8 elements, error spread evenly: every block the same
    ([0.5] * 8, [2.0] * 8, 0.25),
    # the error where the reference is zero: those blocks are left out, the others hold no error
    ([1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0], 0.0),
], ids=["last-of-four", "six-halves-only", "even", "zero-reference-blocks-left-out"])
def test_the_largest_block_error_over_every_equal_partition(diff, expected, largest):
    assert largest_block_error(_f64(diff), _f64(expected)) == pytest.approx(largest)


def test_every_dim_is_partitioned_on_its_own():
    """[2, 8], one element off by 1: a block spans every other dim whole, so dim 0's halves are rows of 8 (1/8),
    dim 1's are 2 x 4, 2 x 2 and 2 x 1 columns (1/8, 1/4, 1/2): the largest is the last column, sqrt(1/2). The
    transposed tensor gives the same along its dim 0."""
    diff = torch.zeros(2, 8, dtype=torch.float64)
    diff[1, 7] = 1.0
    assert largest_block_error(diff, torch.ones(2, 8, dtype=torch.float64)) == pytest.approx(math.sqrt(1 / 2))
    assert largest_block_error(diff.T, torch.ones(8, 2, dtype=torch.float64)) == pytest.approx(math.sqrt(1 / 2))


@pytest.mark.parametrize("expected", [torch.ones((), dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
                                      torch.zeros(4, 4, dtype=torch.float64)],
                         ids=["scalar", "no-dim-divides", "zero-reference"])
def test_no_block_error_where_no_partition_cuts_the_tensor_or_the_reference_is_zero(expected):
    assert largest_block_error(torch.ones_like(expected), expected) is None


def _metas(shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[str, ...], *,
           local: tuple[int, ...] | None = None) -> list[TensorMeta]:
    """One rank per coordinate of `mesh` (row-major), each holding its part of `shape` under `placements`
    (`local`: the shape each rank recorded, for a layout that gives none)."""
    metas = []
    for rank in range(math.prod(mesh)):
        layout = Layout(global_shape=shape, mesh_shape=mesh, coordinate=coordinate_from_rank(rank, mesh),
                        placements=placements, mesh_axis_names=tuple(f"axis{i}" for i in range(len(mesh))))
        metas.append(TensorMeta(key=KEY, rank=rank, dtype="float32", local_shape=local or local_shape(layout),
                                layout=layout, seq=0))
    return metas


@pytest.mark.parametrize("shape, mesh, placements, shards", [
    ((8, 4), (2,), ("S(0)",), {(((0, 4), (0, 4)),): (0,), (((4, 4), (0, 4)),): (1,)}),
    ((8, 4), (2, 2), ("S(0)", "R"), {(((0, 4), (0, 4)),): (0, 1), (((4, 4), (0, 4)),): (2, 3)}),
    ((8, 4), (2, 2), ("S(0)", "S(1)"), {(((0, 4), (0, 2)),): (0,), (((0, 4), (2, 2)),): (1,),
                                        (((4, 4), (0, 2)),): (2,), (((4, 4), (2, 2)),): (3,)}),
    ((8, 4), (2,), ("SS(0,2)",), {(((0, 2), (0, 4)), ((4, 2), (0, 4))): (0,), (((2, 2), (0, 4)), ((6, 2), (0, 4))): (1,)}),
    ((5, 2), (4,), ("S(0)",), {(((0, 2), (0, 2)),): (0,), (((2, 2), (0, 2)),): (1,), (((4, 1), (0, 2)),): (2,)}),
], ids=["two-row-shards", "replicas-share-a-shard", "tp-by-columns", "strided-two-blocks-each", "empty-tail-left-out"])
def test_the_candidates_shards_and_the_ranks_holding_each(shape, mesh, placements, shards):
    assert candidate_shards(_metas(shape, mesh, placements)) == shards


def test_a_distributed_optimizers_flat_pieces_are_named_with_their_block_not_as_shards():
    """TP 2 x DP 2, each DP rank holding half of its TP block's flat elements: two shards, each held by its
    two DP ranks (a piece of any length has no tolerance of its own: see candidate_shards)."""
    metas = _metas((8, 4), (2, 2), ("S(0)", "R"))
    pieces = [msgspec.structs.replace(meta, layout=msgspec.structs.replace(
        meta.layout, flat_range=(0, 8) if meta.layout.coordinate[1] == 0 else (8, 16))) for meta in metas]
    assert candidate_shards(pieces) == {(((0, 4), (0, 4)),): (0, 1), (((4, 4), (0, 4)),): (2, 3)}


@pytest.mark.parametrize("metas", [
    _metas((8, 4), (2,), ("R",)), _metas((8, 4), (), ()), _metas((8, 4), (2,), ("P(sum)",)),
    _metas((8, 4), (2, 2), ("S(0)", "P(avg)")), _metas((1, 4), (2,), ("S(0)",)), _metas((8,), (2,), ("S(3)",), local=(4,)),
], ids=["replicated", "no-mesh", "partial", "sharded-and-partial", "one-shard-and-an-empty-one", "not-a-layout"])
def test_no_shards_for_one_shard_partial_values_or_a_layout_that_is_not_blocks(metas):
    assert candidate_shards(metas) == {}


def test_a_shards_error_sums_over_its_blocks_and_is_none_on_a_zero_reference():
    expected = torch.ones(8, 4, dtype=torch.float64)
    diff = torch.zeros(8, 4, dtype=torch.float64)
    diff[1, :] = 1.0  # row 1: in rank 0's first block under SS(0,2)
    strided_rank_0 = (((0, 2), (0, 4)), ((4, 2), (0, 4)))
    assert shard_error(diff, expected, strided_rank_0) == pytest.approx(math.sqrt(4 / 16))
    assert shard_error(diff, expected, (((2, 2), (0, 4)), ((6, 2), (0, 4)))) == 0.0
    assert shard_error(diff, torch.zeros(8, 4, dtype=torch.float64), strided_rank_0) is None


def test_the_worst_shard_its_ranks_and_the_worst_of_the_others():
    """Four row blocks of [8, 1] held by TP ranks 0..3 (DP replicas 4..7): errors 0, 0.5, 0.25 and 0 of each block."""
    shards = candidate_shards(_metas((8, 1), (2, 4), ("R", "S(0)")))
    assert sorted(shards.values()) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    expected = torch.ones(8, 1, dtype=torch.float64)
    diff = _f64([[0.0], [0.0], [0.5], [0.5], [0.25], [0.25], [0.0], [0.0]])
    assert worst_shard(diff, expected, shards) == (pytest.approx(0.5), (1, 5), pytest.approx(0.25))


def test_no_worst_shard_without_two_shards_to_set_apart():
    """Only one shard has a nonzero reference: there are no others to measure it against."""
    shards = {(((0, 2),),): (0,), (((2, 2),),): (1,)}
    assert worst_shard(_f64([1.0, 1.0, 0.0, 0.0]), _f64([1.0, 1.0, 0.0, 0.0]), shards) is None
    assert worst_shard(_f64([1.0, 1.0, 0.0, 0.0]), _f64([1.0, 1.0, 1.0, 1.0]), {(((0, 4),),): (0, 1)}) is None
