"""FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`) adapter: its parameters as flat ranges of the logical ones.

Produces layout metadata (stage 1, record). FSDP1 flattens the parameters of each module it wraps into one
FlatParameter, and each rank of its process group holds one contiguous range of it. With
`use_orig_params=True` the model keeps its own parameters, each a 1-D view of the elements of it this rank
holds: elements [start, end) of the parameter's row-major flattening, none on some ranks. That is a `Layout`
with `flat_range` over the parameter's logical shape, with no mesh: every rank holding a range holds it of the
whole tensor, and the ranges of the ranks together cover it (hybrid sharding repeats them: replicas). The
reduced gradient FSDP1 leaves after backward and the value after the optimizer step are laid out the same way.

The ranges are read from each wrapped module's FlatParameter (`_fqns`, `_shapes`, `_shard_param_infos`,
torch's own record of where each parameter lies, kept by every FSDP1 since torch 2.0). Modules are told by
class name: FSDP1 is never imported here.

With `use_orig_params=False` (torch's default) the model's parameters are the FlatParameters themselves, and
the optimizer steps them: there is no parameter of the user's model to record. Such a run gets one finding
saying so, and compare's refusal of the run quotes it (`unmapped`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ttrace_core.format.schema import Layout

FSDP1_CLASS = "FullyShardedDataParallel"
WRAPPED = "_fsdp_wrapped_module"
"""The name FSDP1 gives the module it wraps (format/schema.py's WRAPPER_COMPONENTS drops it from names)."""

FSDP1_UNMAPPED = ("wrapped in FullyShardedDataParallel (FSDP1) with use_orig_params=False, whose parameters are the "
                  "flattened shards ttrace does not map: this run cannot be compared (compare refuses its parameter "
                  "shapes); pass use_orig_params=True (FSDP1 then keeps each parameter, which ttrace maps) or shard "
                  "with torch.distributed.fsdp.fully_shard (FSDP2)")


def fsdp1_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` FSDP1 wraps, with their local names ("" for the root), in the model's order."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ == FSDP1_CLASS]


def unmapped(model: nn.Module) -> str | None:
    """The local name of the first FSDP1 module whose parameters cannot be mapped (use_orig_params=False),
    or None when every one can (or there is none)."""
    return next((name for name, module in fsdp1_modules(model) if not getattr(module, "_use_orig_params", False)), None)


def held_layouts(model: nn.Module) -> dict[str, Layout]:
    """Local parameter name -> the flat range of it this rank holds, for every parameter a sharding FSDP1
    module with use_orig_params=True flattened (an unsharded strategy, NO_SHARD, leaves each whole: none)."""
    held: dict[str, Layout] = {}
    for prefix, module in fsdp1_modules(model):
        handle = getattr(module, "_handle", None)  # None: the module has no parameters of its own
        if handle is None or not getattr(module, "_use_orig_params", False) or not handle.uses_sharded_strategy:
            continue
        flat = handle.flat_param
        base = f"{prefix}.{WRAPPED}." if prefix else f"{WRAPPED}."
        for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
            start, end = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            held[base + fqn] = Layout(global_shape=tuple(shape), flat_range=(start, end))
    return held


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


_EMPTY, _VARIES = "empty", "varies"


def agreed_constants(model: nn.Module, held: dict[str, Layout]) -> dict[str, float | None]:
    """Local name -> the value every element of the parameter holds, or None, for the parameters in `held`,
    agreed among all ranks: one rank's range of a random weight may hold a single element (which looks
    constant), and a range of LayerNorm's ones is constant on every rank. A collective (every rank calls it,
    with the same names). A parameter no rank holds an element of is None."""
    local: dict[str, object] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in held:
                flat = param.detach().reshape(-1)
                local[name] = _EMPTY if not flat.numel() else \
                    float(flat[0]) if bool((flat == flat[0]).all()) else _VARIES
    gathered: list[dict] = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, local)
    agreed: dict[str, float | None] = {}
    for name in local:
        said = {by_rank.get(name, _EMPTY) for by_rank in gathered} - {_EMPTY}
        agreed[name] = next(iter(said)) if len(said) == 1 and _VARIES not in said else None
    return agreed
