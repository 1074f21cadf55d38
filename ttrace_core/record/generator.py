"""Consistent tensor generator: identical logical values in every layout, whatever each rank's RNG does.

Every tensor is drawn in its full logical shape from a generator seeded by (seed, canonical name),
then sliced for this rank by the same layout metadata that canonicalize() reads. A reference and
any parallel candidate therefore start from the same logical weights and see the same batches.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ttrace_core.canonicalize.shards import shard
from ttrace_core.format.schema import Layout


def seed_from_name(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator_for(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed_from_name(seed, name))


def normal_full(seed: int, name: str, shape: tuple[int, ...], *, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Full logical fp32 tensor ~ N(mean, std^2) that depends only on (seed, name, shape)."""
    values = torch.randn(shape, generator=generator_for(seed, name), dtype=torch.float32)
    return values * std + mean


def tokens_full(seed: int, name: str, shape: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=generator_for(seed, name), dtype=torch.int64)


def local_from_full(full: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """This rank's slice of a full logical tensor (the whole tensor when it is not sharded)."""
    return full.clone() if layout is None else shard(full, layout)


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightPerturbation:
    """One sample of the perturbation-based tolerance estimate: every logical weight w becomes
    w * (1 + delta), delta ~ U[-relative, relative] elementwise, drawn from (seed, sample, name) in
    the full logical shape, so that the perturbed model is the same logical model in any layout."""

    sample: int
    """Which perturbation (0, 1, ...); each draws independent deltas."""
    relative: float
    """Largest relative change per element: the compute dtype's unit round-off by default."""
    coarser: dict[str, float] = field(default_factory=dict)
    """Weight name -> its own largest relative change, for the weights the run computes with in a coarser
    format than its precision (workflows/estimate.py `coarser_weights`: an fp32 run's bf16 grouped experts)."""

    def __post_init__(self) -> None:
        for relative in (self.relative, *self.coarser.values()):
            if self.sample < 0 or not 0 < relative < 0.5:
                raise ValueError(f"perturbation sample {self.sample} / relative {relative}: need sample >= 0, 0 < relative < 0.5")

    def relative_of(self, name: str) -> float:
        return self.coarser.get(name, self.relative)

    def delta(self, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The full logical delta in [-1, 1] (float64) of the weight `name`; slice it like the weight."""
        generator = generator_for(seed, f"perturbation.{self.sample}.{name}")
        return torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1

    def apply(self, seed: int, name: str, full: torch.Tensor) -> torch.Tensor:
        delta = self.delta(seed, name, tuple(full.shape))
        return (full.double() * (1 + self.relative_of(name) * delta)).to(full.dtype)

    @staticmethod
    def from_dict(data: dict | None) -> WeightPerturbation | None:
        return None if data is None else WeightPerturbation(**data)


def default_init(name: str, global_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """N(0, 1/fan_in) for matrices (fan_in: the last dim), N(0, 0.02^2) for vectors: a function of the
    logical shape only, so every layout draws the same values."""
    std = 1 / math.sqrt(global_shape[-1]) if len(global_shape) >= 2 and global_shape[-1] else 0.02
    return normal_full(seed, name, global_shape, std=std)


def _constant_value(local: torch.Tensor) -> float | None:
    """The value of a constant tensor (LayerNorm's ones, biases' zeros: the same in every layout), else None."""
    flat = local.reshape(-1)
    return float(flat[0]) if flat.numel() > 0 and bool((flat == flat[0]).all()) else None


def agreed_constants(model: nn.Module, names: Collection[str]) -> dict[str, float | None]:
    """Local name -> the value every element of the parameter holds, or None, for the parameters `names`, agreed
    among all ranks: a rank's part of a random weight may be one element (which looks constant), as in FSDP1's
    flat ranges, while a part of LayerNorm's ones is constant on every rank. A collective (every rank calls it, with
    the same names); a rank holding no element of a parameter says nothing of it."""
    from ttrace_core.integrations import fsdp1

    parts = [(name, param.detach()) for name, param, _ in fsdp1.named_parameters(model) if name in names]
    local, holding = {name: _constant_value(part) for name, part in parts}, {name for name, part in parts if part.numel()}
    gathered: list[tuple[dict, set]] = [(local, holding)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [({}, set()) for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, (local, holding))
    agreed: dict[str, float | None] = {}
    for name in local:
        said = [values[name] for values, holders in gathered if name in holders]
        agreed[name] = said[0] if said and None not in said and len(set(said)) == 1 else None
    return agreed


def initialize_weights(model: nn.Module, *, seed: int, reinit: bool, perturbation: WeightPerturbation | None,
                       rename: Callable[[str], str],
                       layout_of: Callable[[str, torch.Tensor], Layout | None] | None = None,
                       constants: dict[str, float | None] | None = None) -> None:
    """With reinit, give every parameter its logical value from (seed, canonical name), drawn in full
    logical shape (constants kept), perturbed there and cast, then sliced by the parameter's layout:
    its own DTensor layout, or `layout_of(local name, param)` for plain tensors that are shards
    (Megatron's). `constants`: by local name, whether a parameter is a constant (its value, or None), where a
    rank cannot tell from its own part (`agreed_constants`). Without, keep the loaded values and perturb them in
    place, in their own dtype (a bf16 weight then keeps its value wherever the perturbation is under half an ulp)."""
    from torch.distributed.tensor import DTensor

    from ttrace_core.integrations import fsdp1
    from ttrace_core.integrations.dtensor import layout_from_dtensor, local_value

    with torch.no_grad():
        for local_fqn, param, _ in fsdp1.named_parameters(model):  # (FSDP1's FlatParameters: the parameters they hold)
            name, local = rename(local_fqn), local_value(param)
            if isinstance(param, DTensor):
                layout = layout_from_dtensor(param)
            else:
                layout = layout_of(local_fqn, param) if layout_of is not None else None
            shape = tuple(param.shape) if layout is None else tuple(layout.global_shape)
            if reinit:
                constant = constants[local_fqn] if constants and local_fqn in constants else _constant_value(local)
                full = default_init(name, shape, seed) if constant is None else torch.full(shape, constant)
                full = full if perturbation is None else perturbation.apply(seed, name, full)
                local.copy_(local_from_full(full, layout).to(local.dtype))
            elif perturbation is not None:
                delta = local_from_full(perturbation.delta(seed, name, shape), layout)
                local.copy_((local.double() * (1 + perturbation.relative_of(name) * delta)).to(local.dtype))
