"""PyTorch-native adapter for `ttrace_core.attach`: what a DTensor / DDP / FSDP1 / torch.compile model says about its run.

Produces layout metadata (stage 1, record): the data-parallel rank and size that number the
micro-batches, the mesh and degrees for the manifest, and the modules a compiled model hides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ttrace_core.canonicalize.placements import coordinate_from_rank
from ttrace_core.format.naming import DATA_PARALLEL_AXES
from ttrace_core.format.schema import Layout, RunManifest, strip_wrappers
from ttrace_core.integrations import fsdp1
from ttrace_core.format.reader import dtype_name

LIGHTNING_PACKAGES = ("lightning.pytorch.", "pytorch_lightning.", "lightning.fabric.", "lightning_fabric.")
"""Where Lightning's classes live: its Trainer (in the `lightning` package, or the older `pytorch_lightning`) and
Fabric (in `lightning`, or the standalone `lightning_fabric`)."""


def lightning_package(obj: object, class_name: str) -> str | None:
    """The package ("lightning.pytorch", "lightning_fabric", ...) whose class `class_name` `obj` is an instance of
    (or of a subclass of); None when it is none of Lightning's. Told by name: Lightning is never imported here."""
    for cls in type(obj).__mro__:
        if cls.__name__ == class_name:
            for package in LIGHTNING_PACKAGES:
                if cls.__module__.startswith(package):
                    return package.rstrip(".")
    return None


def without_fabric_wrapper(model: object) -> object:
    """The module inside Lightning Fabric's `_FabricModule` (what `fabric.setup(model, ...)` returns): its
    `_forward_module`, the strategy's wrapping of the user's model (DistributedDataParallel under DDP, which
    then says the run is data-parallel; the sharded model under FSDP; the model itself on one device), so
    both runs name the modules as the user's model does. Anything else is returned as it is."""
    return model._forward_module if lightning_package(model, "_FabricModule") else model


PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
_MANTISSA_BITS = {"fp64": 52, "fp32": 23, "fp16": 10, "bf16": 7, "fp8": 3}


def computed_precision(declared: str, output_dtypes: dict[str, int]) -> str:
    """The precision a run computes in: `declared` (its parameters' dtype, or what its adapter said), or the
    most common dtype of its module outputs when that one is coarser: autocast, FSDP2's MixedPrecisionPolicy
    and torchtitan's bf16 training keep fp32 parameters and compute in bf16, and their fp32 gradients
    carry bf16 round-off (the dtype table then judges them by bf16's row)."""
    if not output_dtypes:
        return declared
    observed = PRECISION_OF_DTYPE.get(max(output_dtypes, key=output_dtypes.get))
    coarser = observed is not None and _MANTISSA_BITS[observed] < _MANTISSA_BITS.get(declared, 0)
    return observed if coarser else declared


def _largest_mesh(model: nn.Module):
    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    return max(meshes, key=lambda mesh: mesh.ndim, default=None)


def data_parallel_of(model: nn.Module, data_parallel: tuple[int, int] | None) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel replicas: given, or from DDP's (or FSDP1's) process group,
    or from the mesh axes named like data parallelism (DATA_PARALLEL_AXES) of the parameters' mesh."""
    if data_parallel is not None:
        return data_parallel
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else compiled_root_ddp(model)
    if ddp is not None:
        return dist.get_rank(ddp.process_group), dist.get_world_size(ddp.process_group)
    if (sharded := fsdp1.data_parallel(model)) is not None:
        return sharded
    mesh = _largest_mesh(model)
    if mesh is None or not mesh.mesh_dim_names:
        return 0, 1
    axes = [i for i, name in enumerate(mesh.mesh_dim_names) if name in DATA_PARALLEL_AXES]
    rank, size = 0, 1
    for axis in axes:
        rank, size = rank * mesh.size(axis) + mesh.get_local_rank(axis), size * mesh.size(axis)
    return rank, size


