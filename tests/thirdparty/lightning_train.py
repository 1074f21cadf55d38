"""A small language model trained by the Lightning `Trainer`, the way a user writes it, with one ttrace line.

    python lightning_train.py --accumulation 4                                          # the reference
    torchrun --standalone --nproc-per-node 2 lightning_train.py --accumulation 2       # DDP (gloo)

Lightning builds the DDP wrapper, runs the optimizer with a closure (forward and backward happen inside
`optimizer.step`), divides each micro-batch's loss by `accumulate_grad_batches` and clips the gradients.
`--shuffle` shuffles the training data (a RandomSampler drawing from the global RNG); `--precision` is
Lightning's own option; `--tp N` trains under Lightning's `ModelParallelStrategy`, each MLP tensor-parallel over N
processes (DTensor) and FSDP2 over the rest, without clipping (torch's `clip_grad_norm_` cannot mix the MLPs'
DTensor gradients with the plain ones of a tensor-parallel run without FSDP). `--bug MODULE` (tests only, not what a user writes) makes process 1 scale MODULE's
output by 1.01. `--validate-every N` validates every N training batches, which may fall between two micro-batches of
one optimizer step.
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ttrace_core as ttrace

VOCAB, SEQ, HIDDEN = 96, 16, 32


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(index))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attention = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class LanguageModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def validation_step(self, batch: torch.Tensor, batch_index: int) -> None:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.log("val_loss", loss, sync_dist=True)

    def configure_model(self) -> None:
        """Under Lightning's ModelParallelStrategy: each MLP tensor-parallel (DTensor), then FSDP2 over the rest."""
        mesh = self.device_mesh
        if mesh is None:
            return
        if mesh["tensor_parallel"].size() > 1:
            for block in self.blocks:
                parallelize_module(block.mlp, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if mesh["data_parallel"].size() > 1:
            for block in self.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--validate-every", type=int, default=0, help="validate every N training batches")
    parser.add_argument("--tp", type=int, default=0, help="ModelParallelStrategy with this tensor-parallel size")
    parser.add_argument("--bug", default=None)
    args = parser.parse_args()

    L.seed_everything(0)
    model = LanguageModel()
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = "ddp" if processes > 1 else "auto"
    if args.tp and processes > 1:
        strategy = ModelParallelStrategy(data_parallel_size=processes // args.tp, tensor_parallel_size=args.tp)
    trainer = L.Trainer(accelerator="cpu", devices=processes, strategy=strategy,
                        max_steps=args.steps, accumulate_grad_batches=args.accumulation,
                        gradient_clip_val=None if args.tp else 1.0,
                        precision=args.precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2,
                        val_check_interval=args.validate_every or None)
    if args.bug and int(os.environ.get("RANK", "0")) == 1:
        model.get_submodule(args.bug).register_forward_hook(lambda module, inputs, output: output * 1.01)
    data = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=args.shuffle)
    ttrace.attach_trainer(trainer)
    validation = torch.utils.data.DataLoader(Tokens(), batch_size=2) if args.validate_every else None
    trainer.fit(model, data, validation)


if __name__ == "__main__":
    main()
