"""Tolerances for stage 3 (compare), behind one interface.

A tensor passes when ||actual - expected||_F <= rel * ||expected||_F + abs * sqrt(numel): the
additive form of torch.testing.assert_close applied to Frobenius norms, so that near-zero
references fall back to an absolute, per-element RMS bound. `DtypeTolerances` is the default
table; tolerances derived from floating-point analysis plug in through `ToleranceProvider`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ttrace_core.schema import TensorKey


@dataclass(frozen=True, slots=True)
class Tolerance:
    rel: float
    abs: float
    source: str
    """Where the numbers come from, shown next to every verdict ("dtype default (float32)")."""


class ToleranceProvider(Protocol):
    def tolerance_for(self, key: TensorKey, dtype: str) -> Tolerance: ...


# (rel, abs) per compute dtype. fp32: TP/SP/FSDP reorderings measured here stay below 5e-7
# relative, so 1e-5 leaves a 20x margin while any real bug is orders of magnitude above it.
# Low-precision rows are round-off scale (a few eps); the derived tolerances replace them.
DTYPE_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-12),
    "float32": (1e-5, 1e-7),
    "float16": (5e-3, 1e-5),
    "bfloat16": (4e-2, 1e-4),
    "float8_e4m3fn": (4e-2, 1e-4),
    "float8_e5m2": (4e-2, 1e-4),
}


# The run's `precision` (manifest) names its compute dtype; fp8 recipes accumulate and store in bf16.
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


@dataclass(frozen=True, slots=True)
class DtypeTolerances:
    """The per-dtype default table, with optional overrides for every dtype.

    A tensor stored in fp32 but computed in bf16 (Megatron's fp32 main_grad) carries bf16
    round-off: with `precision` set, the looser of its own dtype's row and the row of the
    run's compute dtype applies.
    """

    overrides: dict[str, tuple[float, float]] | None = None
    precision: str | None = None

    def tolerance_for(self, key: TensorKey, dtype: str) -> Tolerance:
        table = {**DTYPE_TOLERANCES, **(self.overrides or {})}
        rel, abs_ = table.get(dtype, table["float32"])
        source = f"dtype default ({dtype})"
        compute = COMPUTE_DTYPES.get(self.precision or "", dtype)
        compute_rel, compute_abs = table.get(compute, table["float32"])
        if compute_rel > rel:
            rel, abs_, source = compute_rel, max(abs_, compute_abs), f"dtype default ({dtype}, computed in {compute})"
        return Tolerance(rel=rel, abs=abs_, source=source)
