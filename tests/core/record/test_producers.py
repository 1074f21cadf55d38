"""The layout of a plain shard a module only passes on, read from its producer (record/producers.py):
view mapping as shape math, and what a Tracer records for modules between a declared shard and its
consumer (an activation, a per-head norm on a view). Declarations win; DTensors never reach it."""

import pytest
import torch
from torch import nn

from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import Layout
from ttrace_core.record.producers import dim_groups, layout_through_permutation, layout_through_view, memory_order
from ttrace_core.record.tracer import Tracer

MESH = ((2,), (1,), ("tp",))
"""Rank 1 of a 2-rank tensor-parallel mesh."""


def _layout(global_shape, *placements, mesh_shape=(2,)):
    return Layout(global_shape=tuple(global_shape), mesh_shape=mesh_shape, coordinate=(1,) * len(mesh_shape),
                  placements=tuple(placements), mesh_axis_names=("tp", "x")[:len(mesh_shape)])


@pytest.mark.parametrize(("source", "target", "expected"), [
    ((2, 32, 32), (2, 32, 2, 16), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
    ((2, 32, 16), (2, 32, 1, 16), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
    ((2, 32, 32), (64, 32), [([0, 1], [0]), ([2], [1])]),
    ((2, 32, 32), (2, 1024), [([0], [0]), ([1, 2], [1])]),
    ((6, 4), (4, 6), [([0, 1], [0, 1])]),
    ((2, 3), (7,), None),
    ((1, 1), (1,), None),
], ids=["split heads", "split into one head", "merge leading dims", "merge into the sharded dim",
        "regroup", "different numel", "all ones"])
def test_dim_groups(source, target, expected):
    assert dim_groups(source, target) == expected


@pytest.mark.parametrize(("layout", "source", "target", "expected"), [
    # q_proj colwise, 4 heads of 16: rank 1 holds heads 2:4.
    (_layout((2, 32, 64), "S(2)"), (2, 32, 32), (2, 32, 2, 16), ((2, 32, 4, 16), ("S(2)",))),
    # k_proj with 2 kv heads over 2 ranks: one whole head each, not half of a 32-wide one.
    (_layout((2, 32, 32), "S(2)"), (2, 32, 16), (2, 32, 1, 16), ((2, 32, 2, 16), ("S(2)",))),
    (_layout((2, 32, 2, 16), "S(2)"), (2, 32, 1, 16), (2, 32, 16), ((2, 32, 32), ("S(2)",))),
    (_layout((2, 32, 64), "S(2)"), (2, 32, 32), (2, 32, 8, 4), ((2, 32, 16, 4), ("S(2)",))),
    (_layout((2, 32, 64), "S(2)"), (2, 32, 32), (64, 32), ((64, 64), ("S(1)",))),
    (_layout((4, 32, 8), "S(0)"), (2, 32, 8), (64, 8), ((128, 8), ("S(0)",))),
    (_layout((2, 32, 64), "R"), (2, 32, 64), (64, 64), ((64, 64), ("R",))),
    (_layout((2, 32, 64), "P(sum)"), (2, 32, 64), (2, 32, 4, 16), ((2, 32, 4, 16), ("P(sum)",))),
    (_layout((2, 64), "SS(1,2)"), (2, 32), (2, 1, 32), ((2, 1, 64), ("SS(2,2)",))),
    (_layout((2, 32, 64), "S(2)"), (2, 32, 32), (2, 32, 32), ((2, 32, 64), ("S(2)",))),
    (_layout((2, 32, 64), "S(2)"), (2, 32, 32), (2, 1024), None),
    (_layout((2, 64), "SS(1,2)"), (2, 32), (2, 2, 16), None),
    (_layout((2, 31), "S(1)"), (2, 16), (2, 4, 4), None),
    (_layout((4, 64), "S(1)", "S(1)", mesh_shape=(2, 2)), (4, 16), (4, 2, 8), ((4, 8, 8), ("S(1)", "S(1)"))),
], ids=["heads", "one kv head per rank", "heads merged back", "finer split", "batch and sequence merged",
        "sharded leading dim merged", "replicated", "partial", "strided dim kept whole", "same shape",
        "sharded dim merged under an unsharded one", "strided dim split", "uneven cut", "two axes on one dim"])
def test_layout_through_view(layout, source, target, expected):
    mapped = layout_through_view(layout, source, target)
    assert (None if mapped is None else (mapped.global_shape, mapped.placements)) == expected


@pytest.mark.parametrize(("make", "order"), [
    (lambda: torch.zeros(2, 32, 4, 16), (0, 1, 2, 3)),
    (lambda: torch.zeros(2, 32, 4, 16).transpose(1, 2), (0, 2, 1, 3)),
    # one head per rank: contiguous to torch, but its head dim lies inside the sequence dim in memory
    (lambda: torch.zeros(2, 32, 16).view(2, 32, 1, 16).transpose(1, 2), (0, 2, 1, 3)),
    (lambda: torch.zeros(2, 1, 32, 16), (0, 1, 2, 3)),
    (lambda: torch.zeros(2, 32, 16).unsqueeze(1), (0, 1, 2, 3)),
    (lambda: torch.zeros(4, 6)[:, :3], None),
    (lambda: torch.zeros(4, 6).expand(2, 4, 6), None),
], ids=["contiguous", "transposed heads", "one head transposed", "size-1 dim in front", "unsqueezed", "sliced",
        "expanded"])
def test_memory_order(make, order):
    assert memory_order(make()) == order


def test_layout_through_permutation_moves_the_cut_with_its_dim():
    # [b, s, h, d] with heads cut, transposed to [b, h, s, d]: the heads stay cut, now dim 1
    moved = layout_through_permutation(_layout((2, 32, 4, 16), "S(2)"), (0, 2, 1, 3))
    assert (moved.global_shape, moved.placements) == ((2, 4, 32, 16), ("S(1)",))
    moved = layout_through_permutation(_layout((4, 64), "SS(1,2)", "P(sum)", mesh_shape=(2, 2)), (1, 0))
    assert (moved.global_shape, moved.placements) == ((64, 4), ("SS(0,2)", "P(sum)"))


class HeadNorm(nn.Module):
    """A per-head norm on a view of a colwise projection's output (Qwen3's q_norm)."""

    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.proj, self.norm, self.act, self.out = nn.Linear(8, width), nn.RMSNorm(head_dim), nn.GELU(), nn.Linear(width, 8)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.proj(x)
        heads = self.norm(projected.view(*x.shape[:-1], -1, self.head_dim))
        return self.out(self.act(heads.reshape(projected.shape)))


def _recorded(run_dir) -> dict[tuple[str, str], tuple]:
    with RunReader(run_dir) as reader:
        return {(k.fqn, k.slot): (m.layout.placements, m.layout.global_shape)
                for k, metas in reader.index.items() if k.step == 0 and k.phase in ("forward", "backward")
                for m in metas}


def _trace(run_dir, model, declare) -> dict[tuple[str, str], tuple]:
    tracer = Tracer(run_dir, model, role="candidate")
    declare(tracer)
    with tracer.step(0):
        model(torch.randn(3, 8)).sum().backward()
    tracer.close()
    return _recorded(run_dir)


def test_modules_that_pass_a_shard_on_take_its_producers_layout(tmp_path):
    """proj's output is declared S(1) (what a colwise style returns on rank 1 of 2): the norm on its view
    holds 1 of 2 heads, the activation the same shard, and their gradients follow."""
    torch.manual_seed(0)
    recorded = _trace(tmp_path / "run", HeadNorm(16, 8), lambda t: (t.declare("proj", "output.0", ["S(1)"], MESH),
                                                                    t.declare("out", "input.0", ["S(1)"], MESH)))
    assert recorded[("norm", "input.0")] == (("S(1)",), (3, 4, 8))
    assert recorded[("norm", "output.0")] == (("S(1)",), (3, 4, 8))
    assert recorded[("norm", "grad_output.0")] == (("S(1)",), (3, 4, 8))
    # the activation gets a view of the norm's output, merged back: the norm is its producer
    assert recorded[("act", "input.0")] == (("S(1)",), (3, 32))
    assert recorded[("act", "output.0")] == (("S(1)",), (3, 32))
    assert recorded[("act", "grad_input.0")] == (("S(1)",), (3, 32))
    assert recorded[("out", "output.0")] == ((), (3, 8))


class TransposedHeadNorm(nn.Module):
    """A per-head norm on the heads transposed in front of the sequence (Gemma 3's q_norm and k_norm)."""

    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.proj, self.norm, self.out = nn.Linear(8, width), nn.RMSNorm(head_dim), nn.Linear(width, 8)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.proj(x)
        heads = self.norm(projected.view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2))
        return self.out(heads.transpose(1, 2).reshape(projected.shape))


@pytest.mark.parametrize("local_heads", [2, 1])
def test_a_norm_on_transposed_heads_holds_its_ranks_heads(tmp_path, local_heads):
    """proj's local output [3, 5, 8 * local_heads] is S(2) of twice that: the norm's input, its heads transposed in
    front of the sequence, holds this rank's heads along dim 1, one head included (a view torch calls contiguous)."""
    torch.manual_seed(0)
    model = TransposedHeadNorm(8 * local_heads, 8)
    tracer = Tracer(tmp_path / "run", model, role="candidate")
    tracer.declare("proj", "output.0", ["S(2)"], MESH)
    tracer.declare("out", "input.0", ["S(2)"], MESH)
    with tracer.step(0):
        model(torch.randn(3, 5, 8)).sum().backward()
    tracer.close()
    recorded = _recorded(tmp_path / "run")
    for slot in ("input.0", "output.0", "grad_output.0", "grad_input.0"):
        assert recorded[("norm", slot)] == (("S(1)",), (3, 2 * local_heads, 5, 8)), slot
    with RunReader(tmp_path / "run") as reader:
        assert not reader.findings


def test_a_declaration_wins_over_the_producer(tmp_path):
    torch.manual_seed(0)
    recorded = _trace(tmp_path / "run", HeadNorm(16, 8), lambda t: (t.declare("proj", "output.0", ["S(1)"], MESH),
                                                                    t.declare("norm", "*", ["R"], MESH)))
    assert recorded[("norm", "input.0")] == (("R",), (3, 2, 8))
    assert recorded[("norm", "output.0")] == (("R",), (3, 2, 8))


def test_without_a_sharded_producer_nothing_changes(tmp_path):
    torch.manual_seed(0)
    recorded = _trace(tmp_path / "run", HeadNorm(16, 8), lambda t: None)
    assert {layout for layout in recorded.values()} == {((), shape) for _, shape in recorded.values()}


class Sliced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.act = nn.Linear(8, 16), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x)[:, 2:])


def test_a_part_of_a_shard_is_left_out_with_a_finding_naming_its_producer(tmp_path):
    torch.manual_seed(0)
    recorded = _trace(tmp_path / "run", Sliced(), lambda t: t.declare("proj", "output.0", ["S(1)"], MESH))
    assert ("act", "input.0") not in recorded
    with RunReader(tmp_path / "run") as reader:
        messages = [finding.message for finding in reader.findings]
    assert any(m.startswith("act input.0: not recorded, it is a view of shape [3, 14]") and "proj output.0" in m
               for m in messages), messages
