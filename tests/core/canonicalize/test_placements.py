import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from ttrace_core.canonicalize import placements as pl
from ttrace_core.errors import LayoutError
from ttrace_core.format.schema import Layout


@pytest.mark.parametrize(
    "size, num_chunks, index, expected",
    [
        (8, 4, 2, (4, 2)),  # the docstring example: rank 2 of 4 holds rows 4:6
        (5, 2, 0, (0, 3)),
        (5, 2, 1, (3, 2)),
        (5, 4, 3, (5, 0)),  # torch.chunk leaves the last rank empty
        (1, 2, 1, (1, 0)),
        (0, 2, 0, (0, 0)),
    ],
    ids=["even", "uneven-first", "uneven-last", "zero-size", "one-row", "empty-dim"],
)
def test_chunk_bounds(size, num_chunks, index, expected):
    assert pl.chunk_bounds(size, num_chunks, index) == expected


@pytest.mark.parametrize(
    "layout, region",
    [
        (Layout(global_shape=(8, 3), mesh_shape=(4,), coordinate=(2,), placements=("S(0)",)), ((4, 2), (0, 3))),
        (Layout(global_shape=(8, 6), mesh_shape=(2, 2), coordinate=(1, 0), placements=("S(0)", "S(0)")), ((4, 2), (0, 6))),
        (Layout(global_shape=(8, 6), mesh_shape=(2, 3), coordinate=(1, 2), placements=("S(0)", "S(1)")), ((4, 4), (4, 2))),
        (Layout(global_shape=(8, 6), mesh_shape=(2, 3), coordinate=(1, 2), placements=("R", "S(-1)")), ((0, 8), (4, 2))),
        (Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(1,), placements=("P(sum)",)), ((0, 4),)),
        (Layout(global_shape=(3, 2), mesh_shape=(4,), coordinate=(3,), placements=("S(0)",)), ((3, 0), (0, 2))),
    ],
    ids=["1d-shard", "nested-same-dim", "2d-two-dims", "replicate-and-negative-dim", "partial", "zero-size"],
)
def test_local_region(layout, region):
    assert pl.local_region(layout) == region


@pytest.mark.parametrize("text", ["R", "S(0)", "S(-1)", "P(sum)", "P(avg)", "SS(0,2)", "SB(0,2)"])
def test_placement_round_trip(text):
    assert str(pl.placement_from_str(text)) == text


def test_unknown_placement_is_rejected_by_name():
    with pytest.raises(LayoutError, match="unknown placement 'X'"):
        pl.placement_from_str("X")


def _strided(shape, mesh_shape, coordinate, placements):
    return Layout(global_shape=shape, mesh_shape=mesh_shape, coordinate=coordinate, placements=placements)


FSDP_OVER_TP = ("SS(0,2)", "S(0)")


