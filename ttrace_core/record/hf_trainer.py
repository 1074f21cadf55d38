"""Part of stage 1 (record): tracing a Hugging Face `transformers.Trainer`, whose loop the user does not write.

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    ttrace.attach_trainer(trainer)
    trainer.train()

The Trainer builds its optimizer, wraps the model (DDP, FSDP through accelerate) and runs the steps itself, so
there is no loop to put `with session.step(i):` around. `attach_trainer` adds a `TrainerCallback` that attaches
when training begins, with what only the Trainer knows, and brackets each optimizer step:

- **the model and optimizer** the Trainer trains: the wrapped model (`model_wrapped`: DDP says it is
  data-parallel) and accelerate's `AcceleratedOptimizer` (the tracer hooks the optimizer inside it);
- **data parallelism**: every process of the Trainer's accelerator draws its own batches (accelerate hands
  batch k x P + p of one seeded sampler to process p of P, ttrace's own micro-batch order), except the ranks a
  tensor, context or sequence parallel group shares a batch across: data-parallel rank = process // (tp x cp x sp);
- **the loss scale**, what each micro-batch's loss is multiplied by before backward, as `Trainer.compute_loss`
  and `training_step` do it: a loss the model normalizes by the step's token count (`num_items_in_batch`, a
  causal LM's default) is multiplied by the data-parallel size (`average_tokens_across_devices`, DDP averaging
  the gradients back); any other loss is divided by the step's accumulation steps;
- **the step**: `on_step_begin` (before the first micro-batch of an optimizer step) to `on_step_end` (after
  `optimizer.step()` and `zero_grad`), numbered by `state.global_step`.

A reference and a candidate compare when the candidate's P data-parallel processes with G accumulation steps
each see the batches a one-process reference sees with P x G, at the same per-device batch size and seed.
What is left out: a loss normalized by a local token count (`average_tokens_across_devices=False`) is scaled as
if every process saw as many tokens (otherwise DDP's gradients are not the reference's, which ttrace shows);
DeepSpeed, whose engine scales the loss itself, is not handled; a second `train()` of the same Trainer is not
traced (attaching again would draw the weights again), the trace keeps the first.
"""

from __future__ import annotations

from typing import Any

from ttrace_core.record.session import Session, attach
from ttrace_core.record.trainers import TrainerTracing


def degrees(trainer: Any) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this process of the Trainer: the ranks that share a batch
    (tensor, context and sequence parallel groups, innermost in accelerate's mesh) count once."""
    shared = 1
    for getter in ("get_tp_size", "get_cp_size", "get_sp_size"):
        size = getattr(trainer, getter, None)
        shared *= max(1, int(size())) if callable(size) else 1
    accelerator = trainer.accelerator
    return accelerator.process_index // shared, max(1, accelerator.num_processes // shared)


def loss_scale(trainer: Any) -> float:
    """What the Trainer multiplies each micro-batch's loss by before backward, relative to the model's own
    loss (see the module's docstring)."""
    args = trainer.args
    scaled_for_accumulation = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled_for_accumulation is None:
        scaled_for_accumulation = bool(getattr(trainer, "model_accepts_loss_kwargs", False)
                                       or getattr(trainer, "compute_loss_func", None) is not None)
    if scaled_for_accumulation:
        return float(degrees(trainer)[1])
    steps = getattr(trainer, "current_gradient_accumulation_steps", None) or args.gradient_accumulation_steps
    return 1.0 / steps


class HFTrainerTracing(TrainerTracing):
    """A Hugging Face Trainer's session: attached at `on_train_begin`, one step from `on_step_begin` to `on_step_end`."""

    @classmethod
    def added_to(cls, trainer: Any, options: dict) -> "HFTrainerTracing":
        tracing = cls(trainer, options)
        trainer.add_callback(tracing.callback())
        return tracing

    def callback(self):
        from transformers import TrainerCallback

        tracing = self

        class TtraceCallback(TrainerCallback):
            """Attaches ttrace when training begins and brackets each optimizer step (ttrace_core.record.hf_trainer)."""

            def on_train_begin(self, args, state, control, **kwargs):
                tracing.begin()

            def on_step_begin(self, args, state, control, **kwargs):
                tracing.begin_hf_step(state.global_step)

            def on_step_end(self, args, state, control, **kwargs):
                tracing.end_step()

            def on_train_end(self, args, state, control, **kwargs):
                tracing.end()

        return TtraceCallback()

    def attached(self) -> Session:
        trainer = self.trainer
        return attach(trainer.model_wrapped, trainer.optimizer, loss_scale=loss_scale(trainer),
                      data_parallel=degrees(trainer), **self.options)

    def begin_hf_step(self, step: int) -> None:
        if self.session is not None and self.session.active:
            self.session.tracer.set_loss_scale(loss_scale(self.trainer))  # the last step may accumulate fewer
        self.begin_step(step)
