"""record/step_state.py: which micro-batch and call each module boundary of one step belongs to.

tests/core/record/test_step_scalars.py pins the loss bookkeeping (LossPieces, which micro-batch a loss is).
Here: the micro-batch clock (the root's forward calls, one clock per chunk, else each module's own calls),
call indices within a micro-batch, the last root micro-batch a loss follows, and which forward call a
backward belongs to. StepState itself is driven by hand in tables; then the real Tracer on the tiny MLP
labels what a module driven alone and forwards run ahead of their backwards record."""

import pytest
import torch

from ttrace_core.format.reader import RunReader
from ttrace_core.record.step_state import StepState
from ttrace_core.record.tracer import Tracer, TracerConfig

from tests.support.tiny_mlp import mlp


def _run(events: list[tuple]) -> list[tuple[int, int]]:
    """Drive a StepState: ("root", chunk) is a root's forward call; ("call", fqn, chunk) a module's forward
    call, whose (local micro-batch, call) is returned in order."""
    state, seen = StepState(step=0), []
    for event in events:
        if event[0] == "root":
            state.root_calls[event[1]] += 1
        else:
            seen.append(state.next_forward_call(event[1], event[2]))
    return seen


@pytest.mark.parametrize("events, expected", [
    # The root never called (a module driven alone): each call of a module is its next micro-batch.
    ([("call", "a", 0), ("call", "a", 0), ("call", "b", 0), ("call", "a", 0)], [(0, 0), (1, 0), (0, 0), (2, 0)]),
    # The root's calls are the clock; modules called while it runs belong to it.
    ([("root", 0), ("call", "a", 0), ("call", "b", 0), ("root", 0), ("call", "a", 0), ("call", "b", 0)],
     [(0, 0), (0, 0), (1, 0), (1, 0)]),
    # A module called twice in one micro-batch (a tied layer, a chunked loss): its call index counts them.
    ([("root", 0), ("call", "head", 0), ("call", "head", 0), ("root", 0), ("call", "head", 0)],
     [(0, 0), (0, 1), (1, 0)]),
    # ... also after the root returned (a loss head called outside the model's forward).
    ([("root", 0), ("call", "a", 0), ("call", "loss", 0), ("call", "loss", 0), ("root", 0), ("call", "loss", 0)],
     [(0, 0), (0, 0), (0, 1), (1, 0)]),
    # Interleaved virtual stages: chunk 0 runs micro-batches 0 and 1 before chunk 1 runs its micro-batch 0.
    ([("root", 0), ("call", "0.a", 0), ("root", 0), ("call", "0.a", 0), ("root", 1), ("call", "1.a", 1),
      ("root", 0), ("call", "0.a", 0), ("root", 1), ("call", "1.a", 1)],
     [(0, 0), (1, 0), (0, 0), (2, 0), (1, 0)]),
    # A chunk whose root was not called yet counts its module's own calls, whatever the other chunk's clock.
    ([("root", 0), ("root", 0), ("call", "1.a", 1), ("call", "1.a", 1)], [(0, 0), (1, 0)]),
], ids=["no root", "root clock", "calls within a micro-batch", "after the root returned",
        "interleaved chunks", "a chunk without root calls"])
def test_the_micro_batch_and_call_of_a_forward(events, expected):
    assert _run(events) == expected


@pytest.mark.parametrize("root_calls, expected", [
    ({}, None),
    ({0: 1}, 0),
    ({0: 3}, 2),
    ({0: 2, 1: 1}, 0),  # the last chunk's latest root call, not the latest in time
    ({1: 4, 0: 5}, 3),
], ids=["no root called", "one", "three", "chunk 1 behind chunk 0", "insertion order does not matter"])
def test_last_root_micro_batch_is_the_last_chunks(root_calls, expected):
    state = StepState(step=0)
    state.root_calls.update(root_calls)
    assert state.last_root_micro_batch() == expected


@pytest.mark.parametrize("pending, order", [
    ([(0, 0), (1, 0)], [(0, 0), (1, 0)]),  # sequential accumulation and GPipe: in the order of the forwards
    ([(1, 0), (0, 0)], [(0, 0), (1, 0)]),  # the earliest micro-batch first, whatever order they were queued in
    ([(0, 0), (0, 1), (0, 2)], [(0, 2), (0, 1), (0, 0)]),  # calls within a micro-batch in reverse
    ([(0, 0), (2, 0), (0, 1), (2, 1), (4, 0)], [(0, 1), (0, 0), (2, 1), (2, 0), (4, 0)]),  # data parallel: global ids
], ids=["in order", "queued out of order", "calls reversed", "global micro-batches"])
def test_a_backward_belongs_to_the_earliest_micro_batchs_latest_call(pending, order):
    state = StepState(step=0)
    state.pending_backward["a"].extend(pending)
    assert state.next_backward_call("a", pop=False) == order[0]
    assert state.pending_backward["a"] == pending  # a peek takes nothing
    assert [state.next_backward_call("a", pop=True) for _ in pending] == order
    assert state.next_backward_call("a", pop=True) is None and state.next_backward_call("b", pop=False) is None


def test_a_new_step_state_starts_every_clock_at_zero():
    state = StepState(step=7)
    assert (state.step, state.seq, state.losses, state.gradients_recorded) == (7, 0, 0, False)
    assert state.next_forward_call("a") == (0, 0) and state.last_root_micro_batch() is None
    assert StepState(step=8).forward_calls == {}  # nothing shared between instances


def _forward_keys(run_dir, fqn: str) -> set[tuple[int, int]]:
    with RunReader(run_dir) as reader:
        return {(k.micro_batch, k.call) for k in reader.keys() if k.fqn == fqn and k.slot == "output.0"}


def test_a_module_driven_alone_records_each_call_as_its_next_micro_batch(tmp_path):
    """The root (the Sequential) is never called: each call of "2" is one micro-batch, on data-parallel rank 1
    the global ids 1, 3, 5."""
    model = mlp()
    tracer = Tracer(tmp_path, model, role="reference", config=TracerConfig(data_parallel_rank=1, data_parallel_size=2))
    with tracer.step(0):
        for _ in range(3):
            model[2](torch.randn(3, 8)).sum().backward()
    tracer.close()
    assert _forward_keys(tmp_path, "2") == {(1, 0), (3, 0), (5, 0)} and _forward_keys(tmp_path, "0") == set()


def test_forwards_run_ahead_of_their_backwards_pair_each_backward_with_its_own_micro_batch(tmp_path):
    """GPipe's order on the tiny MLP: every forward, then every backward. The gradient recorded for micro-batch k
    is the one of micro-batch k's loss: out.square().sum() has the gradient 2 * out."""
    model = mlp()
    tracer = Tracer(tmp_path, model, role="reference")
    with tracer.step(0):
        outputs = [model(torch.randn(3, 4, generator=torch.Generator().manual_seed(k))) for k in range(3)]
        for output in outputs:
            output.square().sum().backward()
    tracer.close()
    with RunReader(tmp_path) as reader:
        grads = {k.micro_batch: reader.read(ms[0]) for k, ms in reader.index.items()
                 if (k.phase, k.fqn, k.slot) == ("backward", "2", "grad_output.0")}
    assert sorted(grads) == [0, 1, 2]
    for micro_batch, output in enumerate(outputs):
        assert torch.equal(grads[micro_batch], 2 * output.detach())
