import torch

from ttrace_core.record.generator import local_from_full, normal_full, seed_from_name, tokens_full
from ttrace_core.format.schema import Layout


def test_values_depend_only_on_seed_and_name():
    torch.manual_seed(123)  # the global RNG does not matter
    a = normal_full(0, "layers.0.attn.wq.weight", (4, 3))
    torch.manual_seed(456)
    b = normal_full(0, "layers.0.attn.wq.weight", (4, 3))
    assert torch.equal(a, b)
    assert not torch.equal(a, normal_full(0, "layers.0.attn.wk.weight", (4, 3)))
    assert not torch.equal(a, normal_full(1, "layers.0.attn.wq.weight", (4, 3)))
    assert seed_from_name(0, "x") == seed_from_name(0, "x") != seed_from_name(0, "y")
    assert torch.equal(tokens_full(0, "batch.3", (2, 5), 10), tokens_full(0, "batch.3", (2, 5), 10))


def test_each_rank_gets_its_slice_of_the_logical_tensor():
    full = normal_full(0, "w", (6, 2))
    layout = Layout(global_shape=(6, 2), mesh_shape=(2,), coordinate=(1,), placements=("S(0)",))
    assert torch.equal(local_from_full(full, layout), full[3:6])
    assert torch.equal(local_from_full(full, None), full)
