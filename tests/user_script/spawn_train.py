"""The shape of PyTorch's DDP tutorial: the script starts its own workers with `torch.multiprocessing.spawn` (no
torchrun), DDP with `no_sync` accumulation, and ttrace's one `attach`. `python spawn_train.py WORLD [--bug]`;
`--bug` makes the first linear's output 1% larger on rank 1."""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import ttrace_core as ttrace

MICRO_BATCHES = 4
"""Per step, over every rank: rank r runs global micro-batches r, r + world, ..."""


def worker(rank: int, world: int, port: int, bug: bool) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    if bug and rank == 1:
        model[0].register_forward_hook(lambda module, args, output: output * 1.01)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    local = MICRO_BATCHES // world
    session = ttrace.attach(ddp, optimizer, loss_scale=1.0 / local)
    for step in range(2):
        with session.step(step):
            for k in range(local):
                generator = torch.Generator().manual_seed(100 * step + k * world + rank)
                inputs, targets = torch.randn(4, 16, generator=generator), torch.randn(4, 8, generator=generator)
                if k < local - 1:
                    with ddp.no_sync():
                        (nn.functional.mse_loss(ddp(inputs), targets) / local).backward()
                else:
                    (nn.functional.mse_loss(ddp(inputs), targets) / local).backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("world", type=int)
    parser.add_argument("--bug", action="store_true")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args.bug), nprocs=args.world, join=True)
