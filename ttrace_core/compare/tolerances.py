"""Tolerances for stage 3 (compare), behind one interface.

A tensor passes when ||actual - expected||_F <= rel * ||expected||_F + abs * sqrt(numel): the
additive form of torch.testing.assert_close applied to Frobenius norms, so that near-zero
references fall back to an absolute, per-element RMS bound. Three providers:

- `PerturbationTolerances` (the default once the reference holds an estimate): per tensor,
  rel = max(alpha * r_t, floor), r_t the largest relative deviation the tensor showed when the
  reference was re-run with weights perturbed by the unit round-off (workflows/estimate.py, compare/estimate_file.py);
- `TheoremTolerances`: rel = k * C**depth * eps, depth the number of layers between the tensor
  and the input (forward) or the loss (backward, gradients, updated parameters);
- `DtypeTolerances`: one (rel, abs) row per dtype.

docs/tolerances.md has the math and the calibration of alpha, k and C.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ttrace_core.compare.results import ComparisonStatus, TensorComparison, Tolerance
from ttrace_core.compare.settings import (  # noqa: F401 (the defaults are part of this module's interface)
    DEFAULT_ALPHA, DEFAULT_EXACT_INPUTS_K, DEFAULT_THEOREM_C, DEFAULT_THEOREM_K, TOLERANCE_KINDS,
)
from ttrace_core.compare.estimate_file import PerturbationEstimate, estimate_path, read_estimate
from ttrace_core.compare.structure import storage_rounding_noise, uncorrelated_noise
from ttrace_core.errors import TtraceError
from ttrace_core.format.naming import is_embedding, layer_family, layer_of
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TensorKey



class ToleranceProvider(Protocol):
    def tolerance_for(self, key: TensorKey, dtype: str) -> Tolerance: ...

    def structure_tolerances(self, key: TensorKey, dtype: str, shape: tuple[int, ...],
                             update_to_value: float | None = None) -> dict[str, float]:
        """Tolerance of each structure statistic (compare/structure.py) the provider can derive; {} for none.
        `update_to_value`: ||E - E_before|| / ||E|| of a post-step parameter (the update's size)."""
        ...


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
COMPUTE_DTYPES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
LOW_PRECISIONS = ("bf16", "fp16", "fp8")
"""Run precisions whose round-off the dtype table can only bound by a few percent (or a few tenths of one)."""


def machine_epsilon(precision: str) -> float:
    """eps of the run's compute dtype (bf16's for fp8 recipes: they accumulate and store in bf16)."""
    if precision not in COMPUTE_DTYPES:
        raise TtraceError(f"precision {precision!r} has no compute dtype; known: {sorted(COMPUTE_DTYPES)}")
    return torch.finfo(getattr(torch, COMPUTE_DTYPES[precision])).eps


def storage_epsilon(dtype: str) -> float:
    torch_dtype = getattr(torch, dtype, None)
    return torch.finfo(torch_dtype).eps if isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point else 0.0


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
        overrides = tuple((name, tuple(row)) for name, row in self.overrides.items()) if self.overrides else ()
        return _dtype_tolerance(overrides, self.precision, dtype)

    def structure_tolerances(self, key: TensorKey, dtype: str, shape: tuple[int, ...],
                             update_to_value: float | None = None) -> dict[str, float]:
        return {}  # a flat table has no noise model for the error's structure


@functools.lru_cache(maxsize=256)
def _dtype_tolerance(overrides: tuple[tuple[str, tuple[float, float]], ...], precision: str | None, dtype: str) -> Tolerance:
    """A row of the dtype table (the same for every tensor of a dtype: made once, a Tolerance is immutable)."""
    table = {**DTYPE_TOLERANCES, **dict(overrides)}
    rel, abs_ = table.get(dtype, table["float32"])
    source = f"dtype default ({dtype})"
    compute = COMPUTE_DTYPES.get(precision or "", dtype)
    compute_rel, compute_abs = table.get(compute, table["float32"])
    if compute_rel > rel:
        rel, abs_, source = compute_rel, max(abs_, compute_abs), f"dtype default ({dtype}, computed in {compute})"
    return Tolerance(rel=rel, abs=abs_, source=source, method="dtype")


# Floor, in units of eps: a tensor the perturbation does not move may still differ by one rounding.
DEFAULT_FLOOR_EPS = 1.0


@dataclass(kw_only=True, slots=True)
class PerturbationTolerances:
    """rel_t = max(alpha * r_t, floor_eps * eps) from a stored `PerturbationEstimate`.

    r_t is the largest relative deviation over the samples *and over the micro-batches* of the
    same tensor (same step, phase, fqn, slot): one tensor on different data has the same round-off
    sensitivity, and pooling turns 4 samples into 16 draws, which matters for tensors of a few
    elements (an fp8 scale is one), whose deviation is a single, heavy-tailed number.
    """

    estimate: PerturbationEstimate
    precision: str
    alpha: float = DEFAULT_ALPHA
    floor_eps: float = DEFAULT_FLOOR_EPS
    fallback: DtypeTolerances = field(default_factory=DtypeTolerances)
    _pooled: dict[tuple, float] = field(default_factory=dict, init=False, repr=False)
    _pooled_structure: dict[tuple, dict[str, StatisticNoise]] = field(default_factory=dict, init=False, repr=False)
    _family_structure: dict[tuple, dict[str, StatisticNoise]] = field(default_factory=dict, init=False, repr=False)
    _tails: dict[tuple, DrawTail] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        draws: dict[tuple, list[float]] = {}
        for key, deviation in self.estimate.tensors.items():
            group = _micro_batch_group(key)
            self._pooled[group] = max(self._pooled.get(group, 0.0), deviation.relative)
            draws.setdefault(group, []).extend(r for r in deviation.per_sample if math.isfinite(r))
            pooled = self._pooled_structure.setdefault(group, {})
            family = self._family_structure.setdefault(_family_group(key), {})
            for name, values in deviation.structure.items():
                if values:
                    pooled.setdefault(name, StatisticNoise()).add(values, deviation.per_sample)
                    family.setdefault(name, StatisticNoise()).add(values, deviation.per_sample)
        self._tails = heavy_tails(draws)
        for group, tail in self._tails.items():
            self._pooled[group] = max(self._pooled[group], tail.median * tail.family_tail)

    def structure_tolerances(self, key: TensorKey, dtype: str, shape: tuple[int, ...],
                             update_to_value: float | None = None) -> dict[str, float]:
        """alpha x the largest |statistic| over the samples and the tensor's micro-batches (the norm's rule,
        on each statistic's own draws), or x r_t times the statistic per unit of each sample's noise, and at
        least alpha x what noise of the norm's size r_t makes of the statistic when it is uncorrelated with
        the values (structure.uncorrelated_noise): a signed statistic of a few draws can come out near 0 by
        chance, its model cannot. At least the norm's floor (for the bias statistic, what one rounding of
        every element makes of it: the floor's own uncorrelated model).

        The statistic per unit of noise norm (how much of the round-off lies along the values) is taken as
        the largest over the same tensor of every layer (same module, slot, step and phase), not over this
        tensor's own 4 to 8 draws: one signed number per draw bounds its own spread poorly (held-out fp8
        clean runs reached 0.85 of a tolerance from their own draws, 0.36 pooled over layers), while how
        round-off aligns with the values is a property of the computation that made it, which every layer
        repeats. Pooled over a whole phase instead, the bugs' ratios fell to 1.5."""
        deviation = self.estimate.tensors.get(key)
        if deviation is None or deviation.reference_norm == 0:
            return {}
        group = _micro_batch_group(key)
        floor = self.floor_eps * max(machine_epsilon(self.precision), storage_epsilon(dtype))
        relative = self._pooled[group]
        modelled = uncorrelated_noise(relative, shape, machine_epsilon(self.precision))
        if update_to_value:
            modelled["update"] = storage_rounding_noise(update_to_value, math.prod(shape), storage_epsilon(dtype))
        family = self._family_structure.get(_family_group(key), {})
        floors = {"bias": uncorrelated_noise(floor, shape, 0.0)["bias"]} if "bias" in modelled else {}
        return {name: max(self.alpha * max(noise.largest, modelled.get(name, 0.0),
                                           relative * family[name].per_unit_norm), floors.get(name, floor))
                for name, noise in self._pooled_structure.get(group, {}).items()}

    def tolerance_for(self, key: TensorKey, dtype: str) -> Tolerance:
        deviation = self.estimate.tensors.get(key)
        if deviation is None:
            fallback = self.fallback.tolerance_for(key, dtype)
            return Tolerance(fallback.rel, fallback.abs, f"{fallback.source}; not in the perturbation estimate",
                             method="dtype")
        floor = self.floor_eps * max(machine_epsilon(self.precision), storage_epsilon(dtype))
        if deviation.reference_norm == 0:  # an all-zero reference: only an absolute bound means anything
            rms = self.alpha * deviation.deviation / math.sqrt(max(deviation.numel, 1))
            return Tolerance(rel=floor, abs=rms, drift_rel=floor, method="perturbation",
                             params=(("alpha", self.alpha), ("deviation", deviation.deviation), ("samples", self.estimate.num_samples)),
                             source=f"perturbation: alpha {self.alpha:g} x absolute deviation (zero reference)")
        relative = self._pooled[_micro_batch_group(key)]
        if self.alpha * relative < floor:
            return Tolerance(rel=floor, abs=0.0, drift_rel=floor, method="perturbation-floor",
                             params=(("floor_eps", self.floor_eps), ("r_t", relative), ("samples", self.estimate.num_samples)),
                             source=f"perturbation floor {self.floor_eps:g} eps (r_t {relative:.2g})")
        # Replicas are one computation on the same inputs, or one collective's result: a correct run
        # gives them bitwise equal (measured: no clean layout shows any drift), so they may differ by
        # one rounding (the floor), not by the round-off that separates two layouts.
        tail = self._tails.get(_micro_batch_group(key))
        widened = tail is not None and tail.median * tail.family_tail > tail.largest
        how = f"the median of its draws {tail.median:.2g} x the tail {tail.family_tail:.2f} of its layers' draws" \
            if widened else f"{self.estimate.num_samples} samples"
        return Tolerance(rel=self.alpha * relative, abs=0.0, drift_rel=floor, method="perturbation",
                         params=(("alpha", self.alpha), ("r_t", relative), ("samples", self.estimate.num_samples)),
                         source=f"perturbation: alpha {self.alpha:g} x r_t {relative:.2g} ({how})")


@dataclass(frozen=True, slots=True)
class DrawTail:
    """How heavy-tailed one tensor's norm draws are, next to those of the same tensor in every layer."""

    largest: float
    median: float
    family_tail: float
    """The largest (largest draw / median draw) of any tensor of the family (_family_group)."""


def heavy_tails(draws: dict[tuple, list[float]]) -> dict[tuple, DrawTail]:
    """Per micro-batch group: its draws' median and its family's tail, so that r_t is at least median x tail.

    A few draws of a heavy-tailed deviation bound it poorly: a MoE expert's gradient moves with every
    token that the router sends elsewhere, and 4 draws of one expert at step 1 ranged 0.25 to 0.36 while
    the same expert of another layer drew 0.54 to 2.0. How far the largest draw lies above the typical
    one is a property of the computation, which every layer repeats (the structure statistics' per-unit
    noise is pooled the same way), so the family's tail scales this tensor's median; a tensor whose
    draws are as tight as its family's keeps its own largest draw."""
    own: dict[tuple, tuple[float, float]] = {}
    family_tail: dict[tuple, float] = {}
    for group, values in draws.items():
        if len(values) < 2 or (median := statistics.median(values)) <= 0:
            continue
        own[group] = (max(values), median)
        family = _family_of(group)
        family_tail[family] = max(family_tail.get(family, 1.0), max(values) / median)
    return {group: DrawTail(largest=largest, median=median, family_tail=family_tail[_family_of(group)])
            for group, (largest, median) in own.items()}


@dataclass(slots=True)
class StatisticNoise:
    """What round-off made of one structure statistic, pooled over samples and micro-batches."""

    largest: float = 0.0
    """The largest |statistic| of any sample."""
    per_unit_norm: float = 0.0
    """The largest |statistic| / (that sample's relative noise norm)."""

    def add(self, values: list[float], relative_norms: list[float]) -> None:
        self.largest = max(self.largest, max(abs(v) for v in values))
        if len(values) == len(relative_norms):  # one statistic per sample, in the samples' order
            self.per_unit_norm = max(self.per_unit_norm, max((abs(v) / r for v, r in zip(values, relative_norms) if r > 0),
                                                             default=0.0))


def _family_group(key: TensorKey) -> tuple:
    """The tensors whose structure statistics per unit of noise norm are pooled: one tensor of every layer
    (the same module and slot, the layer index left out), in one step's phase."""
    return _family_of(_micro_batch_group(key))


def _family_of(group: tuple) -> tuple:
    step, phase, fqn, slot = group
    return step, phase, layer_family(fqn), slot


def _micro_batch_group(key: TensorKey) -> tuple:
    return key.step, key.phase, key.fqn, key.slot


def layer_position(fqn: str, num_layers: int) -> int:
    """1-based layer of a tensor: `layers.<i>` is i + 1; embeddings 0; anything else above the top (L + 1)."""
    layer = layer_of(fqn)
    if layer is not None:
        return layer + 1
    return 0 if is_embedding(fqn) else num_layers + 1


def theorem_depth(key: TensorKey, num_layers: int) -> int:
    """Layers of round-off a tensor has passed through: from the input in forward, from the loss
    otherwise (the theorem's L + 1 - l for a gradient of layer l)."""
    position = layer_position(key.fqn, num_layers)
    depth = position if key.phase == "forward" else num_layers + 1 - position
    return max(depth, 1)


@dataclass(frozen=True, slots=True)
class TheoremTolerances:
    """rel = k * C**depth * eps (TTrace v1, Theorem 5.3); `fixed_depth` pins one depth for every
    tensor, e.g. L + 1 for Megatron's adopted check at l = 0."""

    num_layers: int
    precision: str
    k: float = DEFAULT_THEOREM_K
    c: float = DEFAULT_THEOREM_C
    fixed_depth: int | None = None

    def tolerance_for(self, key: TensorKey, dtype: str) -> Tolerance:
        depth = self.fixed_depth if self.fixed_depth is not None else theorem_depth(key, self.num_layers)
        rel = self.k * self.c ** depth * machine_epsilon(self.precision)
        return Tolerance(rel=rel, abs=0.0, source=f"theorem: {self.k:g} x {self.c:g}^{depth} x eps", method="theorem",
                         params=(("k", self.k), ("C", self.c), ("depth", depth), ("eps", machine_epsilon(self.precision))))

    def structure_tolerances(self, key: TensorKey, dtype: str, shape: tuple[int, ...],
                             update_to_value: float | None = None) -> dict[str, float]:
        return {}  # the theorem bounds the error's norm only




def exact_inputs_tolerance(tolerance: Tolerance, precision: str, dtype: str, k: float, num_terms: int) -> Tolerance:
    """The tighter of `tolerance` and k * sqrt(num_terms) * eps, for a tensor whose inputs were all exact."""
    rel = k * math.sqrt(num_terms) * max(machine_epsilon(precision), storage_epsilon(dtype))
    if rel >= tolerance.rel:
        return tolerance
    drift_rel = min(rel, tolerance.rel if tolerance.drift_rel is None else tolerance.drift_rel)
    return Tolerance(rel=rel, abs=tolerance.abs, drift_rel=drift_rel, method="exact-inputs",
                     params=(("k", k), ("n", num_terms), ("eps", rel / (k * math.sqrt(num_terms)))),
                     source=f"exact inputs: {k:g} x sqrt({num_terms}) x eps (theorem depth 0), tighter than {tolerance.source}")




def within_of_zero(tolerance: Tolerance, reference_norm: float, numel: int) -> bool:
    """Whether `tolerance` would pass a tensor of zeros against a reference of `reference_norm`: the tensor is
    round-off at that tolerance (a gradient zero in exact arithmetic, such as an attention key bias's)."""
    return numel > 0 and reference_norm <= tolerance.rel * reference_norm + tolerance.abs * math.sqrt(numel)


def untightened(tolerance: Tolerance) -> Tolerance:
    """A tensor's own tolerance, kept where the exact-inputs rule would have tightened it but the tensor is within
    it of zero: a sum that cancels to round-off has a relative error no count of terms bounds."""
    return dataclasses.replace(tolerance, source=f"{tolerance.source} (not tightened for exact inputs: the tensor is "
                                                 "within it of zero, round-off that cancels)")


def num_layers_of(reader: RunReader) -> int:
    """The model's layer count: its manifest's num_layers, else the highest `layers.<i>` traced."""
    declared = reader.manifest.model.get("num_layers")
    if isinstance(declared, int):
        return declared
    indices = [layer for key in reader.index if (layer := layer_of(key.fqn)) is not None]
    return max(indices, default=-1) + 1


def behind_step_scalars(tolerances: ToleranceProvider) -> ToleranceProvider:
    """The provider that judges a pair's tensors: the one behind the step scalars' own tolerances
    (step_scalars.StepScalarTolerances.base), which every comparison puts in front."""
    return getattr(tolerances, "base", tolerances)


def flat_table(tolerances: ToleranceProvider) -> DtypeTolerances | None:
    """The dtype table when it judges the pair's tensors (no estimate of the reference, or --tolerance dtype)."""
    provider = behind_step_scalars(tolerances)
    return provider if isinstance(provider, DtypeTolerances) else None


def fixed_tolerances_note(tolerances: ToleranceProvider, reference: RunReader, candidate: RunReader) -> str | None:
    """When a low-precision pair is judged by the flat dtype table (no estimate of the reference, or --tolerance
    dtype), what that verdict cannot see, and how to get a sharper one; None otherwise. The table's bf16 and fp8
    rows allow a few percent on every tensor, so a pass there says little about a module off by less: the
    perturbation estimate measures each tensor's own round-off, and its structure tests (structure.py) tell a
    scaled, shifted or biased tensor apart from noise well inside that row."""
    table, precision = flat_table(tolerances), candidate.manifest.precision
    if table is None or precision not in LOW_PRECISIONS:
        return None
    row = table.tolerance_for(None, COMPUTE_DTYPES[precision])
    return (f"tolerances: the flat {precision} row of the dtype table (relative {row.rel:g} on every tensor) judged this "
            f"pair, so a tensor off by less than that passes; `ttrace estimate {os.fspath(reference.run_dir)}` measures "
            "each tensor's round-off from the reference itself, and compare then judges tighter, with structure tests "
            "that tell a scaled or shifted tensor from noise (docs/tolerances.md)")


NEAR_MISS_RATIO = 3.0
"""A failing tensor within this factor of a flat-table row is a near miss: the structure tests' own line between a
bug and noise (a zoo bug is caught at ratio >= 3, tests/examples/test_held_out.py)."""


def near_miss_note(tolerances: ToleranceProvider, reference: RunReader, candidate: RunReader,
                   failures: list[TensorComparison]) -> str | None:
    """When an fp32 (or fp64) pair judged by the flat dtype table fails only by near misses of its norm test, what
    that can be, and how to tell; None otherwise. The table's fp32 row is no measure of a model's round-off: an
    adaptive optimizer turns round-off in a small gradient into a step of its full size, and later steps carry
    it (Mixtral under transformers' TP2 failed one step-1 activation at ratio 1.09 there and passed once estimated,
    benchmarks/results/thirdparty_transformers_archs.md). The verdict stands; the note says what would sharpen it."""
    precision = candidate.manifest.precision
    if flat_table(tolerances) is None or precision in LOW_PRECISIONS or not failures:
        return None
    if any(row.status is not ComparisonStatus.MISMATCH or row.decided_by != "mismatch" or row.ratio is None
           or not row.ratio <= NEAR_MISS_RATIO for row in failures):
        return None  # a structural failure, a structure test's verdict, or a clear miss: no near miss
    worst = max(row.ratio for row in failures)
    return (f"tolerances: every failing tensor ({len(failures)}) fails the norm test by at most {worst:.3g}x the flat "
            f"{precision} row of the dtype table, which is no measure of this model's round-off (an adaptive optimizer "
            f"turns round-off in a small gradient into a full step); `ttrace estimate {os.fspath(reference.run_dir)}` "
            "measures each tensor's own, and compare then tells a near miss from a bug (docs/tolerances.md)")


def select_tolerances(kind: str, reference: RunReader, candidate: RunReader, *, alpha: float = DEFAULT_ALPHA,
                      k: float = DEFAULT_THEOREM_K, c: float = DEFAULT_THEOREM_C) -> ToleranceProvider:
    """The provider `ttrace compare --tolerance KIND` uses; "auto" is perturbation when the reference holds an estimate."""
    precision = candidate.manifest.precision
    if kind not in TOLERANCE_KINDS:
        raise TtraceError(f"--tolerance {kind!r}: choose from {', '.join(TOLERANCE_KINDS)}")
    if kind == "theorem":
        return TheoremTolerances(num_layers=num_layers_of(reference), precision=precision, k=k, c=c)
    crossed = reference.manifest.precision != precision
    estimate = read_estimate(reference.run_dir, precision) if kind in ("auto", "perturbation") else None
    if estimate is None:
        if crossed and kind in ("auto", "perturbation"):
            raise TtraceError(f"{estimate_path(reference.run_dir, precision)}: the candidate computes in {precision}, the "
                              f"reference in {reference.manifest.precision}, and no estimate covers that quantization; compare "
                              f"against a reference recorded in {precision}, or run `ttrace estimate "
                              f"{os.fspath(reference.run_dir)} --for-precision {precision}` first")
        if kind == "perturbation":
            raise TtraceError(f"{estimate_path(reference.run_dir)}: no perturbation estimate; run "
                              f"`ttrace estimate {os.fspath(reference.run_dir)}` first, or pass --tolerance theorem|dtype")
        return DtypeTolerances(precision=precision)
    if estimate.precision != precision:
        raise TtraceError(f"{estimate_path(reference.run_dir)}: estimated for precision {estimate.precision} but the "
                          f"candidate runs {precision}; estimate a {precision} reference, or pass --tolerance theorem|dtype")
    return PerturbationTolerances(estimate=estimate, precision=precision, alpha=alpha,
                                  fallback=DtypeTolerances(precision=precision))
