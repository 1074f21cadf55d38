"""Part of stage 1 (record): which micro-batch and call each module boundary of one step belongs to.

Plain bookkeeping for the Tracer's hooks; no torch calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ttrace_core.format.schema import Layout


@dataclass(slots=True)
class StepState:
    """Which micro-batch and call each module boundary belongs to, within one step.

    The root module's forward calls are the micro-batch clock: the k-th root call of a rank is its
    local micro-batch k, and a module called while (or after) it runs belongs to it, with a call
    index counting its calls within that micro-batch (a chunked loss, a tied layer). When the root
    is never called (a module driven alone), each call of a module is its next micro-batch."""

    step: int
    seq: int = 0
    root_calls: int = 0
    losses: int = 0
    """Losses recorded so far: the next one is this local micro-batch's."""
    gradients_recorded: bool = False
    forward_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_in_micro_batch: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    pending_forward: dict[str, list[tuple[int, int] | None]] = field(default_factory=lambda: defaultdict(list))
    pending_backward: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    forward_layouts: dict[tuple[str, int, int, str], Layout] = field(default_factory=dict)
    unmapped_forward: set[tuple[str, int, int, str]] = field(default_factory=set)
    """Forward tensors left out with a finding (their layout is unknown): their gradients are left out too."""
    converted_outputs: dict[str, list[Any]] = field(default_factory=dict)
    """Per module, its outputs as DTensors before a parallel style turned them into local tensors."""

    def next_forward_call(self, fqn: str) -> tuple[int, int]:
        """(local micro-batch, call index) of a forward call of `fqn` that starts now."""
        local = self.root_calls - 1 if self.root_calls else self.forward_calls[fqn]
        self.forward_calls[fqn] += 1
        call = self.calls_in_micro_batch[(fqn, local)]
        self.calls_in_micro_batch[(fqn, local)] += 1
        return local, call

    def next_backward_call(self, fqn: str, *, pop: bool) -> tuple[int, int] | None:
        """The forward call a backward of `fqn` belongs to: micro-batches run their backward in the order
        of their forwards (sequential accumulation, GPipe, 1F1B); calls within one micro-batch in reverse."""
        pending = self.pending_backward[fqn]
        if not pending:
            return None
        earliest = min(micro_batch for micro_batch, _ in pending)
        chosen = max((entry for entry in pending if entry[0] == earliest), key=lambda entry: entry[1])
        if pop:
            pending.remove(chosen)
        return chosen


