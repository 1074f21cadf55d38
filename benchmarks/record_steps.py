"""The workload of benchmarks/recording_faults.py: record STEPS steps of the example GPT on one rank
into OUT, printing "step K done" once step K's file is complete. Deterministic: every run records
the same values, so a step kept by a killed run can be checked against an uninterrupted one.

    python benchmarks/record_steps.py OUT STEPS
"""

import signal
import sys

import torch

from ttrace_core.examples.torch_gpt.model import GPT, loss_fn
from ttrace_core.examples.torch_gpt.train import TorchGPTRunConfig, init_weights, manifest_for, micro_batch
from ttrace_core.tracer import Tracer, TracerConfig


def main(out: str, steps: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past a file-size limit a write fails (EFBIG) instead of killing
    config = TorchGPTRunConfig(steps=steps)
    model = GPT(config.model)
    init_weights(model, config.seed, torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    tracer = Tracer(out, model, role="candidate", optimizer=optimizer,
                    config=TracerConfig(exclude=("",), loss_scale=1 / config.num_micro_batches),
                    manifest=manifest_for(config, "candidate"))
    for step in range(steps):
        with tracer.step(step):
            optimizer.zero_grad()
            for index in range(config.num_micro_batches):
                inputs, targets = micro_batch(config, index)
                (loss_fn(model(inputs), targets) / config.num_micro_batches).backward()
            optimizer.step()
        print(f"step {step} done", flush=True)
    tracer.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
