import pytest
import torch

from ttrace_core.canonicalize import placements as pl
from ttrace_core.canonicalize import shards as shards_module
from ttrace_core.canonicalize.shards import RecordedShard, canonicalize, shard
from ttrace_core.errors import LayoutError
from ttrace_core.format.schema import Layout

PLANNED = shards_module._planned

LAYOUTS = {
    "shard0-even": ((8, 4), (2,), ("S(0)",)),
    "shard1-uneven": ((3, 5), (2,), ("S(1)",)),
    "shard0-zero-size": ((3, 2), (4,), ("S(0)",)),
    "replicate": ((4, 3), (2,), ("R",)),
    "partial-sum": ((4, 3), (2,), ("P(sum)",)),
    "partial-avg": ((4, 3), (2,), ("P(avg)",)),
    "2d-shard-shard": ((6, 4), (2, 2), ("S(0)", "S(1)")),
    "2d-nested-uneven": ((7, 2), (2, 2), ("S(0)", "S(0)")),
    "2d-replicate-shard": ((4, 6), (2, 3), ("R", "S(1)")),
    "2d-shard-partial": ((4, 6), (2, 2), ("S(0)", "P(sum)")),
    "blocked-glu-rows": ((8, 3), (2,), ("SB(0,2)",)),
    "blocked-last-dim": ((2, 3, 12), (2,), ("SB(-1,2)",)),
    "2d-blocked-then-shard": ((8, 4), (2, 2), ("SB(0,2)", "S(1)")),
    "2d-fsdp-over-tp": ((8, 4), (2, 2), ("SS(0,2)", "S(0)")),
    "2d-fsdp-over-tp-uneven": ((7, 3), (2, 2), ("SS(0,2)", "S(0)")),
    "2d-fsdp-over-tp-zero-size": ((3, 2), (2, 2), ("SS(0,2)", "S(0)")),
    "strided-alone-uneven": ((5, 3), (2,), ("SS(0,2)",)),
    "2d-shard-then-strided": ((8, 2), (2, 2), ("S(0)", "SS(0,2)")),
    "2d-strided-both-dims": ((5, 4), (2, 2), ("SS(0,2)", "SS(1,2)")),
    "2d-strided-partial": ((4, 6), (2, 2), ("SS(1,3)", "P(sum)")),
    "2d-strided-then-blocked": ((3, 8), (2, 2), ("SS(0,2)", "SB(1,2)")),
}


def _shards_of(full: torch.Tensor, mesh_shape, placements) -> list[RecordedShard]:
    shards = []
    for rank, coordinate in enumerate(pl.all_coordinates(mesh_shape)):
        layout = Layout(global_shape=tuple(full.shape), mesh_shape=mesh_shape, coordinate=coordinate, placements=placements)
        shards.append(RecordedShard(rank=rank, layout=layout, value=shard(full, layout)))
    return shards


@pytest.mark.parametrize("name", sorted(LAYOUTS), ids=sorted(LAYOUTS))
def test_canonicalize_inverts_shard(name):
    shape, mesh_shape, placements = LAYOUTS[name]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    shards = _shards_of(full, mesh_shape, placements)
    result = canonicalize(shards)
    torch.testing.assert_close(result.full, full, rtol=0, atol=1e-6)
    assert result.replica_drift is None
    assert result.num_shards == len(shards)
    # shard(canonicalize(x)) round-trips each rank's local values
    for s in shards:
        torch.testing.assert_close(shard(result.full, s.layout), s.value, rtol=0, atol=1e-6)


def test_partial_shards_are_summed_not_concatenated():
    layout0 = Layout(global_shape=(2,), mesh_shape=(2,), coordinate=(0,), placements=("P(sum)",))
    layout1 = Layout(global_shape=(2,), mesh_shape=(2,), coordinate=(1,), placements=("P(sum)",))
    result = canonicalize([RecordedShard(0, layout0, torch.tensor([1.0, 2.0])), RecordedShard(1, layout1, torch.tensor([3.0, 5.0]))])
    assert result.full.tolist() == [4.0, 7.0]


def test_replicas_that_differ_are_reported_as_drift():
    layout = Layout(global_shape=(3,), mesh_shape=(2,), coordinate=(0,), placements=("R",))
    other = Layout(global_shape=(3,), mesh_shape=(2,), coordinate=(1,), placements=("R",))
    result = canonicalize([RecordedShard(0, layout, torch.tensor([1.0, 2.0, 2.0])),
                           RecordedShard(1, other, torch.tensor([1.0, 2.0, 3.0]))])
    assert result.full.tolist() == [1.0, 2.0, 2.0]
    assert result.replica_drift.ranks == (0, 1)
    assert result.replica_drift.max_abs_diff == 1.0
    assert result.replica_drift.relative_diff == pytest.approx(1.0 / 3.0)


