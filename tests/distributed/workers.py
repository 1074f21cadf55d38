"""Functions the distributed tests run on every spawned gloo rank. A failed assertion fails the rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ttrace_core.canonicalize import RecordedShard, canonicalize, shard
from ttrace_core.integrations.dtensor import layout_from_dtensor, local_value


def _cases(world_size: int):
    """(name, mesh shape, placements, global shape); Partial cases are built from random local values."""
    if world_size == 2:
        return [
            ("shard0-even", (2,), [Shard(0)], (4, 3)),
            ("shard1-uneven", (2,), [Shard(1)], (3, 5)),
            ("shard0-zero-size", (2,), [Shard(0)], (1, 4)),
            ("replicate", (2,), [Replicate()], (2, 3)),
            ("partial", (2,), [Partial()], (2, 3)),
        ]
    return [
        ("2d-shard-shard", (2, 2), [Shard(0), Shard(1)], (4, 6)),
        ("2d-nested-uneven", (2, 2), [Shard(0), Shard(0)], (7, 2)),
        ("2d-zero-size", (2, 2), [Shard(0), Shard(0)], (3, 2)),
        ("2d-replicate-shard", (2, 2), [Replicate(), Shard(1)], (3, 5)),
        ("2d-shard-partial", (2, 2), [Shard(0), Partial()], (4, 3)),
    ]


def _dtensor(mesh, placements, shape) -> DTensor:
    full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    if any(p.is_partial() for p in placements):
        replicated = [Replicate() if p.is_partial() else p for p in placements]
        local = distribute_tensor(full, mesh, replicated).to_local()
        noise = torch.randn(local.shape, generator=torch.Generator().manual_seed(dist.get_rank()))
        return DTensor.from_local(local + noise, mesh, placements, run_check=False)
    return distribute_tensor(full, mesh, placements)


def check_dtensor_canonicalize(config: dict) -> None:
    dist.init_process_group("gloo")
    try:
        world_size = dist.get_world_size()
        for name, mesh_shape, placements, shape in _cases(world_size):
            mesh = init_device_mesh("cpu", mesh_shape)
            value = _dtensor(mesh, placements, shape)
            layout, local = layout_from_dtensor(value), local_value(value)
            expected = value.full_tensor()
            gathered: list = [None] * world_size
            dist.all_gather_object(gathered, (dist.get_rank(), layout, local))
            result = canonicalize([RecordedShard(rank=r, layout=l, value=v) for r, l, v in gathered])
            assert torch.allclose(result.full, expected, rtol=0, atol=1e-6), f"{name}: canonicalize != full_tensor()"
            assert result.replica_drift is None, f"{name}: unexpected drift {result.replica_drift}"
            if not any(p.is_partial() for p in placements):
                assert torch.equal(result.full, expected), f"{name}: not bit-exact"
                assert torch.equal(shard(expected, layout), local), f"{name}: shard() differs from the local tensor"
            else:
                reduced = DTensor.from_local(shard(expected, layout), mesh, placements, run_check=False).full_tensor()
                assert torch.allclose(reduced, expected, atol=1e-6), f"{name}: shard() of a partial does not reduce back"
    finally:
        dist.destroy_process_group()
