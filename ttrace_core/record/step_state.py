"""Part of stage 1 (record): which micro-batch and call each module boundary of one step belongs to.

Plain bookkeeping for the Tracer's hooks; no torch calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ttrace_core.format.schema import Layout, TensorKey


@dataclass(slots=True)
class StepState:
    """Which micro-batch and call each module boundary belongs to, within one step.

    The root module's forward calls are the micro-batch clock: the k-th root call of a rank is its
    local micro-batch k, and a module called while (or after) it runs belongs to it, with a call
    index counting its calls within that micro-batch (a chunked loss, a tied layer). A model given
    as chunks (virtual pipeline stages) has one clock per chunk: the interleaved schedule runs chunk
    0's forward of micro-batches 0 and 1 before chunk 1's of micro-batch 0, but each chunk's root is
    called once per micro-batch, in order. When the root is never called (a module driven alone),
    each call of a module is its next micro-batch."""

    step: int
    seq: int = 0
    root_calls: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Chunk (0 for a model in one piece) -> its root's forward calls so far this step."""
    losses: int = 0
    """Loss backwards met so far that no module's backward placed (the count is then the micro-batch clock)."""
    loss_backwards: list[set[int]] = field(default_factory=list)
    """Per loss backward running now (innermost last): the global micro-batches its module backwards belong to."""
    loss_pieces: dict[int, LossPieces] = field(default_factory=dict)
    """Global micro-batch (or NO_MICRO_BATCH for a loss summed over the step) -> the loss its backwards started from."""
    scalars: dict[tuple[str, str, str, int], float] = field(default_factory=dict)
    """(phase, fqn, slot, micro-batch) -> value of each step scalar recorded so far (a second record is checked, not kept)."""
    gradients_recorded: bool = False
    parameter_records: dict[str, int] = field(default_factory=dict)
    """Parameter slot -> how often the parameters were to be recorded under it this step (more than once: the
    optimizer stepped again inside the step; the first is kept)."""
    recorded: set[TensorKey] = field(default_factory=set)
    """Every key written this step: a step file lists a key once (a second record is a finding, the first is kept)."""
    forward_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_in_micro_batch: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    pending_forward: dict[str, list[tuple[int, int] | None]] = field(default_factory=lambda: defaultdict(list))
    pending_backward: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    no_grad_calls: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    """Per module, its calls whose forward ran with autograd off: a reentrant activation checkpoint's first pass
    (torch.utils.checkpoint with use_reentrant=True, megatron's recompute), whose backward follows a second forward
    that runs inside the backward (`recomputed_call`)."""
    forward_layouts: dict[tuple[str, int, int, str], Layout] = field(default_factory=dict)
    unmapped_forward: set[tuple[str, int, int, str]] = field(default_factory=set)
    """Forward tensors left out with a finding (their layout is unknown): their gradients are left out too."""
    converted_outputs: dict[str, list[Any]] = field(default_factory=dict)
    """Per module, its outputs as DTensors before a parallel style turned them into local tensors."""

    def next_forward_call(self, fqn: str, chunk: int = 0) -> tuple[int, int]:
        """(local micro-batch, call index) of a forward call of `fqn`, a module of `chunk`, that starts now."""
        local = self.root_calls[chunk] - 1 if self.root_calls.get(chunk) else self.forward_calls[fqn]
        self.forward_calls[fqn] += 1
        call = self.calls_in_micro_batch[(fqn, local)]
        self.calls_in_micro_batch[(fqn, local)] += 1
        return local, call

    def last_root_micro_batch(self) -> int | None:
        """The local micro-batch of the last chunk's latest root call (the one a loss follows); None when no
        root was called."""
        return self.root_calls[max(self.root_calls)] - 1 if self.root_calls else None

    def recomputed_call(self, fqn: str) -> tuple[int, int] | None:
        """The call of `fqn` a forward recomputed during backward repeats, among those that ran with autograd off:
        the earliest micro-batch's first (a checkpointed segment is recomputed in the order of its forward)."""
        calls = self.no_grad_calls.get(fqn)
        if not calls:
            return None
        chosen = min(calls)
        calls.remove(chosen)
        return chosen

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




@dataclass(slots=True)
class LossPieces:
    """The loss of one micro-batch, from the one-element tensors its backwards start from.

    A loss may start several backwards per micro-batch: a chunked cross entropy backpropagates each
    chunk (the pieces add up to the loss), and may then start one more backward from their sum, through
    the trunk (torchtitan's ChunkedLossWrapper: 8 chunk backwards, then the total). A piece equal to the
    sum of the pieces before it (up to their rounding) is such a total: it covers them and is not added.
    The loss is then the pieces' sum, whichever way the code split it."""

    seq: int
    """Where in the step the first piece started (the loss is recorded there, in execution order)."""
    dtype: Any
    total: float = 0.0
    magnitude: float = 0.0
    """Sum of the pieces' absolute values: the scale their rounding is judged on."""
    num_pieces: int = 0

    def add(self, value: float, unit_roundoff: float) -> None:
        if self.num_pieces and abs(value - self.total) <= 2 * self.num_pieces * unit_roundoff * self.magnitude:
            self.total = value  # the sum of the pieces so far, started again from the trunk
            return
        self.total += value
        self.magnitude += abs(value)
        self.num_pieces += 1
