"""Hugging Face Transformers adapter: layouts of a model that transformers itself parallelized.

Produces layout metadata (stage 1, record) for `attach`, from the model's own TP / EP plan: a model
loaded with `from_pretrained(..., distributed_config=DistributedConfig(tp_size=...))` (or the older
`tp_plan="auto"`) runs each planned module through a parallel style that replaces its `forward`.
In transformers 5.24 the parameters are DTensors (they describe themselves), but a style converts
its output to a plain local tensor *inside* the replaced forward, so a module hook sees a local
shard that says nothing of its layout. The style says it, and this adapter reads it:

    style (registered name)            input.0      output.0     parameters (when plain)
    colwise                            R            S(last)      weight, bias S(ndim-2)
    colwise_rep, colwise_gather_output R            R            as colwise
    rowwise                            S(last)      R            weight S(last), bias R
    rowwise_rep, rowwise_split_input   R            R            as rowwise
    packed_colwise                     R            SS(last, f)  SS(ndim-2, f); a vector S(0)
    packed_rowwise (a parameter style) -            -            SS(last, f); a vector R
    embedding_rowwise / _colwise       R            R            S(shard_dim)
    sequence_parallel                  S(seq)       S(seq)       R
    all_reduce, mla_kv_a_proj          -, R         R            -
    moe_tp_experts                     R            R            - (its parameters are planned by name;
                                                                  a module inside it, its activation, holds
                                                                  the intermediate features' S(last))
    moe_identity_expert                R            P(sum)       -   (input / tp, summed by the experts)
    replicated_with_grad_allreduce,    passes its input's layout on (record/producers.py)
      local_params, replicate
    grouped_gemm (EP)                  -            -            S(0) on the ep mesh
    ep_dispatch_experts (EP)           -            -            -   (its tokens are this rank's own batch)
                                                                  (the modules inside it compute on the rows
                                                                  its EP implementation brought them: their
                                                                  activations are left out)

"S(last)" is the tensor's last dim: rank 1 of 2 of a colwise q_proj with 64 output features holds
features 32:64 of every token. A module no style converts (an activation, Qwen3's q_norm) gets its
layout from the shard it was given (record/producers.py), never from a rule here. A style this table
does not know (a newer transformers, a user's own registered style) is never guessed: its module's
plain inputs and outputs are left out with a finding naming the style.

transformers is imported only when a model is already one of its own (`sys.modules`): ttrace
imports without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ttrace_core.canonicalize.placements import global_shape_from_local
from ttrace_core.errors import LayoutError
from ttrace_core.format.naming import in_subtree
from ttrace_core.format.schema import Layout
from ttrace_core.integrations.dtensor import mesh_description, placement_str

Placement = "str | Callable[[tuple[int, ...]], str]"
"""A placement string, or a rule of the local shape (for "the last dim", whatever the rank)."""


def _last_dim(shape: tuple[int, ...]) -> str:
    return f"S({len(shape) - 1})"


def _on_dim(dim: int, kind: str = "S", split_factor: int | None = None) -> Callable[[tuple[int, ...]], str]:
    """A rule placing `kind` on `dim` of the local shape (a negative dim counts from the end)."""
    def rule(shape: tuple[int, ...]) -> str:
        normalized = dim % len(shape) if shape else 0
        return f"S({normalized})" if kind == "S" else f"{kind}({normalized},{split_factor})"
    return rule


def _dtensor_placement(placement) -> Placement:
    """A DTensor placement of a style's attribute, with a negative shard dim as a rule."""
    text = placement_str(placement)
    if text.startswith("S(-"):
        return _on_dim(int(text[2:-1]))
    return text


# ---- what each parallel style does at its module's boundary -------------------------------------

def _colwise(style) -> dict[str, Placement]:
    return {"input.0": "R", **({"output.0": _dtensor_placement(style.output_layouts)} if style.use_local_output else {})}


