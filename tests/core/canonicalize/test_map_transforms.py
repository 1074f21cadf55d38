"""The correspondence map's tensor transforms (canonicalize/map_transforms.py) on small tensors, exact values:
megatron's fused QKV interleaved per query group, the SwiGLU [gate; up] fusion, the rotary layouts, one expert
of HF's fused 3-D expert parameters, and every invertible transform recovered by its inverse (the weight
conversion)."""

import pytest
import torch

from ttrace_core.canonicalize import map_transforms as mt


def rows(*labels: int) -> torch.Tensor:
    """A [n, 2] tensor whose row i is (label, label): a row's provenance stays readable after any reordering."""
    return torch.tensor([[label, label] for label in labels], dtype=torch.float64)


# q_proj rows 0..3 (4 heads, head_dim 1), k_proj rows 10, 11 and v_proj rows 20, 21 (2 groups).
Q, K, V = rows(0, 1, 2, 3), rows(10, 11), rows(20, 21)


@pytest.mark.parametrize(("groups", "expected"), [
    (1, [0, 1, 2, 3, 10, 11, 20, 21]),
    (2, [0, 1, 10, 20, 2, 3, 11, 21]),  # megatron: [q_g; k_g; v_g] per query group g
], ids=["one-group-is-plain-concat", "two-groups-interleaved"])
def test_fused_qkv_is_interleaved_per_query_group(groups, expected):
    fused = mt.candidate_tensor([mt.Concat(dim=0, groups=groups)], [Q, K, V], {}, "qkv")
    assert fused[:, 0].tolist() == expected


def test_group_count_can_name_a_fact():
    fused = mt.candidate_tensor([mt.Concat(dim=0, groups="groups")], [Q, K, V], {"groups": 2}, "qkv")
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    with pytest.raises(KeyError, match="qkv: names fact 'groups'"):
        mt.candidate_tensor([mt.Concat(dim=0, groups="groups")], [Q, K, V], {}, "qkv")


def test_swiglu_fc1_is_gate_then_up():
    gate, up = rows(1, 2, 3), rows(7, 8, 9)
    assert mt.candidate_tensor([mt.Concat(dim=0)], [gate, up], {}, "fc1")[:, 0].tolist() == [1, 2, 3, 7, 8, 9]