@pytest.mark.parametrize(
    "layout, runs",
    [
        # the docstring example: FSDP2 over TP on (dp=2, tp=2), rows cut for tp first, then for dp
        (_strided((8, 4), (2, 2), (0, 0), FSDP_OVER_TP), (((0, 2),), ((0, 4),))),
        (_strided((8, 4), (2, 2), (0, 1), FSDP_OVER_TP), (((4, 2),), ((0, 4),))),
        (_strided((8, 4), (2, 2), (1, 0), FSDP_OVER_TP), (((2, 2),), ((0, 4),))),
        (_strided((8, 4), (2, 2), (1, 1), FSDP_OVER_TP), (((6, 2),), ((0, 4),))),
        # SS alone leaves its chunk of every piece: dp=1 holds rows [2:4, 6:8]
        (_strided((8,), (2,), (1,), ("SS(0,2)",)), (((2, 2), (6, 2)),)),
        # uneven, docstring: pieces 0:3 and 3:5, each chunked in torch.chunk order
        (_strided((5,), (2,), (0,), ("SS(0,2)",)), (((0, 2), (3, 1)),)),
        (_strided((5,), (2,), (1,), ("SS(0,2)",)), (((2, 1), (4, 1)),)),
        # torch's _to_replicate_tensor example: 9 elements, split_factor 2, 4 chunks
        (_strided((9,), (4,), (0,), ("SS(0,2)",)), (((0, 2), (5, 1)),)),
        (_strided((9,), (4,), (2,), ("SS(0,2)",)), (((4, 1), (7, 1)),)),
        (_strided((9,), (4,), (3,), ("SS(0,2)",)), (((8, 1),),)),
        # S then SS on the same dim (torch's compute_local_shape_and_global_offset comment)
        (_strided((8,), (2, 2), (0, 0), ("S(0)", "SS(0,2)")), (((0, 1), (2, 1)),)),
        (_strided((8,), (2, 2), (1, 1), ("S(0)", "SS(0,2)")), (((5, 1), (7, 1)),)),
        # uneven FSDP over TP: dp=1 holds rows [2:3, 5:6] of 6, tp=1 the second of those
        (_strided((6, 2), (2, 2), (1, 1), FSDP_OVER_TP), (((5, 1),), ((0, 2),))),
        (_strided((2, 6), (2, 2), (1, 0), ("SS(1,2)", "S(1)")), (((0, 2),), ((2, 1),))),
        (_strided((4, 6), (2, 3), (1, 1), ("SS(1,3)", "S(0)")), (((2, 2),), ((1, 1), (3, 1), (5, 1)))),
        # every chunk empty: one run of length 0 where the shard would start
        (_strided((3,), (4,), (3,), ("SS(0,2)",)), (((2, 0),),)),
    ],
    ids=["fsdp-tp-0-0", "fsdp-tp-0-1", "fsdp-tp-1-0", "fsdp-tp-1-1", "strided-alone", "uneven-rank-0",
         "uneven-rank-1", "torch-example-rank-0", "torch-example-rank-2", "torch-example-empty-first-piece",
         "shard-then-strided-0-0", "shard-then-strided-1-1", "fsdp-tp-uneven", "fsdp-tp-dim-1",
         "split-factor-3-other-dim", "all-chunks-empty"],
)
def test_strided_shard_local_runs(layout, runs):
    assert pl.local_runs(layout) == runs
    assert pl.local_shape(layout) == tuple(sum(length for _, length in dim_runs) for dim_runs in runs)


def _torch_indices(size: int, mesh_shape, placements, coordinate) -> list[int]:
    """Global indices a coordinate holds, by torch's own _split_tensor applied left to right to an arange."""
    indices = torch.arange(size)
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            shards, _ = placement._split_tensor(indices, mesh_shape[axis], with_padding=False, contiguous=True)
            indices = shards[coordinate[axis]]
    return indices.tolist()


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2), (2, 3), (4, 2)], ids=["2", "3", "2x2", "2x3", "4x2"])
def test_strided_runs_equal_torch_split_tensor_for_every_size(mesh_shape):
    """Sizes 0..13, every mix of S(0), R and SS(0,f): uneven and empty chunks are mapped as torch maps them."""
    choices = {"S(0)": Shard(0), "R": Replicate(), "SS(0,2)": _StridedShard(0, split_factor=2),
               "SS(0,3)": _StridedShard(0, split_factor=3)}
    for size in range(14):
        for placements in itertools.product(choices, repeat=len(mesh_shape)):
            for coordinate in pl.all_coordinates(mesh_shape):
                layout = Layout(global_shape=(size,), mesh_shape=mesh_shape, coordinate=coordinate, placements=placements)
                held = [start + i for start, length in pl.local_runs(layout)[0] for i in range(length)]
                expected = _torch_indices(size, mesh_shape, [choices[p] for p in placements], coordinate)
                assert held == expected, f"size {size}, {placements} at {coordinate}"


