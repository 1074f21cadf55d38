"""Functions test_strided_shard.py runs on 4 spawned gloo ranks, a (dp=2, tp=2) mesh. A failed assertion fails the rank."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from ttrace_core.canonicalize.shards import RecordedShard, canonicalize, shard
from ttrace_core.integrations.dtensor import layout_from_dtensor, local_value, placement_str

FSDP_OVER_TP_PLACEMENTS = {
    # ColwiseParallel shards dim 0 over tp, so FSDP2's dp shard of dim 0 is strided by the 2 tp shards.
    "0.weight": ("SS(0,2)", "S(0)"),
    "0.bias": ("SS(0,2)", "S(0)"),
    # RowwiseParallel shards dim 1 (weight) or nothing (bias): FSDP2's dim-0 shard is a plain S(0).
    "2.weight": ("S(0)", "S(1)"),
    "2.bias": ("S(0)", "R"),
}
"""Placements torch 2.13 gives each parameter (and its gradient) of the model below."""

STRIDED_CASES = [
    # (name, placements, global shape, scatter from rank 0, full_tensor() exact). torch's
    # distribute_tensor can only scatter even _StridedShard splits; uneven ones are split locally
    # (src_data_rank=None). torch 2.13's full_tensor() puts padding zeros into an uneven
    # _StridedShard whose split factor differs from the size of the axis that shards after it
    # (FSDP2 never makes one): there only the source tensor is the reference.
    ("fsdp-over-tp-even", [_StridedShard(0, split_factor=2), Shard(0)], (8, 3), True, True),
    ("fsdp-over-tp-uneven", [_StridedShard(0, split_factor=2), Shard(0)], (7, 3), False, True),
    ("shard-then-strided", [Shard(0), _StridedShard(0, split_factor=2)], (8, 2), True, True),
    ("fsdp-over-tp-dim-1-uneven", [_StridedShard(1, split_factor=2), Shard(1)], (2, 9), False, True),
    ("strided-replicate-uneven", [_StridedShard(0, split_factor=2), Replicate()], (5, 2), False, True),
    ("split-factor-3-uneven", [_StridedShard(0, split_factor=3), Shard(0)], (7, 2), False, False),
]


def _canonical_full(name: str, value: DTensor) -> torch.Tensor:
    """canonicalize() over every rank's local shard; checks that shard() of it gives back this rank's local tensor."""
    layout, local = layout_from_dtensor(value), local_value(value)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), layout, local))
    result = canonicalize([RecordedShard(rank=r, layout=l, value=v) for r, l, v in gathered], key=name)
    assert result.replica_drift is None, f"{name}: unexpected drift {result.replica_drift}"
    assert torch.equal(shard(result.full, layout), local), f"{name}: shard() differs from rank {dist.get_rank()}'s local tensor"
    return result.full


def _check_distributed_strided_tensors(mesh: DeviceMesh) -> None:
    for name, placements, shape, scatter, full_tensor_exact in STRIDED_CASES:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        value = distribute_tensor(full, mesh, placements, src_data_rank=0 if scatter else None)
        canonical = _canonical_full(name, value)
        assert torch.equal(canonical, full), f"{name}: canonicalize != the distributed tensor"
        if full_tensor_exact:
            assert torch.equal(canonical, value.full_tensor()), f"{name}: canonicalize != full_tensor()"


def _check_fsdp_over_tp_model(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    # 6 hidden rows: 3 per tp rank, which FSDP2 cuts 2 + 1 over dp (an uneven strided shard).
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    inputs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(dp)) for dp in range(2)]
    model(inputs[mesh.get_local_rank("dp")]).square().sum().backward()
    # FSDP2 averages gradients over dp.
    (sum(reference(x).square().sum() for x in inputs) / 2).backward()
    assert sorted(name for name, _ in model.named_parameters()) == sorted(FSDP_OVER_TP_PLACEMENTS)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and isinstance(param.grad, DTensor), f"{name}: not a DTensor"
        assert tuple(placement_str(p) for p in param.placements) == FSDP_OVER_TP_PLACEMENTS[name], f"{name}: {param.placements}"
        assert param.grad.placements == param.placements, f"{name}: grad {param.grad.placements} != {param.placements}"
        expected = reference.get_parameter(name)
        canonical_param, canonical_grad = _canonical_full(f"{name} param", param), _canonical_full(f"{name} grad", param.grad)
        assert torch.equal(canonical_param, param.full_tensor()), f"{name}: canonicalize != full_tensor()"
        assert torch.equal(canonical_grad, param.grad.full_tensor()), f"{name} grad: canonicalize != full_tensor()"
        assert torch.equal(canonical_param, expected.detach()), f"{name}: not the single-device init"
        torch.testing.assert_close(canonical_grad, expected.grad, msg=lambda text: f"{name} grad vs single device: {text}")
    strided = [name for name, param in model.named_parameters() if isinstance(param.placements[0], _StridedShard)]
    assert strided == ["0.weight", "0.bias"], f"the case under test is not exercised: strided params {strided}"


def check_strided_shard(config: dict) -> None:
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _check_distributed_strided_tensors(mesh)
        _check_fsdp_over_tp_model(mesh)
    finally:
        dist.destroy_process_group()
