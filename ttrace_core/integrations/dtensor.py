"""DTensor adapter: a DTensor describes its own layout; this turns it into a ttrace `Layout`."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, _StridedShard

from ttrace_core.errors import LayoutError
from ttrace_core.format.naming import DATA_PARALLEL_AXES
from ttrace_core.format.schema import Layout


def placement_str(placement: Placement | str) -> str:
    if isinstance(placement, str):
        return placement
    if isinstance(placement, _StridedShard):
        return f"SS({placement.dim},{placement.split_factor})"
    if placement.is_shard():
        return f"S({placement.dim})"
    if placement.is_replicate():
        return "R"
    if placement.is_partial():
        reduce_op = getattr(placement, "reduce_op", "sum")
        if reduce_op not in ("sum", "avg"):
            raise LayoutError(f"Partial({reduce_op}) cannot be reduced from recorded shards; only sum and avg can")
        return f"P({reduce_op})"
    raise LayoutError(f"unknown DTensor placement {placement!r}")


MeshDescription = tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]


def mesh_description(mesh: DeviceMesh | MeshDescription) -> MeshDescription:
    """(mesh_shape, this rank's coordinate, axis names), of a DeviceMesh or as given.

    Frameworks without DeviceMesh (Megatron) describe their process groups directly, e.g.
    ((tp_size,), (tp_rank,), ("tp",)).
    """
    if isinstance(mesh, tuple):
        shape, coordinate, names = mesh
        return tuple(shape), tuple(coordinate), tuple(names)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not part of the mesh"
    return tuple(mesh.shape), tuple(coordinate), tuple(mesh.mesh_dim_names or ())


def layout_from_dtensor(value: DTensor) -> Layout:
    mesh_shape, coordinate, names = mesh_description(value.device_mesh)
    return Layout(
        global_shape=tuple(value.shape), mesh_shape=mesh_shape, coordinate=coordinate,
        placements=tuple(placement_str(p) for p in value.placements), mesh_axis_names=names,
    )


def layout_of_converted_output(before: DTensor, local: torch.Tensor) -> Layout | None:
    """The layout of a plain tensor a parallel style returned for the DTensor `before` (ColwiseParallel,
    RowwiseParallel, SequenceParallel with use_local_output): the style redistributed it to its
    output layouts, then took its local part. The same global shape means replicated; one dim
    smaller by the axis' share means sharded along that dim (Colwise's last dim, SP's sequence)."""
    global_shape, local_shape = tuple(before.shape), tuple(local.shape)
    mesh_shape, coordinate, names = mesh_description(before.device_mesh)
    if len(global_shape) != len(local_shape) or len(mesh_shape) != 1:
        return None
    differing = [dim for dim, (g, n) in enumerate(zip(global_shape, local_shape)) if g != n]
    if not differing:
        placements = ("R",)
    elif len(differing) == 1 and -(-global_shape[differing[0]] // mesh_shape[0]) >= local_shape[differing[0]]:
        placements = (f"S({differing[0]})",)
    else:
        return None
    return Layout(global_shape=global_shape, mesh_shape=mesh_shape, coordinate=coordinate, placements=placements,
                  mesh_axis_names=names)


def local_value(value: torch.Tensor) -> torch.Tensor:
    """The values this rank holds, after any pending asynchronous collective has completed."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, AsyncCollectiveTensor):
        value = value.wait()
    return value.detach()


def plain_boundary_layouts(style: object) -> dict[str, Placement]:
    """Slots of a module parallelized with `style` that leave or enter it as plain local tensors,
    with the placement the style says they have.

    A ParallelStyle with use_local_output=True hands on `to_local()` of a DTensor: the values are
    still sharded, but the tensor no longer says how. Inputs that a style converts to DTensor
    before the module runs describe themselves and need nothing here.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not getattr(style, "use_local_output", False):
        return {}
    if isinstance(style, ColwiseParallel | RowwiseParallel):
        return {"output.0": style.output_layouts[0]}
    if isinstance(style, SequenceParallel):
        return {"output.0": style.sequence_sharding[0]}
    if isinstance(style, PrepareModuleInput):
        return {f"input.{i}": p for i, p in enumerate(style.desired_input_layouts or ()) if p is not None}
    if isinstance(style, PrepareModuleOutput):
        return {f"output.{i}": p for i, p in enumerate(style.desired_output_layouts) if p is not None}
    return {}


def declare_parallelize_plan(tracer, plan: dict[str, object], mesh: DeviceMesh) -> None:
    """Declare, on `tracer`, the layouts a parallelize_module plan gives to plain boundary tensors."""
    for fqn_glob, style in plan.items():
        for slot, placement in plain_boundary_layouts(style).items():
            tracer.declare(fqn_glob, slot, [placement], mesh)


def own_micro_batch_value(value: DTensor) -> torch.Tensor:
    """This rank's value of a DTensor reduced over every mesh axis but the data-parallel ones (a collective
    over those axes): a loss that is partial over tensor parallelism (loss parallel) and over data
    parallelism is, on each data-parallel rank, the loss of its own micro-batch (ttrace's rule)."""
    names = value.device_mesh.mesh_dim_names or ()
    placements = [placement if axis < len(names) and names[axis] in DATA_PARALLEL_AXES else Replicate()
                  for axis, placement in enumerate(value.placements)]
    return value.redistribute(placements=placements).to_local()
