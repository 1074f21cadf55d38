"""FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`) adapter: its parameters as flat ranges of the logical ones.

Produces layout metadata (stage 1, record). FSDP1 flattens the parameters of each module it wraps into one
FlatParameter, and each rank of its process group holds one contiguous range of it. Each parameter then has,
on each rank, the elements [start, end) of its row-major flattening that fall in the rank's range, none on
some ranks. That is a `Layout` with `flat_range` over the parameter's logical shape and no mesh: the ranks'
ranges together cover the tensor (hybrid sharding repeats them: replicas). The reduced gradient FSDP1 leaves
after backward and the value after the optimizer step are laid out the same way.

- With `use_orig_params=True` the model keeps its own parameters, each a 1-D view of its range (under an
  unsharded strategy, NO_SHARD, each stays whole: no layout is needed).
- With `use_orig_params=False` (torch's default) the model's parameters are the FlatParameters themselves;
  `named_parameters` gives the user's parameters in their place: a view of each one's range of the
  FlatParameter's local values and of its gradient, which the optimizer steps in place.

Where each parameter lies is read from the FlatParameter (`_fqns`, `_shapes`, `_shard_param_infos`: torch's own
record, kept by every FSDP1 since torch 2.0). Modules are told by class name: FSDP1 is never imported here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ttrace_core.format.schema import Layout

FSDP1_CLASS = "FullyShardedDataParallel"
WRAPPED = "_fsdp_wrapped_module"
"""The name FSDP1 gives the module it wraps (format/schema.py's WRAPPER_COMPONENTS drops it from names)."""

def fsdp1_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` FSDP1 wraps, with their local names ("" for the root), in the model's order."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ == FSDP1_CLASS]


def _pieces(prefix: str, flat: torch.Tensor) -> Iterator[tuple[str, Layout, int, int]]:
    """(local name, layout, offset, numel) of each parameter a FlatParameter holds: where its range starts in the
    FlatParameter's local values, and how many elements it has there (0 on a rank holding none of it)."""
    for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
        if info.in_shard:
            start, end, offset, numel = info.intra_param_start_idx, info.intra_param_end_idx + 1, info.offset_in_shard, \
                info.numel_in_shard
        else:
            start = end = offset = numel = 0
        yield prefix + fqn, Layout(global_shape=tuple(shape), flat_range=(start, end)), offset, numel


def _flat_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, torch.Tensor]]:
    """(prefix of the local names of the parameters it holds, FSDP1 module, FlatParameter) of each FSDP1 module
    with parameters of its own. Its FlatParameter's own name may differ from the prefix (a checkpoint wrapper
    inside FSDP1 names it below itself): the parameters are named from the module FSDP1 wraps."""
    for prefix, module in fsdp1_modules(model):
        handle = getattr(module, "_handle", None)  # None: the module has no parameters of its own
        if handle is not None:
            yield (f"{prefix}.{WRAPPED}." if prefix else f"{WRAPPED}."), module, handle.flat_param


def held_layouts(model: nn.Module) -> dict[str, Layout]:
    """Local parameter name -> the flat range of it this rank holds, for every parameter FSDP1 flattened (but
    those a module with use_orig_params=True and an unsharded strategy keeps whole)."""
    held: dict[str, Layout] = {}
    for base, module, flat in _flat_parameters(model):
        if not (getattr(module, "_use_orig_params", False) and not module._handle.uses_sharded_strategy):
            held.update((name, layout) for name, layout, _, _ in _pieces(base, flat))
    return held


def named_parameters(model: nn.Module, grad_attr: str = "grad") -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(local name, value, gradient or None) of each parameter of the user's model: `model.named_parameters()`,
    with each FlatParameter (use_orig_params=False) replaced by the parameters it holds, each a view of its
    range of the FlatParameter's local values and gradient (writing to the view writes the FlatParameter). Under
    FSDP1 a parameter this rank holds no element of has an empty gradient, so every rank records its range."""
    bases = {id(flat): base for base, _, flat in _flat_parameters(model)}
    for name, param in model.named_parameters():
        if (base := bases.get(id(param))) is None:
            grad = getattr(param, grad_attr, None)
            if grad is None and bases and not param.numel():  # (use_orig_params: none where a rank holds no element)
                grad = param.detach().new_empty(0)
            yield name, param, grad
            continue
        values, grad = param.detach(), getattr(param, grad_attr, None)
        for piece, _, offset, numel in _pieces(base, param):
            yield piece, values[offset:offset + numel], None if grad is None else grad[offset:offset + numel]


def data_parallel(model: nn.Module) -> tuple[int, int] | None:
    """(rank, size) among the data-parallel replicas of an FSDP1 model: its outermost FSDP1 module's process
    group (hybrid sharding replicates across groups too: every rank then); None without FSDP1."""
    wrapped = fsdp1_modules(model)
    if not wrapped:
        return None
    module = wrapped[0][1]
    if "HYBRID" in getattr(getattr(module, "sharding_strategy", None), "name", ""):
        return dist.get_rank(), dist.get_world_size()
    group = module.process_group
    return dist.get_rank(group), dist.get_world_size(group)