def test_unannotated_replicas_on_an_empty_mesh_are_compared():
    layout = Layout.replicated((2,))
    result = canonicalize([RecordedShard(0, layout, torch.tensor([1.0, 1.0])), RecordedShard(1, layout, torch.tensor([1.0, 1.0]))])
    assert result.replica_drift is None and result.full.tolist() == [1.0, 1.0]


def test_missing_coordinate_names_the_tensor_and_ranks():
    layout = Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(0,), placements=("S(0)",))
    with pytest.raises(LayoutError, match=r"no rank holds mesh coordinate \(1,\).*ranks present: \[0\]"):
        canonicalize([RecordedShard(0, layout, torch.zeros(2))], key="w")


def test_local_shape_that_contradicts_the_layout_is_rejected():
    layout = Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(0,), placements=("S(0)",))
    with pytest.raises(LayoutError, match=r"rank 0 holds shape \(3,\) but placements \('S\(0\)',\).*imply \(2,\)"):
        canonicalize([RecordedShard(0, layout, torch.zeros(3))])


def test_ranks_that_disagree_on_the_layout_are_rejected():
    a = Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(0,), placements=("S(0)",))
    b = Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(1,), placements=("R",))
    with pytest.raises(LayoutError, match="disagree on the layout"):
        canonicalize([RecordedShard(0, a, torch.zeros(2)), RecordedShard(1, b, torch.zeros(4))])


def test_bf16_values_keep_their_dtype():
    full = torch.randn(4, 2).to(torch.bfloat16)
    result = canonicalize(_shards_of(full, (2,), ("S(0)",)))
    assert result.full.dtype == torch.bfloat16 and torch.equal(result.full, full)


def test_flat_ranges_of_sharded_blocks_are_assembled():
    """Distributed-optimizer grads: TP shards on S(0), each split into flat ranges over 2 DP ranks."""
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    shards, rank = [], 0
    for tp in range(2):
        for start, end in ((0, 4), (4, 6), (0, 0)):  # the last DP rank holds nothing of this block
            layout = Layout(global_shape=(4, 3), mesh_shape=(2,), coordinate=(tp,), placements=("S(0)",), flat_range=(start, end))
            shards.append(RecordedShard(rank, layout, shard(full, layout)))
            rank += 1
    result = canonicalize(shards)
    assert torch.equal(result.full, full) and result.replica_drift is None


def test_flat_ranges_that_leave_a_hole_are_rejected():
    layout = Layout(global_shape=(6,), flat_range=(0, 4))
    with pytest.raises(LayoutError, match="no rank holds flat element 4"):
        canonicalize([RecordedShard(0, layout, torch.zeros(4))])


ENORMOUS_LAYOUTS = {
    "Partial over 10**9 ranks": (Layout(global_shape=(2,), mesh_shape=(10**9,), coordinate=(0,), placements=("P(sum)",)),
                                 r"no rank holds mesh coordinate \(1,\) .*mesh \(1000000000,\)"),
    "a flat range in a block of 10**12": (Layout(global_shape=(10**12,), flat_range=(0, 2)),
                                          r"no rank holds flat element 2 of block \(\(0, 1000000000000\),\)"),
    "a flat range past its block": (Layout(global_shape=(2,), flat_range=(10**12 - 2, 10**12)),
                                    r"holds flat range \[999999999998, 1000000000000\) of block \(\(0, 2\),\), which has 2"),
}


@pytest.mark.parametrize("layout, message", list(ENORMOUS_LAYOUTS.values()), ids=list(ENORMOUS_LAYOUTS))
def test_metadata_claiming_enormous_sizes_is_refused_before_anything_is_allocated(layout, message):
    """Found from the metadata alone: a mesh is not enumerated and a block not allocated to see that
    two recorded elements cannot make up 10**9 coordinates or 10**12 elements."""
    with pytest.raises(LayoutError, match=message):
        canonicalize([RecordedShard(0, layout, torch.zeros(2))], key="w")


def test_a_split_factor_beyond_any_mesh_is_refused_before_its_pieces_are_walked():
    with pytest.raises(LayoutError, match=r"'SS\(0,1000000000000\)': a split factor above 1048576"):
        pl.local_shape(Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(0,), placements=(f"SS(0,{10**12})",)))


