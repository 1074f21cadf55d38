"""The usual alternatives to derived tolerances, judged on the same traces as ttrace (detection.py).

Each takes canonical (full logical, float64) tensors or the per-tensor relative errors ttrace
already computed, and says whether a run is flagged and where first:

- assert_close: torch.testing.assert_close with its default rtol/atol for the stored dtype;
- megatron_l0: Megatron's adopted check (Megatron-LM's test_optimizer_grads_match test): reduced gradients only,
  ||g - g_ref|| / ||g_ref|| <= k * C**(L + 1) * eps with k=4, C=1.03, the most permissive l=0;
- dynamo_gate: torch._dynamo.utils.same with an fp64 oracle: the candidate passes when allclose
  at tol=1e-4, or when its RMSE against the oracle is at most 2x the reference's RMSE plus tol/10;
- loss_curve_step: the first training step whose loss differs from the reference by more than
  any clean layout ever did over the same steps.
"""

from __future__ import annotations

import math

import torch

from ttrace_core.canonicalize.logical_value import logical_value
from ttrace_core.compare.engine import RunComparison
from ttrace_core.format.schema import TensorKey
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.tolerances import machine_epsilon

MEGATRON_K, MEGATRON_C = 4.0, 1.03
DYNAMO_TOL = 1e-4


def megatron_l0_first_failure(comparison: RunComparison, num_layers: int, precision: str) -> TensorKey | None:
    bound = MEGATRON_K * MEGATRON_C ** (num_layers + 1) * machine_epsilon(precision)
    for c in comparison.comparisons:
        if c.key.phase == "grad" and (c.error is None or not math.isfinite(c.error) or c.error > bound):
            if c.error is not None or c.status in ("missing", "shape", "layout"):
                return c.key
    return None


def _assert_close_passes(actual: torch.Tensor, expected: torch.Tensor, dtype: str) -> bool:
    torch_dtype = getattr(torch, dtype)
    try:
        torch.testing.assert_close(actual.to(torch_dtype), expected.to(torch_dtype), equal_nan=True)
    except AssertionError:
        return False
    return True


def _dynamo_passes(actual: torch.Tensor, expected: torch.Tensor, oracle: torch.Tensor, dtype: str) -> bool:
    from torch._dynamo.utils import same

    torch_dtype = getattr(torch, dtype)
    return bool(same(expected.to(torch_dtype), actual.to(torch_dtype), fp64_ref=oracle, tol=DYNAMO_TOL,
                     log_error=lambda *args, **kwargs: None))


def elementwise_first_failures(reference: RunReader, candidate: RunReader, oracle: RunReader | None,
                               comparison: RunComparison) -> dict[str, TensorKey | None]:
    """First tensor (execution order) each elementwise baseline flags; structural failures count."""
    first: dict[str, TensorKey | None] = {"assert_close": None, "dynamo": None}
    for c in comparison.comparisons:
        if all(v is not None for v in first.values()):
            break
        if c.status in ("missing", "extra", "shape", "dtype", "layout"):
            first = {name: key or c.key for name, key in first.items()}
            continue
        if c.stats_only or c.key not in candidate.index:
            continue
        actual, expected = logical_value(candidate, c.key), logical_value(reference, c.key)
        dtype = candidate.index[c.key][0].dtype
        if first["assert_close"] is None and not _assert_close_passes(actual, expected, dtype):
            first["assert_close"] = c.key
        if first["dynamo"] is None and oracle is not None and c.key in oracle.index:
            if not _dynamo_passes(actual, expected, logical_value(oracle, c.key), dtype):
                first["dynamo"] = c.key
    return first


def loss_curve_step(reference: list[float], candidate: list[float], clean_spread: float) -> int | None:
    """First step (0-based) where |candidate - reference| exceeds the clean-vs-reference spread."""
    for step, (expected, actual) in enumerate(zip(reference, candidate)):
        if not math.isfinite(actual) or abs(actual - expected) > clean_spread:
            return step
    return None


def clean_spread(reference: list[float], cleans: list[list[float]]) -> float:
    return max((abs(a - e) for clean in cleans for e, a in zip(reference, clean)), default=0.0)
