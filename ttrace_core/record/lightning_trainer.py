"""Part of stage 1 (record): tracing a Lightning `Trainer` (`lightning.pytorch`, or the older `pytorch_lightning`).

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=2, ...)
    ttrace.attach_trainer(trainer)
    trainer.fit(model, train_dataloader)

`attach_trainer` adds a `Callback` to the trainer's list. What it takes from Lightning:

- **the model**: the `LightningModule` itself, whose `forward` both runs call from `training_step` (the
  strategy's wrapper calls `training_step`, with the whole batch), and the data-parallel rank and size the
  strategy hands its distributed sampler (`distributed_sampler_kwargs`: under DDP every process, under a
  model-parallel mesh its data-parallel axis);
- **the loss scale**: with automatic optimization Lightning divides each micro-batch's loss by
  `accumulate_grad_batches` before backward; with manual optimization the user's `manual_backward` gets the
  loss as `training_step` made it (scale 1);
- **the step**, from the first micro-batch of an optimizer step (`on_train_batch_start`) to the batch after
  which `trainer.global_step` moved on (`on_train_batch_end`), numbered by the step it was at. A validation
  Lightning runs in between (`val_check_interval` counts batches, not steps) is not recorded.

Lightning runs the optimizer with a closure: `optimizer.step(closure)` does the last micro-batch's forward and
backward *inside* the step, so the optimizer's own step hooks fire before the gradients exist. The gradients are
therefore recorded at `on_before_optimizer_step` (after the closure's backward and DDP's reduction, before
Lightning clips them: the clipped update shows in the parameters), with the learning rate the step uses; the
parameters after the step at the end of that batch.

**The wrapper's call is no module call.** On one device Lightning calls `training_step` itself, and
`training_step` calls the model. Under DDP it routes `training_step` through the wrapper's `forward` (its
"forward redirection": DDP calls the LightningModule, whose `forward` is swapped for `training_step` for that
one call), so the LightningModule would be called twice per micro-batch, first with the whole batch. While
tracing, the callback hands the strategy a redirection that sets the LightningModule's own hooks aside for that
outer call and gives them back as `training_step` starts: both runs then see the calls `training_step` makes.

**Which batches each process draws.** Lightning gives each DDP process a `DistributedSampler`, which deals
single *samples* round-robin: a process's batch is no batch of a one-process reference. Under a ttrace command
(and only then) the callback deals the training loader's *batches* instead, as accelerate does: process p of P
draws batches k x P + p of the loader as the user built it (its sampler and collate), ttrace's own
micro-batch order. A shuffling `RandomSampler` without a generator of its own draws its order from the global
RNG, which a one-process and a DDP Lightning run leave in different states before the first batch (measured,
Lightning 2.6.6, without ttrace); under a ttrace command it gets a generator seeded by the run's seed and the
epoch, in the reference and the candidate alike. Every process iterates the whole loader and keeps its share
of each group of P batches; a last group of fewer than P batches is left out, so every process takes as many
steps. Outside a ttrace command nothing changes.

A reference and a candidate compare when the candidate's P data-parallel processes with G accumulated batches
each see the batches a one-process reference sees with P x G, at the same batch size and seed. Not handled: a
loader Lightning does not see as a `DataLoader` in the candidate (its own distributed sampling is kept), several
optimizers stepping in one training step (the first one's `on_before_optimizer_step` records the gradients),
and DeepSpeed, whose engine scales the loss itself.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from ttrace_core.integrations.patching import patch_attribute
from ttrace_core.integrations.torch_native import lightning_package
from ttrace_core.record.session import Session, active_spec, attach
from ttrace_core.record.step_scalars import record_learning_rate
from ttrace_core.record.trainers import TrainerTracing

TRAINING = "train"
"""The value of Lightning's `RunningStage.TRAINING`: the loaders dealt by batch."""


def degrees(trainer: Any) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size): what the strategy tells its distributed sampler; (0, 1) on one device."""
    sampling = trainer.distributed_sampler_kwargs or {}
    return int(sampling.get("rank", 0)), max(1, int(sampling.get("num_replicas", 1)))


def loss_scale(trainer: Any) -> float:
    """What Lightning multiplies each micro-batch's loss by before backward."""
    if not trainer.lightning_module.automatic_optimization:
        return 1.0
    return 1.0 / trainer.accumulate_grad_batches


class DealtBatches:
    """Batches k x size + rank of `loader`: one process's share of the batches a single process draws. Every
    process iterates the whole loader (so every sampler, seed and collate runs as the user built it) and keeps
    one batch of each full group of `size`. A `RandomSampler` with no generator of its own is given one, seeded
    by `seed` and the epoch, for each pass (the global RNG it would draw from is not the same in a one-process and
    a DDP Lightning run). Any other attribute is the loader's (Lightning sets its sampler's epoch)."""

    def __init__(self, loader: Any, rank: int, size: int, seed: int) -> None:
        self.loader, self.rank, self.size, self.seed = loader, rank, size, seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader) // self.size

    def __iter__(self):
        sampler = getattr(self.loader, "sampler", None)
        unseeded = isinstance(sampler, RandomSampler) and sampler.generator is None
        if unseeded:
            sampler.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        try:
            group = []
            for batch in self.loader:
                group.append(batch)
                if len(group) == self.size:
                    yield group[self.rank]
                    group = []
        finally:
            if unseeded:
                sampler.generator = None

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")
"""Where a torch module keeps its own hooks (torch 2.13): a call finding them empty runs none, forward or backward."""


