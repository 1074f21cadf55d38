"""Parallel layouts of the example GPT, with PyTorch's own DTensor TP/SP, FSDP2 and DDP.

Under TP the residual stream between modules is a plain local tensor, replicated on every TP rank.
Under TP+SP it stays a DTensor sharded on the sequence dim (Rowwise outputs keep
use_local_output=False), so every boundary tensor describes its own layout and no annotation is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


@dataclass(frozen=True, slots=True)
class ExampleBug:
    name: str
    description: str
    requires: str
    """The degree that must exceed 1 for the bug to trigger: "tp", "dp" or "cp"."""
    culprit: str
    """Ground truth: the module (or parameter) at fault."""


TORCH_GPT_BUGS = {
    bug.name: bug for bug in (
        ExampleBug(name="rowwise-skip-allreduce", requires="tp", culprit="layers.0.attn.wo",
                   description="layer 0's attention output projection skips the all-reduce (reduce-scatter "
                               "under SP) of its partial sums"),
        ExampleBug(name="ddp-unreduced-grad", requires="dp", culprit="layers.0.mlp.w2.bias",
                   description="DDP ignores layer 0's MLP output bias, so its gradient is never all-reduced"),
        ExampleBug(name="cp-attn-backward", requires="cp", culprit="layers.*.attn",
                   description="context-parallel attention backward keeps only the local queries' dK/dV "
                               "instead of reduce-scattering them (Megatron-LM #1464-like)"),
    )
}


class RowwiseParallelSkippingReduce(RowwiseParallel):
    """RowwiseParallel whose output is relabelled instead of reduced (the injected bug)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        partial_sums = outputs.to_local()
        if output_layouts[0].is_shard():
            dim = output_layouts[0].dim
            partial_sums = partial_sums.chunk(device_mesh.size(), dim)[device_mesh.get_local_rank()].contiguous()
        if use_local_output:
            return partial_sums
        return DTensor.from_local(partial_sums, device_mesh, output_layouts, run_check=False)


def tensor_parallel_plan(num_layers: int, *, sequence_parallel: bool, bug: str | None) -> dict[str, object]:
    residual = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel
    plan: dict[str, object] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual, use_local_output=local),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual, use_local_output=local),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Replicate(), use_local_output=True),
    }
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    for i in range(num_layers):
        prefix = f"layers.{i}"
        rowwise = RowwiseParallelSkippingReduce if (bug == "rowwise-skip-allreduce" and i == 0) else RowwiseParallel
        plan |= {
            f"{prefix}.attn.wq": ColwiseParallel(), f"{prefix}.attn.wk": ColwiseParallel(),
            f"{prefix}.attn.wv": ColwiseParallel(), f"{prefix}.mlp.w1": ColwiseParallel(),
            f"{prefix}.attn.wo": rowwise(output_layouts=residual, use_local_output=local),
            f"{prefix}.mlp.w2": RowwiseParallel(output_layouts=residual, use_local_output=local),
        }
        if sequence_parallel:
            to_replicated = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan |= {f"{prefix}.ln1": SequenceParallel(), f"{prefix}.ln2": SequenceParallel(),
                     f"{prefix}.attn": PrepareModuleInput(**to_replicated),
                     f"{prefix}.mlp": PrepareModuleInput(**to_replicated)}
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, bug: str | None) -> dict:
    plan = tensor_parallel_plan(len(model.layers), sequence_parallel=sequence_parallel, bug=bug)
    parallelize_module(model, tp_mesh, plan)
    return plan


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def apply_ddp(model: nn.Module, *, bug: str | None, group=None) -> nn.Module:
    """DDP over `group` (default: every rank): under context parallelism it averages the CP ranks'
    gradients, each computed from its own sequence chunk."""
    from torch.nn.parallel import DistributedDataParallel

    if bug == "ddp-unreduced-grad":
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["layers.0.mlp.w2.bias"])
    return DistributedDataParallel(model, process_group=group)