def _rowwise(style) -> dict[str, Placement]:
    return {"input.0": _dtensor_placement(style.input_layouts),
            **({"output.0": _dtensor_placement(style.output_layouts)} if style.use_local_output else {})}


def _packed_colwise(style) -> dict[str, Placement]:
    return {"input.0": "R", **({"output.0": _on_dim(-1, "SS", style.split_factor)} if style.use_local_output else {})}


def _sequence_parallel(style) -> dict[str, Placement]:
    sequence = _on_dim(style.sequence_dim)
    return {"input.0": sequence, **({"output.0": sequence} if style.use_local_output else {})}


def _replicated_in_and_out(style) -> dict[str, Placement]:
    return {"input.0": "R", "output.0": "R"} if getattr(style, "use_local_output", True) else {"input.0": "R"}


BOUNDARIES: dict[str, Callable[[object], dict[str, Placement]]] = {
    "ColwiseParallel": _colwise,
    "RowwiseParallel": _rowwise,
    "PackedColwiseParallel": _packed_colwise,
    "SequenceParallel": _sequence_parallel,
    "EmbeddingParallel": _replicated_in_and_out,
    "MlaKvAProjParallel": _replicated_in_and_out,
    "MoeExpertsParallel": _replicated_in_and_out,
    "AllReduceParallel": lambda style: {"output.0": "R"},
    # Its input divided by the TP size, which the experts' all-reduce sums back: a partial sum.
    "MoeIdentityParallel": lambda style: {"input.0": "R", "output.0": "P(sum)"},
    # Forward unchanged (parameter styles, or local parameters in a module whose boundaries stay as they
    # were): what it returns has the layout of what it was given (record/producers.py).
    "PackedRowwiseParallel": lambda style: {},
    "ReplicatedWithGradAllReduce": lambda style: {},
    "LocalParamsParallel": lambda style: {},
    "TensorParallelLayer": lambda style: {},
    "MoEParamShard": lambda style: {},
    # The experts run on this rank's own batch and return its tokens' outputs: data parallelism, no layout.
    "EpDispatchExpertsParallel": lambda style: {},
}
"""Parallel style class -> the placements its module's plain boundary tensors have. Looked up along the
style's MRO, so a user's subclass of ColwiseParallel is read as one."""


PARAMETERS: dict[str, Callable[[object, str, int], str]] = {
    "ColwiseParallel": lambda style, name, ndim: f"S({max(ndim - 2, 0)})",
    "RowwiseParallel": lambda style, name, ndim: "R" if name.endswith("bias") else f"S({ndim - 1})",
    "PackedColwiseParallel": lambda style, name, ndim: f"SS({ndim - 2},{style.split_factor})" if ndim >= 2 else "S(0)",
    "PackedRowwiseParallel": lambda style, name, ndim: f"SS({ndim - 1},{style.split_factor})" if ndim >= 2 else "R",
    "EmbeddingParallel": lambda style, name, ndim: f"S({style.shard_dim})",
    "MoEParamShard": lambda style, name, ndim: placement_str(style.placement),
    **{name: (lambda style, name, ndim: "R") for name in (
        "SequenceParallel", "ReplicatedWithGradAllReduce", "MlaKvAProjParallel", "AllReduceParallel",
        "MoeExpertsParallel", "MoeIdentityParallel", "LocalParamsParallel", "TensorParallelLayer",
        "EpDispatchExpertsParallel")},
}
"""Parallel style class -> the placement of a parameter it shards (name, ndim), for a plain parameter; in
transformers 5.24 they are DTensors and say it themselves."""


def _known(table: dict, style: object):
    for cls in type(style).__mro__:
        if cls.__name__ in table:
            return table[cls.__name__]
    return None


def boundary_placements(style: object) -> dict[str, Placement] | None:
    """The placements of a planned module's plain boundary tensors, by slot; None for an unknown style."""
    rule = _known(BOUNDARIES, style)
    return None if rule is None else rule(style)