class QuietOuterCall:
    """Lightning's forward redirection (`strategy._forward_redirection`), run with the LightningModule's own hooks
    set aside for the wrapper's call of it and given back when the redirected method (`training_step`) starts."""

    def __init__(self, redirection: Any) -> None:
        self.redirection = redirection

    def __call__(self, wrapper_module: Any, original_module: Any, method_name: str, *args, **kwargs):
        method = getattr(original_module, method_name)
        hooks = {name: vars(original_module)[name] for name in HOOK_TABLES if name in vars(original_module)}

        def give_back() -> None:
            for name, table in hooks.items():
                setattr(original_module, name, table)

        def with_hooks(*method_args, **method_kwargs):
            give_back()
            return method(*method_args, **method_kwargs)
        for name, table in hooks.items():
            setattr(original_module, name, type(table)())
        setattr(original_module, method_name, with_hooks)  # the redirection looks the method up by name
        try:
            return self.redirection(wrapper_module, original_module, method_name, *args, **kwargs)
        finally:
            vars(original_module).pop(method_name, None)
            give_back()

    def __getattr__(self, name: str) -> Any:  # its on_after_* hooks, for whoever calls them
        if name == "redirection":
            raise AttributeError(name)
        return getattr(self.redirection, name)


class LightningTracing(TrainerTracing):
    """A Lightning Trainer's session (ttrace_core.record.lightning_trainer)."""

    @classmethod
    def added_to(cls, trainer: Any, options: dict) -> "LightningTracing":
        tracing = cls(trainer, options)
        trainer.callbacks.append(tracing.callback(lightning_package(trainer, "Trainer")))
        return tracing

    def __init__(self, trainer: Any, options: dict) -> None:
        super().__init__(trainer, options)
        self._undo: list[Callable[[], None]] = []
        """What the tracing changed in Lightning (the loaders' preparation, the forward redirection), undone at teardown."""
        self._dealing = False
        self._gradients_recorded = False
        self._paused: contextlib.AbstractContextManager | None = None

    def callback(self, package: str):
        base = importlib.import_module(package).Callback
        tracing = self

        class TtraceCallback(base):
            """Attaches ttrace when training starts and records each optimizer step (ttrace_core.record.lightning_trainer)."""

            def setup(self, trainer, pl_module, stage):
                if stage == "fit":
                    tracing.deal_batches()

            def on_train_start(self, trainer, pl_module):
                tracing.begin()

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if tracing.step_number is None:
                    tracing.begin_step(trainer.global_step)

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                tracing.before_optimizer_step(optimizer)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if tracing.step_number is not None and trainer.global_step != tracing.step_number:
                    tracing.after_optimizer_step()

            def on_validation_start(self, trainer, pl_module):
                tracing.pause()

            def on_validation_end(self, trainer, pl_module):
                tracing.resume()

            def on_train_end(self, trainer, pl_module):
                tracing.end()

            def on_exception(self, trainer, pl_module, exception):
                tracing.end(exception)

            def teardown(self, trainer, pl_module, stage):
                tracing.restore()

        return TtraceCallback()

    def deal_batches(self) -> None:
        """Under a ttrace command: the training loader dealt by batch to the data-parallel processes (DealtBatches;
        on one process every batch, with the same seeded sampling)."""
        rank, size = degrees(self.trainer)
        spec = active_spec()
        if spec is None or self._dealing:
            return
        connector = getattr(self.trainer, "_data_connector", None)
        prepare = getattr(connector, "_prepare_dataloader", None)
        if prepare is None:
            print(f"ttrace: this Lightning ({type(self.trainer).__module__}) prepares its loaders elsewhere; each process "
                  "keeps Lightning's distributed sampler, whose batches are no one-process batches: expect the "
                  "activations to differ", file=sys.stderr)
            return

        def prepared(dataloader, shuffle, mode):
            if getattr(mode, "value", mode) == TRAINING and isinstance(dataloader, DataLoader):
                return DealtBatches(dataloader, rank, size, spec.seed)
            return prepare(dataloader, shuffle, mode)
        self._undo.append(patch_attribute(connector, "_prepare_dataloader", prepared))
        self._dealing = True

    def restore(self) -> None:
        """Lightning as it was (teardown): a next `fit` deals and redirects again."""
        while self._undo:
            self._undo.pop()()
        self._dealing = False

    def attached(self) -> Session:
        trainer = self.trainer
        session = attach(trainer.lightning_module, None, loss_scale=loss_scale(trainer),
                         data_parallel=degrees(trainer), **self.options)
        strategy = trainer.strategy
        if session.active and strategy.model is not trainer.lightning_module:
            redirection = getattr(strategy, "_forward_redirection", None)
            if redirection is None:
                session.tracer.add_finding("", "", f"{type(strategy).__name__} calls training_step some other way than "
                                           "this Lightning's forward redirection: the model's calls may differ from a "
                                           "one-device run's")
            else:
                self._undo.append(patch_attribute(strategy, "_forward_redirection", QuietOuterCall(redirection)))
        return session

    def pause(self) -> None:
        """Validation starts: Lightning may run it between two micro-batches of a step (`val_check_interval`
        counts batches, not optimizer steps); its forwards are not the step's."""
        if self.session is not None and self.session.active and self._paused is None:
            self._paused = self.session.tracer.paused()
            self._paused.__enter__()

    def resume(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None:
            paused.__exit__(None, None, None)

    def begin_step(self, step: int) -> None:
        self._gradients_recorded = False
        super().begin_step(step)

    def before_optimizer_step(self, optimizer: Any) -> None:
        if self.step_number is None or self._gradients_recorded or not self.session.active:
            return
        self._gradients_recorded = True
        self.session.record_gradients()
        record_learning_rate(self.session.tracer, optimizer)

    def after_optimizer_step(self) -> None:
        if self.session.active:
            self.session.record_parameters()
        self.end_step()
