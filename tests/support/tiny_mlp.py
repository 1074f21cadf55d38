"""The tiny MLP the record and compare tests train for a step or two: a seeded 4 -> 8 -> 2 network,
one optimizer step over micro-batches, and a reference/candidate pair recorded in this process.

Used by tests/core/record/test_tracer.py, test_background_writer.py, tests/core/compare/test_liveness.py
and tests/app/test_pages.py."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ttrace_core.record.tracer import Tracer, TracerConfig


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def train_step(model: nn.Module, optimizer, *, num_micro_batches: int = 2, scale: float | None = None) -> None:
    """One optimizer step over `num_micro_batches` seeded batches of 3; the loss is scaled by `scale`,
    or averaged over the micro-batches."""
    optimizer.zero_grad()
    for index in range(num_micro_batches):
        inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(index), requires_grad=True)
        loss = model(inputs).square().mean() * (scale if scale is not None else 1.0 / num_micro_batches)
        loss.backward()
    optimizer.step()


def record_step(run_dir: Path, *, role: str, lr: float = 0.1, loss_factor: float = 1.0,
                config: TracerConfig | None = None) -> Path:
    """One step of SGD on the MLP, recorded; `loss_factor` 0 zeroes every gradient (a reference that
    did not train)."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tracer = Tracer(run_dir, model, role=role, optimizer=optimizer, config=config)
    with tracer.step(0):
        optimizer.zero_grad()
        inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        (model(inputs).square().mean() * loss_factor).backward()
        optimizer.step()
    tracer.close()
    return run_dir


def recorded_pair(root: Path, **how) -> tuple[Path, Path]:
    """A reference and a candidate recorded the same way under `root`."""
    return (record_step(root / "reference", role="reference", **how),
            record_step(root / "candidate", role="candidate", **how))
