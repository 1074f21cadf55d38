"""Part of stage 1 (record): tracing a trainer the user does not write the loop of, in one line before training.

    ttrace.attach_trainer(trainer)
    trainer.train()           # a Hugging Face transformers.Trainer (record/hf_trainer.py)
    trainer.fit(model, data)  # a Lightning Trainer (record/lightning_trainer.py)

Such a trainer builds the optimizer, wraps the model and runs the steps itself, so there is no loop to put
`with session.step(i):` around. `attach_trainer` adds a callback to it that attaches when training begins, with
what only the trainer knows (the model it wrapped, which batches each process draws, how it scales each loss),
and brackets each optimizer step (record/trainers.py).
"""

from __future__ import annotations

from typing import Any

from ttrace_core.record.hf_trainer import HFTrainerTracing
from ttrace_core.record.lightning_trainer import LightningTracing
from ttrace_core.integrations.torch_native import lightning_package
from ttrace_core.record.trainers import TRAINER_SAYS, TrainerTracing


def attach_trainer(trainer: Any, **options) -> TrainerTracing:
    """Trace the trainer's training when the script runs under a ttrace command (a no-op otherwise). `options`
    go to `attach` (include, exclude, weights, config, ...); the model, optimizer, data parallelism and loss
    scale are the trainer's own. A Lightning Trainer, or a Hugging Face Trainer (anything with `add_callback`)."""
    refused = sorted(set(options) & set(TRAINER_SAYS))
    if refused:
        raise TypeError(f"attach_trainer({', '.join(refused)}=...): the trainer says "
                        f"{'; '.join(TRAINER_SAYS[name] for name in refused)} itself; leave them out")
    if lightning_package(trainer, "Trainer") is not None:
        return LightningTracing.added_to(trainer, options)
    if callable(getattr(trainer, "add_callback", None)):
        return HFTrainerTracing.added_to(trainer, options)
    raise TypeError(f"attach_trainer: {type(trainer).__module__}.{type(trainer).__qualname__} is neither a Hugging Face "
                    "Trainer nor a Lightning Trainer; trace its loop with session = ttrace.attach(model, optimizer) "
                    "and `with session.step(i):` around each step")