def test_activations_concat_along_the_last_dim_after_permute():
    """q/k/v outputs [batch, seq, features] become megatron's linear_qkv output [seq, batch, fused features]."""
    q, k, v = (torch.arange(n, dtype=torch.float64).expand(2, 3, n) + offset for n, offset in ((4, 0), (2, 10), (2, 20)))
    fused = mt.candidate_tensor([mt.Permute(dims=[1, 0, 2]), mt.Concat(dim=-1, groups=2)], [q, k, v], {}, "qkv out")
    assert fused.shape == (3, 2, 8)
    assert fused[0, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


@pytest.mark.parametrize(("source", "target", "expected"), [
    ("half-split", "interleaved", [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]),
    ("interleaved", "half-split", [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]),
    ("half-split", "half-split", list(range(12))),
], ids=["half-to-interleaved", "interleaved-to-half", "same"])
def test_rotary_layouts_permute_within_each_head(source, target, expected):
    """Two heads of head_dim 6 along dim 0: head 0's half-split [x0 x1 x2 | y0 y1 y2] is interleaved
    [x0 y0 x1 y1 x2 y2], and head 1 moves within rows 6..11."""
    moved = mt.candidate_tensor([mt.Rotary(dim=0, head_dim=6, source=source, target=target)], [rows(*range(12))], {}, "q")
    assert moved[:, 0].tolist() == expected


def test_sum_adds_the_gradients_a_fused_input_receives():
    total = mt.candidate_tensor([mt.Sum()], [rows(1, 2), rows(10, 20), rows(100, 200)], {}, "grad_input")
    assert total[:, 0].tolist() == [111, 222]


@pytest.mark.parametrize(("ops", "shapes"), [
    ([mt.Concat(dim=0, groups=2)], [(4, 3), (2, 3), (2, 3)]),
    ([mt.Concat(dim=0)], [(5, 3), (5, 3)]),
    ([mt.Permute(dims=[1, 0, 2]), mt.Unflatten(dim=-1, sizes=[2, -1])], [(2, 3, 8)]),
    ([mt.Flatten(start=0, end=1), mt.Scale(factor=0.5)], [(2, 3, 4)]),
    ([mt.Rotary(dim=0, head_dim=4, source="half-split", target="interleaved"), mt.Concat(dim=0, groups=2)],
     [(8, 3), (8, 3)]),
], ids=["qkv-groups", "gate-up", "permute-unflatten", "flatten-scale", "rotary-then-concat"])
def test_reference_pieces_invert_the_transform(ops, shapes):
    pieces = [torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i, shape in enumerate(shapes)]
    fused = mt.candidate_tensor(ops, pieces, {}, "rule")
    back = mt.reference_pieces(ops, fused, shapes, {}, "rule")
    assert [tuple(p.shape) for p in back] == shapes
    for original, recovered in zip(pieces, back):
        assert torch.equal(original, recovered)


def test_select_takes_one_expert_of_a_fused_parameter():
    """HF's gate_up_proj [experts, 2 x intermediate, hidden]: expert e's [gate; up] is index e along dim 0; the
    rule's placeholder takes each index below the count, and the inverse is that slice, for the caller to place."""
    fused = torch.arange(3 * 4 * 2, dtype=torch.float64).reshape(3, 4, 2)  # 3 experts of [4, 2]
    ops = [mt.Select(dim=0, index="expert", count="experts"), mt.Flatten(start=0, end=1)]
    facts = {"experts": 3}
    bindings = mt.select_bindings(ops, facts, "fc1")
    assert bindings == [{"expert": "0"}, {"expert": "1"}, {"expert": "2"}]
    bound = mt.bind(ops, bindings[2])
    assert bound[0] == mt.Select(dim=0, index=2, count="experts") and bound[1:] == ops[1:]
    expert = mt.candidate_tensor(bound, [fused], facts, "fc1")
    assert expert.tolist() == list(range(16, 24))
    (back,) = mt.reference_pieces(bound, expert, [(3, 4, 2)], facts, "fc1")
    assert torch.equal(back, fused[2])
    assert mt.select_bindings([mt.Flatten(start=0, end=1)], facts, "fc1") == [{}]


def test_a_select_that_is_unbound_or_out_of_range_is_named():
    fused = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="fc1: select's index 'expert' is not bound"):
        mt.candidate_tensor([mt.Select(dim=0, index="expert", count=3)], [fused], {}, "fc1")
    with pytest.raises(ValueError, match=r"fc1: select index 1 of 2 along dim 0, but a piece of shape \(3, 4\) has 3"):
        mt.candidate_tensor([mt.Select(dim=0, index=1, count=2)], [fused], {}, "fc1")
    with pytest.raises(KeyError, match="names fact 'experts'"):
        mt.select_bindings([mt.Select(dim=0, index="expert", count="experts")], {}, "fc1")


def test_a_piece_that_does_not_fit_is_named():
    with pytest.raises(ValueError, match=r"qkv: concat in 3 groups, but a piece of shape \(4, 2\)"):
        mt.candidate_tensor([mt.Concat(dim=0, groups=3)], [Q, K, V], {}, "qkv")
    with pytest.raises(ValueError, match="the transform leaves 3 pieces"):
        mt.candidate_tensor([mt.Permute(dims=[1, 0])], [Q, K, V], {}, "qkv")
    with pytest.raises(ValueError, match=r"a candidate tensor of shape \(7, 2\)"):
        mt.reference_pieces([mt.Concat(dim=0, groups=2)], rows(*range(7)), [(4, 2), (2, 2), (2, 2)], {}, "qkv")


def test_only_sum_cannot_be_inverted():
    assert [op for op in (mt.Permute(dims=[0]), mt.Unflatten(dim=0, sizes=[1]), mt.Flatten(start=0, end=0), mt.Concat(dim=0),
                          mt.Sum(), mt.Scale(factor=2.0), mt.Rotary(dim=0, head_dim=2, source="half-split", target="interleaved"),
                          mt.Select(dim=0, index=0, count=1))
            if not op.invertible] == [mt.Sum()]
