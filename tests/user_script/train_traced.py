"""A small transformer trained the way a user writes it: DTensor tensor parallelism inside, FSDP2 across,
activation checkpointing on its blocks, a chunked loss that calls the output head twice per micro-batch.

    torchrun --standalone --nproc-per-node 4 train.py --tp 2 --dp 2 --checkpoint

This is train.py with ttrace attached: under `ttrace record` it records, otherwise it runs exactly as
train.py does (tests/test_user_script.py diffs the two).
"""

import argparse
import math

import ttrace_core as ttrace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, bug: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, dim // num_heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        local_heads = q.shape[-1] // self.head_dim  # a tensor-parallel rank holds some of the heads
        # The bug: the softmax scale from the local width, which is only right on one rank.
        scale = 1 / math.sqrt(q.shape[-1] / self.num_heads) if self.bug else 1 / math.sqrt(self.head_dim)
        q, k, v = (t.view(batch, seq, local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, local_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, bug: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, bug)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, num_heads: int, num_layers: int, bug: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, num_heads, bug and i == 0) for i in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def chunked_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, num_chunks: int = 2) -> torch.Tensor:
    """Cross-entropy over sequence chunks, so the full logits never exist at once (the head runs per chunk)."""
    total = hidden.new_zeros(())
    for h, t in zip(hidden.chunk(num_chunks, dim=1), targets.chunk(num_chunks, dim=1)):
        total = total + F.cross_entropy(head(h).flatten(0, 1), t.flatten(), reduction="sum")
    return total / targets.numel()


def parallelize(model: Transformer, tp: int, dp: int, checkpoint: bool) -> None:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if tp * dp > 1 else None
    for index, block in enumerate(model.blocks):
        if tp > 1:
            parallelize_module(block, mesh["tp"], {
                "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if checkpoint:
            block = model.blocks[index] = checkpoint_wrapper(block)
        if dp > 1:
            fully_shard(block, mesh=mesh["dp"])
    if dp > 1:
        fully_shard(model.head, mesh=mesh["dp"])  # called outside the model's forward, by the loss
        fully_shard(model, mesh=mesh["dp"])


def micro_batch(step: int, index: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, step: int, args: argparse.Namespace,
               dp_rank: int) -> float:
    optimizer.zero_grad()
    local_micro_batches = args.micro_batches // args.dp
    for local in range(local_micro_batches):
        inputs, targets = micro_batch(step, local * args.dp + dp_rank, batch=2, seq=8, vocab=64)
        loss = chunked_loss(model.head, model(inputs), targets) / local_micro_batches
        loss.backward()
    if args.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--bug", action="store_true", help="layer 0's attention scale from the local width")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm at this value (0: no clipping)")
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    if args.tp * args.dp > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Transformer(vocab=64, dim=32, num_heads=4, num_layers=2, bug=args.bug)
    parallelize(model, args.tp, args.dp, args.checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = dist.get_rank() // args.tp if args.dp > 1 else 0
    session = ttrace.attach(model, optimizer, loss_scale=args.dp / args.micro_batches)
    for step in range(args.steps):
        with session.step(step):
            loss = train_step(model, optimizer, step, args, dp_rank)
        print(f"step {step} loss {loss:.10f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
