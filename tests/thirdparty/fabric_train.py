"""A user's own training loop on Lightning Fabric, traced by `ttrace.attach` on what `fabric.setup` returned.

    python fabric_train.py --accumulation 4                                          # the reference
    torchrun --standalone --nproc-per-node 2 fabric_train.py --accumulation 2       # DDP (gloo)

Fabric wraps the model (its `_FabricModule` around DistributedDataParallel) and the optimizer; the loop is the
user's: process p of P takes batches k x P + p of one loader (Fabric's distributed sampler is turned off) and
accumulates G of them, dividing each loss by G. The model is lightning_train.py's.
"""

import argparse
import os

import lightning as L
import torch

import ttrace_core as ttrace
from lightning_train import VOCAB, LanguageModel, Tokens  # beside this script


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = L.Fabric(accelerator="cpu", devices=processes, strategy="ddp" if processes > 1 else "auto")
    fabric.launch()
    fabric.seed_everything(0)
    module = LanguageModel()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    data = fabric.setup_dataloaders(torch.utils.data.DataLoader(Tokens(), batch_size=2), use_distributed_sampler=False)
    session = ttrace.attach(model, optimizer, loss_scale=1 / args.accumulation)
    batches = iter(data)
    for step in range(args.steps):
        with session.step(step):
            for index in range(args.accumulation * processes):
                batch = next(batches)
                if index % processes != fabric.global_rank:
                    continue
                logits = model(batch[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
                fabric.backward(loss / args.accumulation)
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
