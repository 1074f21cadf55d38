"""Context parallelism for the example GPT: each CP rank holds one contiguous chunk of every sequence.

Every activation is sequence-sharded (S(1) of [B, T, D]) except inside attention, where each
rank all-gathers keys and values over the CP group and attends from its own queries with a
causal mask offset to its chunk (the all-gather flavour of context parallelism). The gather's
backward is a reduce-scatter: each rank's dK/dV get the contributions of every rank's queries.
The injected bug `cp-attn-backward` keeps only the local queries' contribution instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class _GatherKeepingLocalGradient(torch.autograd.Function):
    """All-gather along the sequence whose backward forgets the other ranks' gradients (the bug)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad_gathered: torch.Tensor):
        # BUG: should be a reduce-scatter (sum over ranks); this keeps only the local queries' part.
        return grad_gathered.chunk(ctx.size, dim=2)[ctx.rank].contiguous(), None


def _gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, *, keep_local_gradient: bool) -> torch.Tensor:
    if keep_local_gradient:
        return _GatherKeepingLocalGradient.apply(local, group)
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    return all_gather_tensor_autograd(local.contiguous(), gather_dim=2, group=group)


@dataclass(slots=True)
class ContextParallelAttention:
    """Causal attention of this rank's queries over the keys and values of the whole sequence."""

    group: dist.ProcessGroup
    rank: int
    size: int
    keep_local_gradient: bool = False

    def __call__(self, q_BHtK: torch.Tensor, k_BHtK: torch.Tensor, v_BHtK: torch.Tensor) -> torch.Tensor:
        k_BHTK = _gather_sequence(k_BHtK, self.group, keep_local_gradient=self.keep_local_gradient)
        v_BHTK = _gather_sequence(v_BHtK, self.group, keep_local_gradient=self.keep_local_gradient)
        local = q_BHtK.shape[2]
        query_positions = torch.arange(self.rank * local, (self.rank + 1) * local).unsqueeze(1)
        key_positions = torch.arange(local * self.size).unsqueeze(0)
        return F.scaled_dot_product_attention(q_BHtK, k_BHTK, v_BHTK, attn_mask=key_positions <= query_positions)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, *, seq_len: int, bug: str | None) -> None:
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    model.position_offset = rank * (seq_len // size)
    for layer in model.layers.values():
        layer.attn.context_parallel = ContextParallelAttention(
            group=cp_mesh.get_group(), rank=rank, size=size, keep_local_gradient=bug == "cp-attn-backward")


def sequence_chunk(tensor_BT: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return tensor_BT.chunk(size, dim=1)[rank].contiguous()
