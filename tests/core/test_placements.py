import pytest

from ttrace_core import placements as pl
from ttrace_core.errors import LayoutError
from ttrace_core.schema import Layout


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


@pytest.mark.parametrize("text", ["R", "S(0)", "S(-1)", "P(sum)", "P(avg)", "SS(0,2)"])
def test_placement_round_trip(text):
    assert str(pl.placement_from_str(text)) == text


def test_unknown_placement_is_rejected_by_name():
    with pytest.raises(LayoutError, match="unknown placement 'X'"):
        pl.placement_from_str("X")


def test_strided_shard_is_rejected_with_its_name():
    layout = Layout(global_shape=(4, 4), mesh_shape=(2, 2), coordinate=(0, 0), placements=("SS(0,2)", "S(0)"),
                    mesh_axis_names=("dp", "tp"))
    with pytest.raises(LayoutError, match=r"_StridedShard\(dim=0, split_factor=2\) on mesh axis 'dp'"):
        pl.local_region(layout)


def test_global_shape_from_local_and_coordinates():
    assert pl.global_shape_from_local((2, 8, 4), (2,), ("S(1)",)) == (2, 16, 4)
    assert pl.global_shape_from_local((2, 8, 4), (2, 2), ("R", "S(-1)")) == (2, 8, 8)
    assert pl.coordinate_from_rank(5, (2, 3)) == (1, 2)
    assert pl.all_coordinates((2, 2)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
