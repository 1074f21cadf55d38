"""Part of stage 1 (record): the layout in effect for a recorded tensor that does not describe its own.

Input: the Tracer's declarations (declarations.py), its step state (step_state.py), the tensor's key and
its local value. Output: the `Layout` recorded with it, which canonicalize reads to place the shard in
its logical tensor. In order: a declared layout; the layout a parallel style's output had as a DTensor
before it was made local; the layout of the plain shard it was produced from, for a module that only
passes a shard on (producers.py); a gradient's forward tensor's layout, with a partial sum's gradient
replicated (canonicalize/placements.py); else the whole tensor, replicated.

Declared layouts are resolved once per (module, slot, local shape) and kept until the next declaration
(declarations.py). The others depend on the call, so they are looked up each time; the layout records
themselves are frozen, so a record built once is handed out again (`replicated`, `with_flat_range`).
"""

from __future__ import annotations

import functools

import msgspec
import torch

from ttrace_core.canonicalize.placements import gradient_placement
from ttrace_core.format.naming import PARAMETER_PHASES
from ttrace_core.format.schema import Layout, TensorKey
from ttrace_core.integrations.dtensor import layout_of_converted_output
from ttrace_core.record.declarations import Declarations, UnknownLayoutError
from ttrace_core.record.producers import ProducerLayouts
from ttrace_core.record.step_state import StepState


# Layouts are frozen records: the same one is handed out again instead of being built (and validated)
# on every recorded tensor. Pure functions of their arguments, so nothing ever needs invalidating.

@functools.lru_cache(maxsize=4096)
def replicated(shape: tuple[int, ...]) -> Layout:
    """The default layout: the whole tensor, on every rank that records it."""
    return Layout.replicated(shape)


@functools.lru_cache(maxsize=4096)
def with_flat_range(layout: Layout, flat_range: tuple[int, int]) -> Layout:
    return msgspec.structs.replace(layout, flat_range=flat_range)


@functools.lru_cache(maxsize=4096)
def gradient_layout(layout: Layout) -> Layout:
    """The layout of the gradient of a tensor laid out as `layout`: the same, but R where it is P(sum) and P(sum)
    where it is P(avg) (canonicalize/placements.py)."""
    placements = tuple(gradient_placement(p) for p in layout.placements)
    return layout if placements == tuple(layout.placements) else msgspec.structs.replace(layout, placements=placements)


@functools.lru_cache(maxsize=1024)
def has_partial(placements: tuple[str, ...]) -> bool:
    return any(p.startswith("P(") for p in placements)


def plain_layout(declarations: Declarations, state: StepState | None, key: TensorKey, local: torch.Tensor,
                 producers: ProducerLayouts | None = None, value: torch.Tensor | None = None) -> Layout:
    """The layout of a tensor that does not describe its own. A declared one is resolved once per
    (module, slot, local shape) and kept until the next declaration (declarations.py); the others
    depend on the call (a converted output, the shard it was produced from, a gradient's forward
    tensor) and are looked up each time. `value`: the tensor as the module saw it (`local` may be a
    detached alias), matched by storage against `producers`."""
    shape = tuple(local.shape)
    if key.phase in PARAMETER_PHASES and (held := declarations.held.get(key.fqn)) is not None:
        return held
    if (declared := declarations.layout(key.fqn, key.slot, shape)) is not None:
        return declared
    if (converted := _converted_layout(state, key, local)) is not None:
        return converted
    if producers is not None and state is not None and \
            (produced := producers.layout_of(state, key, local if value is None else value)) is not None:
        return produced
    if key.slot.startswith("grad_") and state is not None:
        # The gradient of a tensor is laid out like the tensor itself, but replicated where it is a partial sum.
        forward_slot = key.slot.removeprefix("grad_")
        if (key.fqn, key.micro_batch, key.call, forward_slot) in state.unmapped_forward:
            raise UnknownLayoutError(f"{key.fqn} {key.slot}: not recorded, it is the gradient of {forward_slot}, "
                                     "whose layout is unknown (see that tensor's finding)")
        inherited = state.forward_layouts.get((key.fqn, key.micro_batch, key.call, forward_slot))
        if inherited is not None and inherited.global_shape and len(inherited.global_shape) == local.dim():
            return gradient_layout(inherited)
    return replicated(shape)


def _converted_layout(state: StepState | None, key: TensorKey, local: torch.Tensor) -> Layout | None:
    if key.phase != "forward" or not key.slot.startswith("output.") or state is None:
        return None
    before = state.converted_outputs.get(key.fqn) or []
    index = int(key.slot.removeprefix("output."))
    return layout_of_converted_output(before[index], local) if index < len(before) and before[index] is not None else None
