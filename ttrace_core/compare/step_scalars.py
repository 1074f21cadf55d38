"""Part of stage 3 (compare): the step's scalars and the fp8 scales, judged in front of any tolerance provider.

The loss, the gradient norm and clip coefficient, the counts and schedule values a step records
(format.naming GRADIENT_CLIPPING, LOSS_FUNCTION), and each fp8 linear's inverse scales have round-off
that no weight perturbation shows: a reduction over millions of elements summed in another order, an
amax that moves with the data. `StepScalarTolerances` gives each its own tolerance and hands every
other tensor to the provider behind it (tolerances.py); `tolerances_from_settings` is the one place a
comparison's settings become that pair.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ttrace_core.compare.fp8_scales import amax_bounds, scale_replica_rel
from ttrace_core.compare.results import Tolerance
from ttrace_core.compare.settings import DEFAULT_ALPHA, CompareSettings
from ttrace_core.compare.structure import FP32_UNIT_ROUNDOFF
from ttrace_core.compare.tolerances import ToleranceProvider, select_tolerances
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TensorKey


EXACT_SCALARS = ("scalar.loss_scale", "scalar.lr", "scalar.skipped_steps", "scalar.num_tokens")
"""Step scalars that are counts or schedule values: the same arithmetic in every layout, so equal."""
NORM_SCALARS = ("scalar.grad_norm", "scalar.clip_coef")
LOSS_SLOT = "scalar.loss"
REDUCTION_K = 8.0
"""Margin on sqrt(n) x u for a norm over n gradient elements accumulated in fp32. Measured here: torch's
CPU norm of n Gaussian fp32 values is off by 0.03, 0.17 and 1.9 x sqrt(n) x u at n = 1e5, 1e6, 1e7
(docs/tolerances.md); a perturbation of size u cannot see this round-off, which grows with n."""


def reduction_rounding(n: int) -> float:
    """The relative round-off of an fp32 reduction over n terms summed in another order, with margin."""
    return REDUCTION_K * math.sqrt(n) * FP32_UNIT_ROUNDOFF


@dataclass(frozen=True, slots=True)
class StepScalarTolerances:
    """The step's scalars (format.naming GRADIENT_CLIPPING, LOSS_FUNCTION) in front of any provider.

    Counts and schedule values must be equal. The gradient norm and the clip coefficient computed from
    it may differ by what their gradients may differ by (the largest gradient tolerance of the step)
    plus the round-off of a reduction over every gradient element, REDUCTION_K x sqrt(n) x u_fp32 (n
    the step's gradient elements), in both runs; the clip factor's round-off is judged here once, since
    the gradients are recorded before clipping scales them. The loss keeps the provider's tolerance, and
    at least the round-off of the reduction it is (a log-sum-exp over the vocabulary, a mean over the
    tokens), REDUCTION_K x sqrt(n) x u_fp32 with n the micro-batch's largest activation: a perturbation
    of the weights by round-off moves a mean of thousands of terms by less than one of its ulps, while
    a vocab-parallel or sequence-parallel loss sums them in another order. An fp8 scale may move by
    alpha x the largest relative difference of the amaxes it follows (compare/fp8_scales.py)."""

    base: ToleranceProvider
    gradients: dict[int, list[tuple[TensorKey, str, int]]]
    """Step -> (key, dtype, logical element count) of each parameter gradient the reference recorded."""
    largest_activation: dict[tuple[int, int | None], int] = field(default_factory=dict)
    """(step, micro-batch) -> element count of the largest forward output the reference recorded."""
    fp8_amax: dict[TensorKey, float] = field(default_factory=dict)
    """fp8 scale key -> the largest relative amax difference of its operand up to that call (fp8_scales.amax_bounds)."""

    def tolerance_for(self, key: TensorKey, dtype: str) -> Tolerance:
        if key in self.fp8_amax:
            return self._fp8_scale_tolerance(key, dtype)
        if not key.slot.startswith("scalar."):
            return self.base.tolerance_for(key, dtype)
        if key.slot in EXACT_SCALARS:
            return Tolerance(rel=0.0, abs=0.0, source="exact: a count or a schedule value", method="exact")
        if key.slot in NORM_SCALARS:
            return self._norm_tolerance(key.step)
        if key.slot == LOSS_SLOT:
            return self._loss_tolerance(key, dtype)
        return self.base.tolerance_for(key, dtype)

    def structure_tolerances(self, key: TensorKey, dtype: str, shape: tuple[int, ...],
                             update_to_value: float | None = None) -> dict[str, float]:
        return {} if key.slot.startswith("scalar.") else self.base.structure_tolerances(key, dtype, shape, update_to_value)

    def _loss_tolerance(self, key: TensorKey, dtype: str) -> Tolerance:
        provided = self.base.tolerance_for(key, dtype)
        n = self.largest_activation.get((key.step, key.micro_batch), 0)
        rounding = reduction_rounding(n)
        if rounding <= provided.rel:
            return provided
        return Tolerance(rel=rounding, abs=provided.abs, method="reduction",
                         params=(("k", REDUCTION_K), ("n", float(n))),
                         source=f"loss: {REDUCTION_K:g} x sqrt({n}) x u_fp32 for its reduction (the largest activation), "
                                f"looser than {provided.source}")

    def _fp8_scale_tolerance(self, key: TensorKey, dtype: str) -> Tolerance:
        """The amax bound on the value; its replicas held to fp8_scales.scale_replica_rel."""
        provided = self.base.tolerance_for(key, dtype)
        alpha = getattr(self.base, "alpha", DEFAULT_ALPHA)
        bound = alpha * self.fp8_amax[key]
        drift_rel = min(scale_replica_rel(dtype) or math.inf, provided.rel if provided.drift_rel is None else provided.drift_rel)
        if bound <= provided.rel:
            return dataclasses.replace(provided, drift_rel=drift_rel)
        return Tolerance(rel=bound, abs=provided.abs, drift_rel=drift_rel, method="amax",
                         params=(("alpha", alpha), ("amax_deviation", self.fp8_amax[key])),
                         source=f"fp8 scale: alpha {alpha:g} x its operand's amax difference {self.fp8_amax[key]:.2g} "
                                f"(largest up to this call), looser than {provided.source}")

    def _norm_tolerance(self, step: int) -> Tolerance:
        grads = self.gradients.get(step, [])
        gradient_rel = max((self.base.tolerance_for(k, d).rel for k, d, _ in grads), default=0.0)
        n = max(sum(numel for _, _, numel in grads), 1)
        rounding = reduction_rounding(n)
        return Tolerance(rel=gradient_rel + rounding, abs=0.0, method="reduction",
                         params=(("gradient_rel", gradient_rel), ("k", REDUCTION_K), ("n", float(n))),
                         source=f"gradient norm: its gradients' tolerance {gradient_rel:.2g} + {REDUCTION_K:g} x "
                                f"sqrt({n}) x u_fp32 for the reduction")


def with_step_scalars(provider: ToleranceProvider, reference: RunReader, candidate: RunReader | None = None
                      ) -> StepScalarTolerances:
    """`provider` with the step scalars' own tolerances in front; with `candidate`, the fp8 scales' too."""
    gradients: dict[int, list[tuple[TensorKey, str, int]]] = {}
    largest: dict[tuple[int, int | None], int] = {}
    for key, metas in reference.index.items():
        if not metas:
            continue
        numel = math.prod(metas[0].layout.global_shape)
        if key.phase == "grad":
            gradients.setdefault(key.step, []).append((key, metas[0].dtype, numel))
        elif key.phase == "forward" and key.slot.startswith("output"):
            largest[key.step, key.micro_batch] = max(largest.get((key.step, key.micro_batch), 0), numel)
    fp8_amax = amax_bounds(reference, candidate) if candidate is not None else {}
    return StepScalarTolerances(base=provider, gradients=gradients, largest_activation=largest, fp8_amax=fp8_amax)


def tolerances_from_settings(settings: CompareSettings, reference: RunReader, candidate: RunReader) -> ToleranceProvider:
    """The provider `settings` name (`--tolerance` and its parameters), with the step scalars' own in front."""
    provider = select_tolerances(settings.tolerance, reference, candidate, alpha=settings.alpha, k=settings.theorem_k,
                                 c=settings.theorem_c)
    return with_step_scalars(provider, reference, candidate)
