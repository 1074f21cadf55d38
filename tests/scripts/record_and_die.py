"""Record the example GPT on one rank and SIGKILL this process in the middle of step 1.

Used by the test that a killed recording keeps its completed steps readable.
"""

import os
import signal
import sys

import torch

from ttrace_core.examples.torch_gpt.model import GPT, loss_fn
from ttrace_core.examples.torch_gpt.train import TorchGPTRunConfig, init_weights, manifest_for, micro_batch
from ttrace_core.tracer import Tracer, TracerConfig


def die_on_second_call():
    """A forward hook that kills the process while layer 2 of the second micro-batch runs."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main(out: str) -> None:
    config = TorchGPTRunConfig(steps=2)
    model = GPT(config.model)
    init_weights(model, config.seed, torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    tracer = Tracer(out, model, role="candidate", optimizer=optimizer,
                    config=TracerConfig(exclude=("",), loss_scale=1 / config.num_micro_batches),
                    manifest=manifest_for(config, "candidate"))
    for step in range(config.steps):
        if step == 1:
            model.layers["2"].register_forward_hook(die_on_second_call())
        with tracer.step(step):
            optimizer.zero_grad()
            for index in range(config.num_micro_batches):
                inputs, targets = micro_batch(config, index)
                (loss_fn(model(inputs), targets) / config.num_micro_batches).backward()
            optimizer.step()


if __name__ == "__main__":
    main(sys.argv[1])
