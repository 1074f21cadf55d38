"""Part of stage 1 (record): what the integrations of trainers the user does not write the loop of share
(record/hf_trainer.py, record/lightning_trainer.py; `attach_trainer` in record/trainer_attach.py picks one): the
arguments refused because the trainer says them itself, and the bracket of one optimizer step, which a
trainer's callback opens and closes.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from ttrace_core.record.session import Session
from ttrace_core.record.failures import one_sentence


TRAINER_SAYS = {"model": "the model it wrapped", "optimizer": "the optimizer it built",
                "loss_scale": "how it scales each loss", "data_parallel": "which batches each process draws"}
"""What `attach_trainer` passes to `attach` from the trainer, and so refuses from its caller."""

class TrainerTracing:
    """The session of one trainer's training (`session`: None until training begins) and the step it is in."""

    def __init__(self, trainer: Any, options: dict) -> None:
        self.trainer, self.options = trainer, options
        self.session: Session | None = None
        self._step: contextlib.AbstractContextManager | None = None
        self.step_number: int | None = None
        """The optimizer step being recorded (None between steps)."""

    def attached(self) -> Session:
        """The session `attach` gives, with what this trainer says (each integration's own)."""
        raise NotImplementedError

    def begin(self) -> None:
        """Training begins: attach, once (a second training of the same trainer would draw the weights again). If
        attaching fails, the training goes on untraced, and says so in one line."""
        if self.session is not None:
            return
        try:
            self.session = self.attached()
        except Exception as error:  # noqa: BLE001 - a tracing error must not take the training down
            self.session = Session()
            print(f"ttrace: attaching to the {type(self.trainer).__name__} failed ({one_sentence(error)}); the "
                  "training goes on untraced and this run records no step", file=sys.stderr)

    def begin_step(self, step: int) -> None:
        if self.session is None or not self.session.active:
            return
        self.end_step()
        self._step, self.step_number = self.session.step(step), step
        self._step.__enter__()

    def end_step(self, error: BaseException | None = None) -> None:
        step, self._step, self.step_number = self._step, None, None
        if step is not None:
            step.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)

    def end(self, error: BaseException | None = None) -> None:
        self.end_step(error)
        if self.session is not None:
            self.session.close()
