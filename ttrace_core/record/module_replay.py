"""Stage 4 (localize), one module alone: run a module on the reference's inputs without the rest of the model.

Input: a built candidate model with its `Tracer` (rewriting on, restricted to the
module), the candidate's run directory and the module's global fqn. Output: the tracer's trace of
that module's subtree for the first step: per micro-batch, the module is called on this rank's
recorded inputs; the rewriter (rewrite.py) swaps them, and every descendant's inputs and output
gradients, for the reference's, so its collectives still run in the candidate's layout. Backward
starts from zeros that the rewriter replaces with the reference's output gradient.

What is skipped: the embedding, every other layer, the loss, the gradient reduction and the
optimizer. A module whose forward takes arguments the trace does not hold (a None positional, an
int) cannot be called this way: the call raises, and localize falls back to replaying it inside
the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ttrace_core.errors import TtraceError
from ttrace_core.format.shard_reads import forward_inputs


def find_module(tracer, model: nn.Module, fqn: str) -> nn.Module | None:
    """The submodule whose global fqn is `fqn`, or None when this rank does not hold it (another pipeline stage)."""
    return next((module for local, module in model.named_modules() if tracer.global_fqn(local) == fqn), None)


def recorded_calls(candidate_dir: str | Path, rank: int, step: int, fqn: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(global micro-batch, {input name: this rank's recorded value}) of every forward call of `fqn`, in
    call order; only those datasets are read (a 48-layer trace's full index takes seconds to open)."""
    calls = forward_inputs(candidate_dir, rank, step, fqn)
    return [(micro_batch, {slot.removeprefix("input."): value for slot, value in inputs.items()})
            for micro_batch, inputs in sorted(calls.items())]


def call_arguments(inputs: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Positional inputs ("0", "1", ...) in order, keyword inputs by name; floats require grad (so that
    the rewriter swaps them and backward reaches them)."""
    def prepared(value: torch.Tensor) -> torch.Tensor:
        return value.clone().requires_grad_(True) if value.is_floating_point() else value

    positional = sorted((int(name), value) for name, value in inputs.items() if name.isdigit())
    if [index for index, _ in positional] != list(range(len(positional))):
        raise TtraceError(f"positional inputs {[i for i, _ in positional]} are not contiguous: a non-tensor argument "
                          "sits between them")
    keywords = {name: prepared(value) for name, value in inputs.items() if not name.isdigit()}
    return [prepared(value) for _, value in positional], keywords


def _output_tensors(output: object) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def drive_module(tracer, model: nn.Module, candidate_dir: str | Path, fqn: str, step: int = 0) -> int:
    """Call the module once per recorded micro-batch of this rank, forward and backward; returns the call count."""
    target = find_module(tracer, model, fqn)
    calls = recorded_calls(candidate_dir, tracer.rank, step, fqn) if target is not None else []
    with tracer.step(step, parameters_before=False):
        for _, inputs in calls:
            args, kwargs = call_arguments(inputs)
            outputs = _output_tensors(target(*args, **kwargs))
            if outputs:
                torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])
    tracer.close()
    return len(calls)