def parameter_placement(style: object, name: str, ndim: int) -> str | None:
    """The placement of a plain parameter the style sharded; None for an unknown style."""
    rule = _known(PARAMETERS, style)
    return None if rule is None else rule(style, name, ndim)


# ---- the model's plan, as transformers applied it ----------------------------------------------

def _transformers_loaded() -> bool:
    return sys.modules.get("transformers") is not None


def _distributed_config(model: nn.Module):
    config = getattr(model, "config", None)
    return getattr(config, "distributed_config", None)


def is_transformers_parallel_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel that transformers itself sharded with tensor or expert parallelism."""
    if not _transformers_loaded():
        return False
    from transformers import PreTrainedModel

    distributed = _distributed_config(model)
    return (isinstance(model, PreTrainedModel) and getattr(model, "_mesh_manager", None) is not None
            and distributed is not None and (distributed.tp_size > 1 or getattr(distributed, "ep_size", 1) > 1))


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One module or parameter of the model and the parallel style transformers applied to it."""

    name: str
    """Its name in `model.named_modules()` / `named_parameters()`."""
    style_name: str
    style: object
    mesh: object
    """The DeviceMesh the style ran on (the tp mesh, or the ep mesh for EP styles)."""


@dataclass(frozen=True, slots=True)
class AppliedPlan:
    modules: tuple[PlannedTensor, ...]
    parameters: tuple[PlannedTensor, ...]
    expert_intermediates: tuple[tuple[str, object], ...] = ()
    """(module name, tp mesh) of the modules inside tensor-parallel experts (their activation), which
    compute on each expert's intermediate features between the colwise gate_up and the rowwise down
    projection: this rank's share of them, its last dim."""

    @property
    def expert_parallel_internals(self) -> tuple[str, ...]:
        """Globs of the modules inside expert-parallel experts (`ep_dispatch_experts`): they run this rank's
        experts on the rows its EP implementation brought them (the tokens routed here from every rank, or
        the whole batch with the other ranks' routes masked), which no layout maps onto the reference's
        tokens. Their activations are left out (tracer `exclude_activations`, said in compare's note); the
        experts module's own input and output are this rank's batch and stay compared, and so do the
        experts' weights and gradients (DTensors, `S(0)` on the ep mesh)."""
        return tuple(f"{p.name}.?*" for p in self.modules if _known({"EpDispatchExpertsParallel": True}, p.style))


def applied_plan(model: nn.Module) -> AppliedPlan:
    """The modules and parameters transformers parallelized, each with its style, resolved as transformers
    resolves them (its own rule matching): EP rules win over TP rules on the experts and below them."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, _get_parameter_plan

    distributed = _distributed_config(model)
    plans = []
    if getattr(distributed, "ep_size", 1) > 1 and model.ep_plan:
        plans.append((dict(model.ep_plan), model._mesh_manager.get_mesh("ep")))
    if distributed.tp_size > 1 and model.tp_plan:
        plans.append((dict(model.tp_plan), model._mesh_manager.get_mesh("tp")))
    modules, parameters, claimed = [], [], []
    for module_name, module in model.named_modules():
        for plan, mesh in plans:
            if any(in_subtree(module_name, c) for c, m in claimed if m is not mesh):
                continue  # an EP module's children keep no TP rule
            if (style_name := _get_parameter_plan(module_name, plan, is_weight=False)) is not None:
                modules.append(PlannedTensor(module_name, style_name, ALL_PARALLEL_STYLES[style_name], mesh))
                claimed.append((module_name, mesh))
                break
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            for plan, mesh in plans:
                if any(in_subtree(name, c) for c, m in claimed if m is not mesh):
                    continue
                if (style_name := _get_parameter_plan(name, plan, is_weight=True)) is not None:
                    parameters.append(PlannedTensor(name, style_name, ALL_PARALLEL_STYLES[style_name], mesh))
                    break
    return AppliedPlan(tuple(modules), tuple(parameters), _expert_intermediates(model, modules, parameters))


def _expert_intermediates(model: nn.Module, modules: list[PlannedTensor],
                          parameters: list[PlannedTensor]) -> tuple[tuple[str, object], ...]:
    """The unplanned modules inside a `moe_tp_experts` module whose parameters the plan shards colwise
    (gate_up) and rowwise (down): in between, the experts hold their intermediate features' shard."""
    planned = {p.name for p in modules}
    found = []
    for experts in (p for p in modules if _known({"MoeExpertsParallel": True}, p.style)):
        kinds = {_known({"ColwiseParallel": "col", "PackedColwiseParallel": "col", "RowwiseParallel": "row"}, p.style)
                 for p in parameters if in_subtree(p.name, experts.name)}
        if {"col", "row"} <= kinds:
            found += [(f"{experts.name}.{name}", experts.mesh) for name, _ in model.get_submodule(experts.name).named_modules()
                      if name and f"{experts.name}.{name}" not in planned]
    return tuple(found)