def manifest_from_model(model: nn.Module, role: str, world_size: int,
                        name: Callable[[str], str] = strip_wrappers, held: dict[str, Layout] | None = None) -> RunManifest:
    """The manifest fields a model can tell: mesh and degrees (the parameters' largest mesh spanning every
    rank), precision (the parameters' most common dtype) and the logical parameter shapes (two runs are
    comparable only when these agree; gathered from every rank, since pipeline stages differ), each under
    `name` of its local name (the tracer's global name). `held`: the layouts of parameters that are flat ranges of
    a larger one (FSDP1's, integrations/fsdp1.py), whose logical shape is their layout's."""
    mesh = _largest_mesh(model)
    if mesh is not None and mesh.size() == world_size:
        names = list(mesh.mesh_dim_names or (f"axis{i}" for i in range(mesh.ndim)))
        shape = list(mesh.shape)
        by_position = [[int(c) for c in coordinate_from_rank(i, tuple(shape))] for i in range(world_size)]
        flat = mesh.mesh.reshape(-1).tolist()  # rank ids in row-major mesh order
        coordinates = [by_position[flat.index(rank)] for rank in range(world_size)]
    else:
        names, shape, coordinates = [], [], []
    dtypes = [dtype_name(p.dtype) for p in model.parameters() if p.is_floating_point()]
    precision = PRECISION_OF_DTYPE.get(max(set(dtypes), key=dtypes.count) if dtypes else "float32", "fp32")
    held = held or {}
    shapes = {name(local): list(held[local].global_shape if local in held else p.shape)
              for local, p, _ in fsdp1.named_parameters(model)}
    if dist.is_initialized() and world_size > 1:
        gathered: list[dict] = [{} for _ in range(world_size)]
        dist.all_gather_object(gathered, shapes)
        shapes = {name: shape for by_rank in gathered for name, shape in by_rank.items()}
    return RunManifest(role=role, world_size=world_size, degrees=dict(zip(names, shape)), mesh_shape=shape,
                       mesh_axis_names=names, rank_coordinates=coordinates, precision=precision,
                       model={"parameters": dict(sorted(shapes.items()))})


def compiled(module: object) -> bool:
    """Whether `module` is what torch.compile returned for a module (its OptimizedModule; told by name: dynamo is
    never imported here)."""
    return type(module).__name__ == "OptimizedModule"


def compiled_in_place(module: object) -> bool:
    """Whether `module.compile()` compiled `module` in place: its hooks then run inside the compiled code."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_modules(model: nn.Module, name: Callable[[str], str] = strip_wrappers) -> list[str]:
    """The modules torch.compile hides, under `name` of their local names: every one below a compiled root (whose
    own hooks run outside the compiled code), every one and the root itself when the root was compiled in place
    (`model.compile()`), or, in a model that is not compiled as a whole, each compiled module
    (`torch.compile(block)` put in its place, or `block.compile()` in place, as torchtitan compiles its blocks with
    fullgraph=True: its own hooks would run inside the compiled code) with everything below it; [] when nothing is
    compiled. A hook there would break the compiled graph, and with fullgraph=True the training."""
    if compiled(model):
        return sorted({name(local) for local, _ in model.named_modules() if name(local)})
    if compiled_in_place(model):  # the root's own hooks too: nothing of its activations can be seen
        return sorted({name(local) for local, _ in model.named_modules()})
    hidden: set[str] = set()
    for local, module in model.named_modules():
        if local and (compiled(module) or compiled_in_place(module)):
            hidden |= {name(".".join(filter(None, (local, inner)))) for inner, _ in module.named_modules()}
    return sorted(hidden)


def compiled_root_ddp(model: object) -> nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel a torch.compile'd root wraps (`torch.compile(DDP(model))`, as DDP's own docs
    advise), whose `module.` is then part of every local name below the root; None for any other model."""
    inner = getattr(model, "_orig_mod", None) if compiled(model) else None
    return inner if isinstance(inner, nn.parallel.DistributedDataParallel) else None


def micro_batches_of_group(micro_batch: int, group) -> tuple[int, ...]:
    """The global micro-batches every rank of `group` is dispatching now: the tokens of each may reach this
    rank's experts (the ranks of an expert-parallel group are data-parallel ranks of their own). A
    collective over `group`: every rank of it calls this at the same point of its dispatch."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return (micro_batch,)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([micro_batch], dtype=torch.int64), group=group)
    return tuple(sorted({int(t) for t in gathered}))
