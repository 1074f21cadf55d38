"""torchtitan's own Trainer, traced: `python -m ttrace_examples.torchtitan ARGS`, ARGS being torchtitan's CLI.

    ttrace record --out runs/ref -- torchrun --standalone --nproc-per-node 1 -m ttrace_examples.torchtitan \\
        --module ttrace_examples.torchtitan --config llama3_debugmodel --training.steps 2 ...

It wraps two methods of torchtitan's Trainer, then calls torchtitan's own `torchtitan.train.main()`:

- `Trainer.train_step`: the first call attaches ttrace (`ttrace.attach(model, optimizers, ...)` with
  what ttrace_core/integrations/torchtitan.py reads of the Trainer: loss scale, data-parallel rank and
  size, declarations); every call runs inside `session.step(i)`. ttrace's step i is torchtitan's i+1.
- `Trainer.batch_generator`: under a ttrace command only, data-parallel rank r of size dp reads the
  global stream of batches r, r + dp, r + 2dp, ... (the stream a one-rank reference reads whole), so
  that its local micro-batch k is the reference's micro-batch k * dp + r, ttrace's rule. torchtitan's
  own split of the documents between ranks (split_dataset_by_node) is then not what runs: a bug in it
  is a blind spot of the trace.

Outside a ttrace command nothing of ttrace touches the Trainer (the session is inactive, the data is
torchtitan's own): the launcher trains as `torchtitan.train` does. A tracing error never stops the
training: attach failing prints one line and the run goes on untraced. On a machine with no
accelerator, torchtitan is pointed at the CPU first (integrations/torchtitan.py).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

import ttrace_core as ttrace
from ttrace_core.integrations.patching import patch_attribute
from ttrace_core.integrations.torchtitan import sum_reductions_for_gloo, trainer_tracing, use_cpu_without_accelerator
from ttrace_core.record.session import active_spec

Undo = Callable[[], None]


def attach_trainer(trainer: Any):
    """ttrace's session for a built torchtitan Trainer; inactive outside a ttrace command, which reads nothing of it."""
    if active_spec() is None:
        return ttrace.Session()
    tracing = trainer_tracing(trainer)
    if tracing.untraced:
        print(f"ttrace: not traced: {tracing.untraced}", file=sys.stderr, flush=True)
        return ttrace.Session()
    session = ttrace.attach(trainer.model_parts[0], trainer.optimizers, loss_scale=tracing.loss_scale,
                            data_parallel=tracing.data_parallel, config=tracing.config)
    for declaration in tracing.declarations:
        session.declare(declaration.fqn_glob, declaration.slot_glob, declaration.placements, declaration.mesh)
    return session


def _global_batches(trainer: Any) -> Iterable:
    """The batches a one-rank run reads: torchtitan's dataloader built as for data-parallel size 1."""
    config = trainer.config
    batch_size = (config.parallelism.pipeline_parallel_microbatch_size if trainer.parallel_dims.pp_enabled
                  else config.training.local_batch_size)
    return config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=trainer.tokenizer,
                                   seq_len=config.training.seq_len, local_batch_size=batch_size,
                                   snapshot_every_n_steps=None)


def _attached_or_untraced(trainer: Any):
    try:
        return attach_trainer(trainer)
    except Exception as error:  # noqa: BLE001 - tracing must never stop the training
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"ttrace: attach failed on rank {rank} ({type(error).__name__}: {error}); training goes on untraced",
              file=sys.stderr, flush=True)
        return ttrace.Session()


def trace_trainer(trainer_class: type) -> Undo:
    """Wrap `trainer_class.train_step` (attach at the first call, a ttrace step around each) and
    `batch_generator` (the micro-batch rule under a ttrace command); returns the undo."""
    original_step, original_batches = trainer_class.train_step, trainer_class.batch_generator

    def train_step(self, data_iterator):
        session = getattr(self, "_ttrace_session", None)
        if session is None:
            session = self._ttrace_session = _attached_or_untraced(self)
        with session.step(self.step - 1):
            return original_step(self, data_iterator)

    def batch_generator(self, data_iterable):
        if active_spec() is not None and self.parallel_dims.dp_enabled:
            mesh = self.parallel_dims.get_mesh("batch")
            if mesh.size() > 1:
                data_iterable = itertools.islice(_global_batches(self), mesh.get_local_rank(), None, mesh.size())
        return original_batches(self, data_iterable)

    undo_step = patch_attribute(trainer_class, "train_step", train_step)
    undo_batches = patch_attribute(trainer_class, "batch_generator", batch_generator)

    def undo() -> None:
        undo_batches()
        undo_step()

    return undo


def main() -> None:
    """torchtitan's `torchtitan.train.main()` with the Trainer traced; arguments as torchtitan's."""
    on_cpu = use_cpu_without_accelerator()
    from torchtitan import train, trainer

    if on_cpu:
        built = trainer.Trainer.__init__

        def __init__(self, *args, **kwargs):
            built(self, *args, **kwargs)
            sum_reductions_for_gloo(self)

        patch_attribute(trainer.Trainer, "__init__", __init__)
    trace_trainer(trainer.Trainer)
    train.main()
