"""Consistent tensor generator: identical logical values in every layout, whatever each rank's RNG does.

Every tensor is drawn in its full logical shape from a generator seeded by (seed, canonical name),
then sliced for this rank by the same layout metadata that canonicalize() reads. A reference and
any parallel candidate therefore start from the same logical weights and see the same batches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ttrace_core.canonicalize import shard
from ttrace_core.schema import Layout


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

    def __post_init__(self) -> None:
        if self.sample < 0 or not 0 < self.relative < 0.5:
            raise ValueError(f"perturbation sample {self.sample} / relative {self.relative}: need sample >= 0, 0 < relative < 0.5")

    def apply(self, seed: int, name: str, full: torch.Tensor) -> torch.Tensor:
        generator = generator_for(seed, f"perturbation.{self.sample}.{name}")
        delta = torch.rand(full.shape, generator=generator, dtype=torch.float64) * 2 - 1
        return (full.double() * (1 + self.relative * delta)).to(full.dtype)

    @staticmethod
    def from_dict(data: dict | None) -> WeightPerturbation | None:
        return None if data is None else WeightPerturbation(**data)
