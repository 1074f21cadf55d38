"""megatron-core's MoE experts, traced by token (record/token_rows.py) through megatron's own dispatcher.

Each expert of a `SequentialMLP` (`mlp.experts.local_experts.<i>`, named by its global expert index
under expert parallelism) is a routed root: its activations, and those of its linear layers, are
recorded as the tokens of each source micro-batch in token order. To know which token each row
holds, the dispatcher that permuted the hidden states is run a second time, on a copy of itself, over
one column of token ids: the same `dispatch_preprocess`, `token_dispatch` and `dispatch_postprocess`
(megatron's permute, all-to-all or all-gather, and sort by local expert) with the same routing map
and probabilities. The ids then sit exactly where the hidden states did, whatever the dispatcher
(allgather or alltoall), the expert-parallel and expert-tensor-parallel sizes, or sequence parallelism.
The copy's collectives run on every rank of the dispatcher's groups, in the same order (the hook runs
in every rank's dispatch of a recorded step), and change nothing the training computes: megatron's
dispatchers keep their state on the instance, and the copy writes only its own.

A token's id is `micro_batch * S * B + s * B + b` for position (s, b) of its micro-batch's [S, B]
hidden states: the MoE layer's input layout (sequence parallelism shards s) gives each rank's s.

Grouped experts (`GroupedMLP`, `TEGroupedMLP`) have no per-expert module: their activations stay
untraced (`untraceable_expert_activations`), their weights and gradients are compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ttrace_core.canonicalize.token_rows import TokenRows, token_ids
from ttrace_core.integrations.torch_native import micro_batches_of_group

SEQUENTIAL_EXPERTS = "SequentialMLP"

# Expert boundaries, over the expert tensor-parallel mesh (class name -> {slot glob: placement}).
# An expert's tokens are whole on every expert-TP rank (the dispatcher gathered them); its linear_fc2
# does not reduce (megatron's explicit expert communication: the combine's reduce-scatter does), so
# its output is a partial sum, and so is the gradient its linear_fc1 hands back to the tokens.
EXPERT_LAYOUTS: dict[str, dict[str, str]] = {
    "MLP": {"input.*": "R", "output.0": "P(sum)", "output.1": "R", "grad_output.*": "R", "grad_input.*": "P(sum)"},
    "ColumnParallelLinear": {"input.*": "R", "output.0": "S(-1)", "output.1": "S(0)", "grad_input.*": "P(sum)"},
    "RowParallelLinear": {"input.*": "S(-1)", "output.0": "P(sum)", "output.1": "R", "grad_output.*": "R"},
}


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(local fqn, module) of every megatron MoELayer."""
    return [(fqn, m) for fqn, m in model.named_modules() if type(m).__name__ == "MoELayer"]


def expert_roots(model: nn.Module) -> list[str]:
    """Local fqns of every expert of a SequentialMLP: the modules traced by token."""
    roots = []
    for fqn, layer in moe_layers(model):
        experts = getattr(layer, "experts", None)
        if type(experts).__name__ == SEQUENTIAL_EXPERTS:
            roots += [f"{fqn}.experts.local_experts.{i}" for i in range(len(experts.local_experts))]
    return roots


def untraceable_expert_activations(model: nn.Module) -> tuple[str, ...]:
    """Activation exclusions for megatron's experts: every experts container (its inputs mix the tokens
    of all its local experts; each expert is traced on its own), and all of grouped experts."""
    grouped = any(type(getattr(layer, "experts", None)).__name__ != SEQUENTIAL_EXPERTS for _, layer in moe_layers(model))
    return ("*.mlp.experts", "*.mlp.experts.*") if grouped else ("*.mlp.experts",)


def is_inside_expert(fqn: str) -> bool:
    return ".experts.local_experts." in f"{fqn}."


def expert_layout(class_names: list[str], expert_tp_size: int) -> dict[str, str] | None:
    """The boundary layout of a module inside an expert, by the nearest known class; a partial sum over
    an expert-TP mesh of one rank is just the value."""
    known = next((name for name in class_names if name in EXPERT_LAYOUTS), None)
    if known is None:
        return None
    layout = EXPERT_LAYOUTS[known]
    return layout if expert_tp_size > 1 else {slot: "R" if p == "P(sum)" else p for slot, p in layout.items()}