def test_local_region_of_separate_ranges_says_so():
    layout = Layout(global_shape=(5, 3), mesh_shape=(2,), coordinate=(0,), placements=("SS(0,2)",))
    with pytest.raises(LayoutError, match=r"2 separate ranges \[\(0, 2\), \(3, 1\)\] along dim 0 of global shape \(5, 3\)"):
        pl.local_region(layout)
    assert pl.local_region(_strided((8, 4), (2, 2), (1, 0), FSDP_OVER_TP)) == ((2, 2), (0, 4))


def test_local_blocks_pair_global_and_local_regions():
    layout = Layout(global_shape=(5, 4), mesh_shape=(2, 2), coordinate=(0, 1), placements=("SS(0,2)", "SS(1,2)"))
    # rows [0:2, 3:4]; columns: pieces 0:2 and 2:4, chunk 1 of each is column 1 and column 3
    assert pl.local_blocks(layout) == [
        (((0, 2), (1, 1)), ((0, 2), (0, 1))), (((0, 2), (3, 1)), ((0, 2), (1, 1))),
        (((3, 1), (1, 1)), ((2, 1), (0, 1))), (((3, 1), (3, 1)), ((2, 1), (1, 1))),
    ]


def test_strided_shard_on_a_blocked_dim_is_rejected():
    layout = Layout(global_shape=(8, 2), mesh_shape=(2, 2), coordinate=(0, 0), placements=("SS(0,2)", "SB(0,2)"))
    with pytest.raises(LayoutError, match="SS and SB on the same dim 0"):
        pl.local_shape(layout)


def test_global_shape_from_local_and_coordinates():
    assert pl.global_shape_from_local((2, 8, 4), (2,), ("S(1)",)) == (2, 16, 4)
    assert pl.global_shape_from_local((2, 8, 4), (2, 2), ("R", "S(-1)")) == (2, 8, 8)
    assert pl.global_shape_from_local((2, 4), (2, 2), ("SS(0,2)", "S(0)")) == (8, 4)
    assert pl.coordinate_from_rank(5, (2, 3)) == (1, 2)
    assert pl.all_coordinates((2, 2)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _layout(global_shape, mesh_shape, coordinate, placements, names):
    return Layout(global_shape=global_shape, mesh_shape=mesh_shape, coordinate=coordinate, placements=placements,
                  mesh_axis_names=names)


@pytest.mark.parametrize("layout, local_shape, expected", [
    (_layout((8, 16), (2, 2), (1, 0), ("S(0)", "S(1)"), ("dp_shard", "tp")), (4, 8),
     _layout((4, 16), (2,), (0,), ("S(1)",), ("tp",))),
    (_layout((8, 16), (2,), (1,), ("S(0)",), ("dp",)), (4, 16), Layout(global_shape=(4, 16))),
    (_layout((8, 16), (2, 2), (0, 1), ("S(0)", "S(0)"), ("fsdp", "tp")), (2, 16),
     _layout((4, 16), (2,), (1,), ("S(0)",), ("tp",))),
    (_layout((8, 16), (2, 2), (1, 1), ("R", "P(sum)"), ("dp_replicate", "tp")), (8, 16),
     _layout((8, 16), (2,), (1,), ("P(sum)",), ("tp",))),
    (_layout((8, 16), (2,), (1,), ("S(0)",), ("tp",)), (4, 16), _layout((8, 16), (2,), (1,), ("S(0)",), ("tp",))),
    (_layout((8, 16), (2,), (1,), ("SS(0,2)",), ("dp",)), (4, 16), _layout((8, 16), (2,), (1,), ("SS(0,2)",), ("dp",))),
], ids=["dp batch, tp hidden", "dp alone", "dp and tp on one dim", "replicate over dp", "no dp axis", "strided kept"])
def test_without_mesh_axes_is_this_ranks_own_micro_batch(layout, local_shape, expected):
    from ttrace_core.format.naming import DATA_PARALLEL_AXES

    assert pl.without_mesh_axes(layout, DATA_PARALLEL_AXES, local_shape) == expected
