"""The example GPT recorded on one rank inside the calling process, without spawning ranks: the
workload of fault-injection scripts that kill or starve the process mid-run
(tests/scripts/record_and_die.py, benchmarks/record_steps.py). Deterministic: every run records the
same values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ttrace_examples.torch_gpt.model import GPT, loss_fn
from ttrace_examples.torch_gpt.train import TorchGPTRunConfig, init_weights, manifest_for, micro_batch
from ttrace_core.record.tracer import Tracer, TracerConfig


def record_single_rank(out: str, steps: int, *, before_step: Callable[[int, nn.Module], None] | None = None,
                       after_step: Callable[[int], None] | None = None) -> None:
    """Train and trace `steps` steps into `out`; `before_step(step, model)` runs before each step is
    opened (to install a fault), `after_step(step)` once its file is complete."""
    config = TorchGPTRunConfig(steps=steps)
    model = GPT(config.model)
    init_weights(model, config.seed, torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    tracer = Tracer(out, model, role="candidate", optimizer=optimizer,
                    config=TracerConfig(exclude=("",), loss_scale=1 / config.num_micro_batches),
                    manifest=manifest_for(config, "candidate"))
    for step in range(steps):
        if before_step is not None:
            before_step(step, model)
        with tracer.step(step):
            optimizer.zero_grad()
            for index in range(config.num_micro_batches):
                inputs, targets = micro_batch(config, index)
                (loss_fn(model(inputs), targets) / config.num_micro_batches).backward()
            optimizer.step()
        if after_step is not None:
            after_step(step)
    tracer.close()
