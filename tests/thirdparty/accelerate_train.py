"""A user's own training loop on Hugging Face accelerate, as its docs write one: `Accelerator` with gradient
accumulation, `prepare()` (DDP, the data loader sharded by process), `accumulate()`, `backward()`, and ttrace's
one `attach`. `--bug` makes every block's output 1% larger on process 1."""

import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import ttrace_core as ttrace

VOCAB, WIDTH = 64, 32

parser = argparse.ArgumentParser()
parser.add_argument("--accumulation", type=int, default=4)
parser.add_argument("--bug", action="store_true")
args = parser.parse_args()
accelerator = Accelerator(gradient_accumulation_steps=args.accumulation, cpu=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))
        return x + (y * 1.01 if args.bug and accelerator.process_index == 1 else y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


data = torch.randint(0, VOCAB, (32, 17), generator=torch.Generator().manual_seed(1))
loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2, shuffle=False)
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
session = ttrace.attach(model, optimizer, loss_scale=1.0 / args.accumulation)
batches = iter(loader)
for step in range(2):
    with session.step(step):
        for _ in range(args.accumulation):
            tokens, labels = next(batches)
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1))
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
