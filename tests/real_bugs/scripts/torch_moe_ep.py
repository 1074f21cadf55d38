"""A PyTorch-native MoE trained the way torchtitan's llama4 lays out expert parallelism, at its smallest.

    torchrun --standalone --nproc-per-node 2 torch_moe_ep.py --ep 2 [--revert-pr-167178]
    python torch_moe_ep.py                      # the one-rank reference

Dense parameters are FSDP2-sharded over a data-parallel mesh of all ranks. The experts are one
stacked parameter per matrix ([num_experts, ...]), Shard(0) over an expert-parallel mesh of all ranks,
and wrapped in `fully_shard` over the expert-data-parallel axis, which has size 1 when EP spans the
world (torchtitan's `ep_degree == world_size`). Tokens reach the experts through an all-gather
dispatcher: every rank runs its own experts on the tokens of all ranks, and a reduce-scatter sums the
experts' outputs back to the tokens' own rank. An expert's gradient therefore sums the contributions
of every DP rank's micro-batch; to average them like the dense gradients, the experts' FSDP2 group
divides by the DP size through `set_gradient_divide_factor` (torchtitan's llama4 parallelize.py does
the same).

--revert-pr-167178 puts back the pre-fix code path of https://github.com/pytorch/pytorch/pull/167178:
FSDP2's foreach_reduce ignored `gradient_divide_factor` when its reduce-scatter group had one rank,
so the expert gradients come out world-size times too large.
"""

from __future__ import annotations

import argparse
import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ttrace_core as ttrace

VOCAB, DIM, HIDDEN, NUM_EXPERTS, SEQ, BATCH = 64, 32, 48, 2, 8, 2


class _AllGatherTokens(torch.autograd.Function):
    """Concatenate every rank's tokens along dim 0; backward sums the gradients and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad.chunk(dist.get_world_size())[dist.get_rank()].contiguous()


class _ReduceScatterTokens(torch.autograd.Function):
    """Sum the ranks' partial outputs of all tokens and keep this rank's rows; backward all-gathers."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        total = partial.contiguous().clone()
        dist.all_reduce(total)
        return total.chunk(dist.get_world_size())[dist.get_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _AllGatherTokens.forward(ctx, grad)


class Experts(nn.Module):
    scale_hidden = False
    """Weight each token by its router probability before the second matrix instead of after it: the
    same product in another order (control: an equivalent reordering, rounded differently)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(NUM_EXPERTS, DIM, HIDDEN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, DIM) * 0.1)

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """tokens [T, DIM] and their router probabilities [T, NUM_EXPERTS] -> this rank's experts' weighted sum."""
        w1, w2 = self.w1, self.w2
        if isinstance(w1, torch.distributed.tensor.DTensor):
            w1, w2 = w1.to_local(), w2.to_local()
        first = dist.get_rank() * w1.shape[0] if isinstance(self.w1, torch.distributed.tensor.DTensor) else 0
        out = tokens.new_zeros(tokens.shape)
        for local in range(w1.shape[0]):
            weight = probs[:, first + local, None]
            if Experts.scale_hidden:
                out = out + (F.gelu(tokens @ w1[local]) * weight) @ w2[local]
            else:
                out = out + (F.gelu(tokens @ w1[local]) @ w2[local]) * weight
        return out


class MoE(nn.Module):
    def __init__(self, expert_parallel: bool) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, NUM_EXPERTS, bias=False)
        self.experts = Experts()
        self.expert_parallel = expert_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        probs = torch.softmax(self.router(tokens), dim=-1)  # top-2 of 2: every token reaches every expert
        if not self.expert_parallel:
            return self.experts(tokens, probs).view_as(x)
        out = self.experts(_AllGatherTokens.apply(tokens), _AllGatherTokens.apply(probs))
        return _ReduceScatterTokens.apply(out).view_as(x)


class Model(nn.Module):
    def __init__(self, expert_parallel: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.moe = MoE(expert_parallel)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.moe(self.norm(x))
        return self.head(x)


def parallelize(model: Model, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    expert_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("efsdp", "ep"))
    experts = model.moe.experts
    for name in ("w1", "w2"):
        full = getattr(experts, name)
        setattr(experts, name, nn.Parameter(distribute_tensor(full.detach(), expert_mesh["ep"], [Shard(0)])))
    fully_shard(experts, mesh=expert_mesh["efsdp"])
    # Each expert's gradient sums every DP rank's tokens: divide by the DP size, as the dense grads are averaged.
    experts.set_gradient_divide_factor(float(world_size))
    dense_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    fully_shard(model, mesh=dense_mesh)


def revert_pr_167178() -> None:
    """FSDP2 before https://github.com/pytorch/pytorch/pull/167178: with a one-rank reduce-scatter group
    foreach_reduce copied the gradient without applying `gradient_divide_factor`."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    fixed = _fsdp_collectives.foreach_reduce

    @functools.wraps(fixed)
    def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs):
        if reduce_scatter_group is not None and reduce_scatter_group.size() == 1:
            # Pre-fix: the single-rank branch copied reduce_scatter_input as is (no division).
            position = list(inspect.signature(fixed).parameters).index("gradient_divide_factor") - 3
            if position < len(args):
                args = (*args[:position], None, *args[position + 1:])
            else:
                kwargs["gradient_divide_factor"] = None
        return fixed(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs)

    _fsdp_param_group.foreach_reduce = foreach_reduce


def micro_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (the world size; 1: one rank)")
    parser.add_argument("--micro-batches", type=int, default=2, help="global micro-batches per step")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--revert-pr-167178", action="store_true")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="parameter and compute dtype")
    parser.add_argument("--divide-expert-grads", action="store_true",
                        help="control: with the pre-fix FSDP2, divide the expert grads by the DP size by hand")
    parser.add_argument("--scale-hidden", action="store_true",
                        help="control: apply the router weight to the experts' hidden activations (reordered product)")
    args = parser.parse_args()
    Experts.scale_hidden = args.scale_hidden
    if args.ep > 1:
        dist.init_process_group("gloo")
        assert dist.get_world_size() == args.ep, "EP spans the world: --ep equals the number of ranks"
    if args.revert_pr_167178:
        revert_pr_167178()
    torch.manual_seed(0)
    model = Model(expert_parallel=args.ep > 1).to(torch.bfloat16 if args.precision == "bf16" else torch.float32)
    if args.ep > 1:
        parallelize(model, args.ep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    rank, local_micro_batches = (dist.get_rank() if args.ep > 1 else 0), args.micro_batches // args.ep
    # The experts' own inputs are every rank's tokens (the dispatcher's all-gather), which no one-rank
    # micro-batch matches: their activations are left out, their weights, gradients and updates are traced.
    config = ttrace.TracerConfig(loss_scale=1 / local_micro_batches, data_parallel_rank=rank,
                                 data_parallel_size=args.ep, exclude_activations=("moe.experts",))
    session = ttrace.attach(model, optimizer, config=config)
    for step in range(args.steps):
        with session.step(step):
            optimizer.zero_grad()
            for local in range(local_micro_batches):
                inputs, targets = micro_batch(step * args.micro_batches + local * args.ep + rank)
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()) / local_micro_batches
                loss.backward()
            if args.divide_expert_grads:
                for param in model.moe.experts.parameters():
                    param.grad.div_(args.ep)
            optimizer.step()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