# ---- layouts ------------------------------------------------------------------------------------

def parameter_layout(plan: AppliedPlan, name: str, param: torch.Tensor) -> Layout | None:
    """The layout of a plain parameter that a style sharded (DTensors carry their own: None), so that
    `attach` draws it in full logical shape and slices it the same way."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return None
    planned = next((p for p in plan.parameters if p.name == name), None)
    if planned is None:
        return None
    placement = parameter_placement(planned.style, name, param.dim())
    if placement is None or placement == "R":
        return None
    mesh_shape, coordinate, names = mesh_description(planned.mesh)
    return Layout(global_shape=global_shape_from_local(tuple(param.shape), mesh_shape, (placement,)),
                  mesh_shape=mesh_shape, coordinate=coordinate, placements=(placement,), mesh_axis_names=names)


def _unknown_style(planned: PlannedTensor) -> Callable[[tuple[int, ...]], str]:
    def rule(shape: tuple[int, ...]) -> str:
        raise LayoutError(
            f"{planned.name}: not recorded, transformers runs it through the parallel style {planned.style_name!r} "
            f"({type(planned.style).__name__}), whose layouts ttrace does not know; declare them with "
            "session.declare(fqn, slot, placements, mesh)")
    return rule


def declarations(plan: AppliedPlan) -> Iterator[tuple[str, str, Placement, object]]:
    """(module name, slot glob, placement, mesh) of every planned module's plain boundary tensors."""
    for planned in plan.modules:
        placements = boundary_placements(planned.style)
        if placements is None:
            yield planned.name, "input.*", _unknown_style(planned), planned.mesh
            yield planned.name, "output.*", _unknown_style(planned), planned.mesh
            continue
        for slot, placement in placements.items():
            yield planned.name, slot, placement, planned.mesh
    for name, mesh in plan.expert_intermediates:
        yield name, "input.*", _on_dim(-1), mesh
        yield name, "output.*", _on_dim(-1), mesh


def declare_transformers_layouts(tracer, plan: AppliedPlan, parameters: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Declare, on `tracer`, the layouts of the plan's plain boundary tensors and of its plain sharded
    parameters (value and gradient); a parameter under an unknown style is a finding."""
    for name, slot, placement, mesh in declarations(plan):
        tracer.declare(tracer.global_fqn(name), slot, [placement], mesh)
    params = dict(parameters)
    from torch.distributed.tensor import DTensor

    for planned in plan.parameters:
        param = params.get(planned.name)
        if param is None or isinstance(param, DTensor):
            continue
        placement = parameter_placement(planned.style, planned.name, param.dim())
        if placement is None:
            tracer.add_finding(tracer.global_fqn(planned.name), "value", f"a plain parameter sharded by the parallel "
                               f"style {planned.style_name!r}, whose layout ttrace does not know: recorded as a whole")
        elif placement != "R":
            tracer.declare(tracer.global_fqn(planned.name), "*", [placement], planned.mesh)
