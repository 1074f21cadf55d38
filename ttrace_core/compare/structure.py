"""Part of stage 3 (compare): the structure of an error, next to its size.

The norm test asks whether ||A - E|| / ||E|| is under the round-off noise. In bf16 and fp8 that
noise is wide, and a bug that is a systematic transform of the values hides under it. Round-off
and bugs differ in shape: round-off is nearly uncorrelated with the values, while a bug is often a
scale (x2, x0.5, a sign), a constant added along the token dims (a bias added per rank), or a
parameter update that went missing. Each statistic below measures one such shape; the perturbation
estimate (workflows/estimate.py) measures the same statistic on its re-runs, so each one gets its
own noise level and tolerance, exactly as the norm does (docs/tolerances.md):

- scale: s in the least-squares fit A - E = s * E + c, c constant along every dim but the last
  (the error's projection on the reference, after its per-feature constant). A halved tensor gives
  s = -0.5 whatever its noise; noise uncorrelated with E gives s ~ r / sqrt(n).
- offset: ||c|| (broadcast) / ||E||, the part of the error that is the same on every token.
- bias: k in c = k * b + (the rest), b the bias of the module whose output this is: how many times more
  (or fewer) than the reference the candidate added its own bias. A bias added on every rank before a
  reduction gives k = tp - 1 exactly, however small the bias is next to the output. Measured as k x
  beta, beta = sqrt(R) ||b|| / ||E|| (bias_to_value): the offset along b in units of the tensor's
  norm, which round-off uncorrelated with b makes ~ r / sqrt(n) in every layer, whatever its bias;
  the test reports k and its tolerance in units of the bias.
- shard: the largest ||D_s|| / ||E_s|| over the candidate's shards s (shard_errors.py); the estimate's
  draws measure it over every equal partition of the tensor. A bug in one of p shards is sqrt(p) times
  larger there than over the whole tensor; round-off is as large, relative to a shard's values, as
  the tensor's.
- update: for a post-step parameter, ||(A - A_before) - (E - E_before)|| / ||E - E_before||: the
  step's change judged against the change's own noise, not against the weight's value.

Every statistic is computed in float64 from the full logical tensors, by this module (`statistics`),
at estimate time (on each perturbed re-run) and at compare time (on the candidate); the shard
statistic alone by shard_errors.py, since its compare side needs the candidate's recorded layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ttrace_core.compare.results import StructureTest

STRUCTURE_STATISTICS = ("scale", "offset", "bias", "shard", "update")


@dataclass(frozen=True, slots=True)
class Fit:
    """The least-squares fit error = scale * expected + offset (offset constant along the leading dims)."""

    scale: float
    offset: float | None
    """||offset broadcast||_F / ||expected||_F; None for a tensor with one row (nothing to be constant along)."""
    offset_vector: torch.Tensor | None = None
    """The offset itself, one value per feature (the last dim)."""


def fit_error(diff: torch.Tensor, expected: torch.Tensor) -> Fit | None:
    """The fit of `diff` (actual - expected) on `expected`, both float64 and finite; None when the
    reference is zero or the tensor has fewer than 2 elements (its one number is the norm test's)."""
    if expected.numel() < 2:
        return None
    reference_sq = float(torch.dot(expected.flatten(), expected.flatten()))
    if reference_sq == 0.0:
        return None
    if expected.dim() < 2 or expected.numel() == expected.shape[-1]:
        return Fit(scale=float(torch.dot(diff.flatten(), expected.flatten())) / reference_sq, offset=None)
    rows = expected.reshape(-1, expected.shape[-1])
    errors = diff.reshape(-1, expected.shape[-1])
    row_mean, error_mean = rows.mean(dim=0), errors.mean(dim=0)
    centered = rows - row_mean
    centered_sq = float(torch.dot(centered.flatten(), centered.flatten()))
    scale = float(torch.dot((errors - error_mean).flatten(), centered.flatten())) / centered_sq if centered_sq else 0.0
    offset = error_mean - scale * row_mean
    return Fit(scale=scale, offset=math.sqrt(rows.shape[0]) * float(torch.linalg.vector_norm(offset)) / math.sqrt(reference_sq),
               offset_vector=offset)


def bias_multiple(offset: torch.Tensor, bias: torch.Tensor) -> float | None:
    """k in the least-squares fit offset = k * bias; None when the bias is zero or of another size."""
    bias = bias.double().flatten()
    if bias.numel() != offset.numel():
        return None
    bias_sq = float(torch.dot(bias, bias))
    return float(torch.dot(offset.flatten(), bias)) / bias_sq if bias_sq > 0 else None


def bias_to_value(expected: torch.Tensor, bias: torch.Tensor | None) -> float | None:
    """sqrt(R) ||b|| / ||E||: the offset statistic the module's bias `b` added once more would have (R rows
    of E); None when there is no such bias, or nothing to be constant along."""
    if bias is None or expected.dim() < 2 or bias.numel() != expected.shape[-1] or expected.numel() == expected.shape[-1]:
        return None
    norm = float(torch.linalg.vector_norm(expected))
    rows = expected.numel() // expected.shape[-1]
    ratio = math.sqrt(rows) * float(torch.linalg.vector_norm(bias.double())) / norm if norm > 0 else 0.0
    return ratio if ratio > 0 else None


def update_error(diff: torch.Tensor, diff_before: torch.Tensor, expected: torch.Tensor,
                 expected_before: torch.Tensor) -> float | None:
    """||diff - diff_before|| / ||expected - expected_before||: how far the step's change differs,
    relative to the change; None when the reference did not change."""
    change = float(torch.linalg.vector_norm(expected - expected_before))
    if change == 0.0:
        return None
    return float(torch.linalg.vector_norm(diff - diff_before)) / change


def statistics(diff: torch.Tensor, expected: torch.Tensor, before: tuple[torch.Tensor, torch.Tensor] | None = None,
               bias: torch.Tensor | None = None) -> dict[str, float]:
    """Every statistic this tensor has: {"scale", "offset", "bias", "update"} (signed scale and bias; the
    others >= 0). `before`: (diff, expected) of the parameter before the step, for a post-step parameter;
    `bias`: the bias of the module whose output this is (module_bias.py), as the reference held it."""
    found: dict[str, float] = {}
    fit = fit_error(diff, expected)
    if fit is not None:
        found["scale"] = fit.scale
        if fit.offset is not None:
            found["offset"] = fit.offset
        if fit.offset_vector is not None and (beta := bias_to_value(expected, bias)) is not None and \
                (multiple := bias_multiple(fit.offset_vector, bias)) is not None:
            found["bias"] = multiple * beta
    if before is not None and before[1].shape == expected.shape:
        update = update_error(diff, before[0], expected, before[1])
        if update is not None:
            found["update"] = update
    return found


NOISE_SIGMAS = 3.0
"""How many standard deviations of a statistic's uncorrelated-noise model its tolerance covers (before
alpha): a Gaussian statistic passes this bound by chance with probability 0.3%, and alpha 4 on top
makes that 12 sigma for noise as large as the estimate's."""


def uncorrelated_noise(relative_noise: float, shape: tuple[int, ...], eps: float, spread: float = 1.0) -> dict[str, float]:
    """What round-off of relative norm `relative_noise` makes of each statistic, where the perturbation may
    not show it: noise uncorrelated with the values projects on them with std spread x r / sqrt(n), and its
    part constant along the rows averages R rows, std r / sqrt(R) (NOISE_SIGMAS of each); a shard's error is
    r of its values, as the whole tensor's; and one rounding
    of a scalar that multiplies the whole tensor (a loss scale, 1 / num_tokens, a norm's reciprocal, kept in
    the compute dtype) scales it by up to `eps`, which no weight perturbation moves. Never more than r itself
    (Cauchy-Schwarz: |scale| <= ||error|| / ||reference||). `spread`: rounding_spread of the values.

    The bias statistic too: iid noise of std r ||E|| / sqrt(n) averages over the R rows to a per-feature
    offset of std r ||E|| / sqrt(n R), whose projection on the bias direction, times sqrt(R) / ||E||, has
    std r / sqrt(n); never more than r (the whole error)."""
    numel = math.prod(shape)
    if numel < 2:
        return {}
    rows = numel // shape[-1] if shape else 1
    found = {"scale": min(relative_noise, max(relative_noise * NOISE_SIGMAS * spread / math.sqrt(numel), eps))}
    found["shard"] = relative_noise
    if rows > 1:
        found["offset"] = relative_noise * min(1.0, NOISE_SIGMAS / math.sqrt(rows))
        found["bias"] = relative_noise * min(1.0, NOISE_SIGMAS / math.sqrt(numel))
    return found


def rounding_spread(values: torch.Tensor) -> float:
    """How much more than 1 / sqrt(n) relative round-off projects on the values: sqrt(n sum x^4) / sum x^2.

    Rounding errs relative to each element, e_i = d_i x_i with d_i independent of the values, so its
    projection on them, sum d_i x_i^2 / sum x_i^2, has std sigma_d sqrt(sum x^4) / sum x^2 while its
    relative norm is sigma_d: the std is r / sqrt(n) times this factor, 1 for values of one magnitude,
    sqrt(3) for Gaussian ones, more for heavy-tailed activations. (Held-out fp32 TP2 runs showed an
    attention projection's 2-term sum 7 of the flat model's sigmas along its values.)"""
    squares = values.double().square()
    total = float(squares.sum())
    if total == 0 or not math.isfinite(total):
        return 1.0
    return max(1.0, math.sqrt(values.numel() * float(squares.square().sum())) / total)


def with_exact_inputs(allowed: dict[str, float], exact_rel: float, shape: tuple[int, ...],
                      spread: float = 1.0) -> dict[str, float]:
    """Tighten the scale and offset tolerances of a tensor whose inputs were all exact (exact_inputs.py): its
    two runs then differ only by the rounding of its last few partial sums, elementwise and relative to
    the values, of relative norm at most `exact_rel` (k sqrt(n) eps); no scalar multiplies the difference,
    so what is left is the uncorrelated model with r = exact_rel and the values' `spread` (rounding_spread)."""
    modelled = uncorrelated_noise(exact_rel, shape, eps=0.0, spread=spread)
    return {name: min(tolerance, modelled[name]) if name in modelled else tolerance for name, tolerance in allowed.items()}


OPTIMIZER_ROUNDINGS = 4.0
"""Roundings of the optimizer's own arithmetic on an update (a moment, a square root, a division, the learning
rate), each of one fp32 unit relative to the update, that two correct implementations (foreach, fused,
sharded) may order differently. Mixed-precision optimizers keep fp32 state; one computing in a narrower
dtype shows its noise in the estimate's own draws."""
FP32_UNIT_ROUNDOFF = 2.0**-24


def storage_rounding_noise(update_to_value: float, numel: int, storage_eps: float) -> float:
    """What rounding the new value into its storage dtype makes of the update statistic, where the estimate's
    re-runs computed the update bit for bit alike. Two runs whose unrounded values differ by d round to
    values one ulp (eps |E_i|) apart with probability d / ulp, so they differ on a Poisson number of
    elements, mean lam = OPTIMIZER_ROUNDINGS u_fp32 n (||dE|| / ||E||) / eps; allowing lam + 3 sqrt(lam) + 1
    of them, each an ulp of the rms value, the statistic is sqrt(k / n) eps / (||dE|| / ||E||), and never
    more than every element rounded apart, eps / (||dE|| / ||E||)."""
    if update_to_value <= 0 or numel < 1:
        return 0.0
    mean = OPTIMIZER_ROUNDINGS * FP32_UNIT_ROUNDOFF * numel * update_to_value / storage_eps
    rounded_apart = min(mean + NOISE_SIGMAS * math.sqrt(mean) + 1.0, numel)
    return math.sqrt(rounded_apart / numel) * storage_eps / update_to_value


def structure_tests(measured: dict[str, float], tolerances: dict[str, float], bias_ratio: float | None = None
                    ) -> list[StructureTest]:
    """The tests of the statistics both measured on the candidate and given a tolerance by the estimate; the
    bias test is stated in units of the module's bias (value and tolerance / `bias_ratio`, the same ratio)."""
    tests = []
    for name in STRUCTURE_STATISTICS:
        if name not in measured or name not in tolerances:
            continue
        value, tolerance = measured[name], tolerances[name]
        if name == "update" and tolerance >= 1.0:
            continue  # round-off moves this update as much as the step does (a key bias, a frozen weight): no signal
        if name == "bias":
            if not bias_ratio:
                continue
            value, tolerance = value / bias_ratio, tolerance / bias_ratio
        ratio = abs(value) / tolerance if tolerance > 0 else (0.0 if value == 0 else math.inf)
        tests.append(StructureTest(name=name, value=value, tolerance=tolerance, ratio=ratio,
                                   finding=_finding(name, value, tolerance) if ratio > 1 else ""))
    return tests


REPLICA_UPDATE = "replica update"
REPLICA_MARGIN = 4.0
"""The margin on the rounding model of replicas (the estimate's alpha, for a model instead of draws): it
counts straddles at the rms value, and the elements that round apart may be the largest."""


def replica_update_test(drift_relative: float, ranks: tuple[int, ...], update_to_value: float, numel: int,
                        storage_eps: float) -> StructureTest | None:
    """Replicas of a post-step parameter judged in units of the update, not of the value: replicas that
    held the same value before the step and took the same step differ by rounding alone
    (storage_rounding_noise); one that missed its step (a stale shard of the distributed optimizer)
    differs by all of the update, which next to the value is only an ulp or two in bf16."""
    if update_to_value <= 0 or drift_relative <= 0:
        return None
    value = drift_relative / update_to_value
    tolerance = REPLICA_MARGIN * storage_rounding_noise(update_to_value, numel, storage_eps)
    if tolerance >= 1.0:
        return None  # the step is below one rounding of the value: replicas cannot show it
    ratio = value / tolerance
    finding = (f"its replicas on ranks {', '.join(map(str, ranks))} differ by {value:.0%} of the update (rounding "
               f"allows {tolerance:.2%}): one of them did not take the same step") if ratio > 1 else ""
    return StructureTest(name=REPLICA_UPDATE, value=value, tolerance=tolerance, ratio=ratio, finding=finding)


def _finding(name: str, value: float, tolerance: float) -> str:
    if name == "scale":
        factor = 1.0 + value
        if abs(factor) <= tolerance:
            return (f"does not follow the reference: scaled by {factor:.3f} (x0 within +/- {tolerance:.2g}), what is "
                    "left is unrelated to it")
        sign = ", its sign flipped" if factor < 0 else ""
        return f"scaled by {factor:.3f} (x{factor:.3g} +/- {tolerance:.2g} under round-off){sign}"
    if name == "bias":
        return (f"offset by {value:.3g} x its module's own bias (+/- {tolerance:.2g} under round-off): the bias is added "
                f"{'more' if value > 0 else 'fewer'} times than in the reference (e.g. once per rank before a reduction)")
    if name == "shard":
        return f"one shard's error is {value:.3g} of its values (round-off allows {tolerance:.2g})"
    if name == "offset":
        return (f"offset by the same amount on every token ({value:.3g} of the tensor's norm; round-off allows "
                f"{tolerance:.2g})")
    return f"its update differs from the reference's by {value:.0%} of that update (round-off allows {tolerance:.0%})"


def detectable_error(norm_rel: float, tests: list[StructureTest], update_to_value: float | None = None,
                     bias_ratio: float | None = None) -> float:
    """The smallest relative error ||A - E|| / ||E|| one of the tests catches: the norm test's rel, a
    scale or offset of its tolerance, an update error of its tolerance (in units of the update, so
    times ||E - E_before|| / ||E||, `update_to_value`), or a multiple of the module's bias of its
    tolerance (times sqrt(R) ||b|| / ||E||, `bias_ratio`)."""
    caught = [norm_rel]
    for test in tests:
        if test.name == REPLICA_UPDATE:
            continue  # replicas against each other, not the candidate against the reference
        if test.name in ("update", "bias"):
            unit = update_to_value if test.name == "update" else bias_ratio
            if unit is not None:
                caught.append(test.tolerance * unit)
        else:
            caught.append(test.tolerance)
    return min(caught)