@dataclass(slots=True)
class _Dispatch:
    """What one MoE layer's dispatch of the current forward was given."""

    hidden_shape: tuple[int, ...]
    routing_map: torch.Tensor
    probs: torch.Tensor


class ExpertTokenTracing:
    """Watches the token dispatcher of every MoE layer with sequential experts and tells the tracer which
    token each row of every expert call holds."""

    def __init__(self, tracer, model: nn.Module) -> None:
        self._tracer = tracer
        self._undo: list[Callable[[], None]] = []
        roots = []
        for fqn, layer in moe_layers(model):
            experts = getattr(layer, "experts", None)
            if type(experts).__name__ != SEQUENTIAL_EXPERTS:
                continue
            local_roots = [f"{fqn}.experts.local_experts.{i}" for i in range(len(experts.local_experts))]
            global_roots = [tracer.global_fqn(root) for root in local_roots]
            roots += global_roots
            self._watch(layer.token_dispatcher, tracer.global_fqn(fqn), global_roots)
        tracer.route_tokens(roots)

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _watch(self, dispatcher, layer_fqn: str, experts: list[str]) -> None:
        tracer = self._tracer
        preprocess, postprocess = dispatcher.dispatch_preprocess, dispatcher.dispatch_postprocess
        seen: list[_Dispatch] = []

        def dispatch_preprocess(hidden_states, routing_map, probs):
            if tracer.recording():
                seen[:] = [_Dispatch(tuple(hidden_states.shape), routing_map, probs.detach())]
            return preprocess(hidden_states, routing_map, probs)

        def dispatch_postprocess(hidden_states, probs):
            result = postprocess(hidden_states, probs)
            if seen:
                given = seen.pop()
                tracer.guarded(lambda: self._expect_rows(dispatcher, preprocess.__func__, layer_fqn, experts, given,
                                                         result[1]))
            return result

        dispatcher.dispatch_preprocess = dispatch_preprocess
        dispatcher.dispatch_postprocess = dispatch_postprocess

        def undo() -> None:
            del dispatcher.dispatch_preprocess, dispatcher.dispatch_postprocess
        self._undo.append(undo)

    def _expect_rows(self, dispatcher, preprocess, layer_fqn: str, experts: list[str], given: _Dispatch,
                     tokens_per_expert: torch.Tensor) -> None:
        tracer = self._tracer
        entry = tracer.current_forward_call(layer_fqn)
        if entry is None or not tracer.recording():
            return
        micro_batch, call = entry
        layout = tracer.state.forward_layouts.get((layer_fqn, micro_batch, call, "input.0"))
        ids, tokens_per_micro_batch = token_ids(micro_batch, given.hidden_shape, layout)
        micro_batches = micro_batches_of_group(micro_batch, dispatcher.tp_ep_group)
        shadow = copy.copy(dispatcher)
        shadow.shared_experts = None  # its communication belongs to the real dispatch
        with torch.no_grad(), _disable_current_modes():  # invisible to a dispatch mode caching ops (checkpointing)
            # ids + 1: a row the dispatcher pads (drop-and-pad capacity) holds 0 and reads back as -1
            hidden, probs = preprocess(shadow, (ids + 1).to(torch.float64).unsqueeze(-1), given.routing_map, given.probs)
            hidden, probs = type(dispatcher).token_dispatch(shadow, hidden, probs)
            hidden, _, _ = type(dispatcher).dispatch_postprocess(shadow, hidden, probs)
        permuted = hidden.reshape(-1).round().to(torch.int64) - 1
        counts = [int(n) for n in torch.as_tensor(tokens_per_expert).tolist()]
        if sum(counts) != permuted.numel():
            raise ValueError(f"{layer_fqn}: the dispatcher gave its experts {sum(counts)} tokens but the token ids "
                             f"dispatched the same way are {permuted.numel()}: expert activations of this call are "
                             "recorded as they are")
        for expert, expert_ids in zip(experts, torch.split(permuted, counts)):
            tracer.routed.expect(expert, micro_batch, call, TokenRows(
                ids=expert_ids.contiguous(), tokens_per_micro_batch=tokens_per_micro_batch, micro_batches=micro_batches))