def test_a_tensor_larger_than_the_machine_is_refused_with_one_line(monkeypatch):
    from ttrace_core.canonicalize import shards

    monkeypatch.setattr(shards, "machine_memory_bytes", lambda: 15)
    halves = [RecordedShard(rank, Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(rank,), placements=("S(0)",)),
                            torch.zeros(2)) for rank in range(2)]
    with pytest.raises(LayoutError, match=r"w: assembling it takes 0.0 GiB, more than this machine's 0.0 GiB; compare it "
                                          r"with --max-memory"):
        canonicalize(halves, key="w")
    whole = canonicalize([RecordedShard(0, Layout.replicated((4,)), torch.zeros(4))], key="w")  # nothing to assemble
    assert whole.full.numel() == 4


def test_blocked_shard_holds_its_chunk_of_every_block():
    # SwiGLU fc1: rows [gate 0:4; up 4:8] over 2 TP ranks; rank 1 holds [gate 2:4; up 6:8].
    full = torch.arange(8.0).reshape(8, 1)
    layout = Layout(global_shape=(8, 1), mesh_shape=(2,), coordinate=(1,), placements=("SB(0,2)",))
    assert shard(full, layout).flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    assert pl.local_shape(layout) == (4, 1)
    with pytest.raises(LayoutError, match="SB"):
        pl.blocked_view(Layout(global_shape=(7, 1), mesh_shape=(2,), coordinate=(0,), placements=("SB(0,2)",)))


@pytest.mark.parametrize(
    "shape, placements, held_by_rank",
    [
        # FSDP2 over TP: rows cut for tp first, then for dp; rank = dp * 2 + tp
        ((8,), ("SS(0,2)", "S(0)"), [[0, 1], [4, 5], [2, 3], [6, 7]]),
        # uneven: dp=0 holds rows [0, 1, 4, 5] and dp=1 rows [2, 3, 6]; tp cuts those in torch.chunk order
        ((7,), ("SS(0,2)", "S(0)"), [[0, 1], [4, 5], [2, 3], [6]]),
        ((3,), ("SS(0,2)", "S(0)"), [[0], [2], [1], []]),
        ((8,), ("S(0)", "SS(0,2)"), [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ((5,), ("SS(0,2)", "R"), [[0, 1, 3], [0, 1, 3], [2, 4], [2, 4]]),
        # arange(8).view(4, 2): dp=0 holds rows 0 and 2, tp the column
        ((4, 2), ("SS(0,2)", "S(1)"), [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ],
    ids=["fsdp-over-tp", "fsdp-over-tp-uneven", "fsdp-over-tp-empty-rank", "shard-then-strided",
         "strided-replicated-uneven", "strided-rows-sharded-columns"],
)
def test_strided_shard_gives_every_rank_of_a_2x2_mesh_its_indices(shape, placements, held_by_rank):
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    shards = _shards_of(full, (2, 2), placements)
    assert [s.value.flatten().tolist() for s in shards] == [[float(i) for i in held] for held in held_by_rank]
    assert torch.equal(canonicalize(shards).full, full)


def test_strided_shards_of_the_wrong_size_are_rejected():
    layout = Layout(global_shape=(7,), mesh_shape=(2, 2), coordinate=(1, 1), placements=("SS(0,2)", "S(0)"))
    with pytest.raises(LayoutError, match=r"w: rank 3 holds shape \(2,\) but placements \('SS\(0,2\)', 'S\(0\)'\).*imply \(1,\)"):
        canonicalize([RecordedShard(3, layout, torch.zeros(2))], key="w")


@pytest.mark.parametrize("name", ["shard1-uneven", "2d-replicate-shard", "2d-shard-partial", "partial-avg"])
def test_a_set_of_layouts_is_planned_once_and_every_tensor_cut_that_way_assembles(name, monkeypatch):
    """Every layer's tensor of one kind is cut the same way: its placements are parsed and checked once
    (shards._assembly), and each tensor is still assembled from its own values."""
    shape, mesh_shape, placements = LAYOUTS[name]
    monkeypatch.setattr(shards_module, "_ASSEMBLIES", {})
    planned = []
    monkeypatch.setattr(shards_module, "_planned", lambda *args: planned.append(1) or PLANNED(*args))
    for seed in range(3):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(canonicalize(_shards_of(full, mesh_shape, placements)).full, full, rtol=0, atol=1e-6)
    assert len(planned) == 1


def test_a_plan_that_fails_is_not_kept_and_names_the_tensor_each_time():
    layout = Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(0,), placements=("S(0)",))
    for key in ("w1", "w2"):
        with pytest.raises(LayoutError, match=rf"^{key}: no rank holds mesh coordinate"):
            canonicalize([RecordedShard(0, layout, torch.zeros(2))], key=key)

