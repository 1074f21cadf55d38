"""Structure statistics (compare/structure.py): each one fires on the transform it is built for, and noise
of the estimate's own size stays at ratio <= 0.5, through the same path as a real comparison: the
estimate's per-sample statistics -> PerturbationTolerances.structure_tolerances -> structure_tests."""

import math

import pytest
import torch

from ttrace_core.compare.estimate_file import PerturbationEstimate, TensorDeviation
from ttrace_core.compare.results import StructureTest
from ttrace_core.compare.structure import (bias_to_value, replica_update_test, rounding_spread, statistics, structure_tests,
                                          with_exact_inputs)
from ttrace_core.compare.shard_errors import largest_block_error, worst_shard
from ttrace_core.compare.tolerances import PerturbationTolerances
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey

NOISE = 0.02
"""Relative round-off noise per element, about bf16's with a few roundings."""
SHAPE = (64, 2, 128)
"""An activation: sequence x batch x hidden."""
KEY = TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.mlp", slot="output.0")
PARAM = TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="param", fqn="layers.0.mlp.weight", slot="value")


def _noisy(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return values * (1 + NOISE * torch.randn(values.shape, generator=generator, dtype=torch.float64))


def _estimate(key: TensorKey, expected: torch.Tensor, samples: list[dict[str, float]], relatives: list[float],
              precision: str = "bf16") -> PerturbationTolerances:
    deviation = TensorDeviation(key=key, deviation=max(relatives) * float(expected.norm()), reference_norm=float(expected.norm()),
                                numel=expected.numel(), per_sample=relatives,
                                structure={name: [s[name] for s in samples] for name in samples[0]})
    estimate = PerturbationEstimate(precision=precision, num_samples=len(samples), relative=2.0**-8, tensors={key: deviation})
    return PerturbationTolerances(estimate=estimate, precision=precision)


def _tests(candidate: torch.Tensor, expected: torch.Tensor, *, seed: int = 0, bias: torch.Tensor | None = None
           ) -> dict[str, StructureTest]:
    """Each statistic's test for `candidate` against `expected`, its tolerance from 4 noisy re-runs; with
    `bias`, the module's own bias (the bias test)."""
    generator = torch.Generator().manual_seed(seed)
    perturbed = [_noisy(expected, generator) for _ in range(4)]
    samples = [statistics(p - expected, expected, bias=bias) for p in perturbed]
    relatives = [float((p - expected).norm() / expected.norm()) for p in perturbed]
    tolerances = _estimate(KEY, expected, samples, relatives).structure_tolerances(KEY, "bfloat16", tuple(expected.shape))
    measured = statistics(candidate - expected, expected, bias=bias)
    return {t.name: t for t in structure_tests(measured, tolerances, bias_to_value(expected, bias))}


def _ratios(candidate: torch.Tensor, expected: torch.Tensor, *, seed: int = 0, bias: torch.Tensor | None = None
            ) -> dict[str, float]:
    return {name: test.ratio for name, test in _tests(candidate, expected, seed=seed, bias=bias).items()}


@pytest.fixture
def activation() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=generator, dtype=torch.float64) + 0.3


def test_noise_alone_stays_at_half_the_line(activation):
    bias = 0.02 * torch.randn(SHAPE[-1], generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    for seed in range(20):
        generator = torch.Generator().manual_seed(100 + seed)
        ratios = _ratios(_noisy(activation + bias, generator), activation + bias, seed=seed, bias=bias)
        assert set(ratios) == {"scale", "offset", "bias"}
        assert max(ratios.values()) <= 0.5, (seed, ratios)


@pytest.mark.parametrize("factor", [0.5, 2.0, -1.0, 0.9])
def test_a_scale_or_a_sign_fires_the_scale_test(activation, factor):
    generator = torch.Generator().manual_seed(7)
    candidate = _noisy(activation * factor, generator)
    ratios = _ratios(candidate, activation)
    assert ratios["scale"] >= 3
    found = structure_tests(statistics(candidate - activation, activation), {"scale": 0.01})[0]
    stated = float(found.finding.removeprefix("scaled by ").split()[0])
    assert abs(stated - factor) <= 3 * NOISE / math.sqrt(activation.numel()) * abs(factor) + 5e-4
    assert ("sign flipped" in found.finding) == (factor < 0)


def test_a_bias_added_on_one_rank_fires_the_offset_test(activation):
    generator = torch.Generator().manual_seed(8)
    bias = 0.075 * torch.randn(SHAPE[-1], generator=generator, dtype=torch.float64)
    candidate = _noisy(activation + bias, generator)
    norm_relative = float((candidate - activation).norm() / activation.norm())
    assert norm_relative < 4 * NOISE  # under the norm test's tolerance: it passes there
    assert _ratios(candidate, activation)["offset"] >= 3


@pytest.mark.parametrize("times", [1, -1])
def test_a_bias_added_once_per_rank_fires_the_bias_test_however_small_the_bias(activation, times):
    """A row-parallel linear that adds its bias on each of tp ranks before the all-reduce adds it tp - 1 times
    too often (-1: a bias never added). The bias here is 1% of the output's rms, so the error stays far under the
    norm test and the offset test (noise 2%), but it lies exactly along the module's own bias."""
    generator = torch.Generator().manual_seed(12)
    bias = 0.01 * torch.randn(SHAPE[-1], generator=generator, dtype=torch.float64)
    expected = activation + bias
    candidate = _noisy(expected + times * bias, generator)
    tests = _tests(candidate, expected, bias=bias)
    assert tests["offset"].ratio < 1 and float((candidate - expected).norm() / expected.norm()) < 4 * NOISE
    assert tests["bias"].ratio >= 3
    found = tests["bias"]
    assert abs(found.value - times) < 0.1 and found.finding.startswith(f"offset by {found.value:.3g} x its module's own bias")
    assert ("more times" if times > 0 else "fewer times") in found.finding


def test_the_bias_statistic_is_the_same_in_every_layer_whatever_its_bias():
    """The statistic is the offset along the bias in units of the tensor's norm: round-off that shows 0.4 of a
    bias of 1% in one layer shows 0.04 of a bias of 10% in another, so pooling layers compares like with like."""
    generator = torch.Generator().manual_seed(13)
    expected = torch.randn(SHAPE, generator=generator, dtype=torch.float64)
    direction = torch.randn(SHAPE[-1], generator=generator, dtype=torch.float64)
    error = 0.004 * direction.expand(SHAPE)
    small, large = statistics(error, expected, bias=0.01 * direction), statistics(error, expected, bias=0.1 * direction)
    assert small["bias"] == pytest.approx(large["bias"])
    assert bias_to_value(expected, 0.01 * direction) == pytest.approx(bias_to_value(expected, 0.1 * direction) / 10)


@pytest.mark.parametrize("transform", ["stale shard", "shifted slice"])
def test_a_stale_shard_or_a_shifted_slice_fires_the_scale_test(activation, transform):
    candidate = activation.clone()
    if transform == "stale shard":  # rank 1's half of the hidden dim holds another micro-batch's values
        candidate[..., 64:] = torch.randn(SHAPE[0], SHAPE[1], 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    else:  # the sequence shifted by one token
        candidate = torch.roll(activation, 1, dims=0)
    assert _ratios(candidate, activation)["scale"] >= 3


def test_a_missing_update_fires_the_update_test():
    """A post-step parameter whose shard kept its old value: a small error next to the weight, all of the update."""
    generator = torch.Generator().manual_seed(3)
    before = torch.randn(256, 64, generator=generator, dtype=torch.float64)
    update = 0.01 * torch.sign(torch.randn(256, 64, generator=generator, dtype=torch.float64))
    after = before + update

    def noisy_run() -> tuple[torch.Tensor, torch.Tensor]:
        start = before * (1 + 2.0**-9 * (2 * torch.rand(before.shape, generator=generator, dtype=torch.float64) - 1))
        return start, start + update * (1 + NOISE * torch.randn(update.shape, generator=generator, dtype=torch.float64))

    runs = [noisy_run() for _ in range(4)]
    samples = [statistics(a - after, after, (b - before, before)) for b, a in runs]
    relatives = [float((a - after).norm() / after.norm()) for _, a in runs]
    tolerances = _estimate(PARAM, after, samples, relatives).structure_tolerances(PARAM, "bfloat16", tuple(after.shape))
    stale = after.clone()
    stale[128:] = before[128:]  # the distributed optimizer's second shard never refreshed
    tests = {t.name: t for t in structure_tests(statistics(stale - after, after, (before - before, before)), tolerances)}
    assert tests["update"].ratio >= 3
    assert math.isclose(tests["update"].value, math.sqrt(0.5), rel_tol=1e-9)
    clean_start, clean_after = noisy_run()
    clean = {t.name: t.ratio for t in structure_tests(statistics(clean_after - after, after, (clean_start - before, before)),
                                                       tolerances)}
    assert clean["update"] <= 0.5


def test_an_update_rounded_otherwise_into_its_storage_passes_and_a_stale_one_does_not():
    """fp32 weights near 1 moved by about 1e-3 (an AdamW step): the estimate's re-runs computed the update
    bit for bit alike (statistic 0), a correct candidate applied it with other roundings (a fused or
    sharded optimizer), so a few elements round to the neighbouring fp32 value."""
    generator = torch.Generator().manual_seed(5)
    before = (1 + 0.01 * torch.randn(4096, generator=generator)).float()
    update = (1e-3 * torch.randn(4096, generator=generator)).float()
    after = (before + update).double()
    otherwise = (before + update * (1 + 2.0**-22 * torch.randn(4096, generator=generator)).float()).double()
    before = before.double()
    assert 0 < int((otherwise != after).sum()) < 100
    measured = statistics(after - after, after, (before - before, before))
    provider = _estimate(PARAM, after, [measured] * 4, [0.0] * 4, "fp32")
    update_to_value = float((after - before).norm() / after.norm())

    def update_ratio(candidate: torch.Tensor, modelled: bool) -> float:
        allowed = provider.structure_tolerances(PARAM, "float32", (4096,), update_to_value if modelled else None)
        tests = structure_tests(statistics(candidate - after, after, (before - before, before)), allowed)
        return next(t.ratio for t in tests if t.name == "update")

    assert update_ratio(otherwise, modelled=False) > 1  # the re-runs alone: a false alarm
    assert update_ratio(otherwise, modelled=True) <= 0.5
    stale = after.clone()
    stale[2048:] = before[2048:]
    assert update_ratio(stale, modelled=True) >= 3


def test_a_replica_that_missed_its_step_fails_in_units_of_the_update():
    """bf16 weights moved by 1.5% (about 2 ulps): rank 1's replica kept half of its old values, which is 1.5%
    of the value, 2 eps, yet all of the update; replicas apart by a few roundings stay under the line."""
    generator = torch.Generator().manual_seed(6)
    before = torch.randn(16384, generator=generator).bfloat16()
    after = (before.float() * (1 + 0.015 * torch.randn(16384, generator=generator))).bfloat16()
    update_to_value = float((after.double() - before.double()).norm() / after.double().norm())
    eps = torch.finfo(torch.bfloat16).eps

    def replica_ratio(replica: torch.Tensor) -> float:
        drift = float((replica.double() - after.double()).norm() / after.double().norm())
        test = replica_update_test(drift, (0, 1), update_to_value, after.numel(), eps)
        return 0.0 if test is None else test.ratio

    stale = after.clone()
    stale[8192:] = before[8192:]
    assert replica_ratio(stale) >= 3
    rounded_apart = after.clone()
    rounded_apart[:2] = (after[:2].float() * (1 + eps)).bfloat16()  # two elements one ulp apart
    assert 0 < replica_ratio(rounded_apart) <= 0.5


def test_a_tensor_of_one_element_has_no_structure_test():
    one = torch.tensor([2.0], dtype=torch.float64)
    assert statistics(one * 0.5 - one, one) == {}


def test_a_scale_tolerance_learns_how_round_off_aligns_with_values_from_every_layer():
    """Round-off that shrinks values (an fp8 underflow, a sign-biased update) lies along them: a draw's scale is
    then a large part of its norm. Layer 0's 4 draws happened to lie across its values (scale 1% of the noise);
    the same tensor of layer 1 shows the alignment (scale 40% of the noise). Each layer's scale tolerance uses
    the largest alignment of that tensor over the layers times its own noise, so a candidate whose round-off
    lies along its values (scale 0.3 x noise) stays within half the line; another tensor keeps its own."""
    key_b = TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.1.mlp", slot="output.0")
    key_other_phase = TensorKey(step=0, micro_batch=0, phase="backward", fqn="layers.1.mlp", slot="grad_input.0")
    noise = 0.2  # fp8-sized, well above bf16's scalar rounding model (alpha x eps)
    relatives = [noise] * 4

    def deviation(key, scale_per_unit):
        return TensorDeviation(key=key, deviation=noise, reference_norm=1.0, numel=8192, per_sample=relatives,
                               structure={"scale": [scale_per_unit * noise * s for s in (1, -1, 1, -1)]})

    tensors = {KEY: deviation(KEY, 0.01), key_b: deviation(key_b, 0.4), key_other_phase: deviation(key_other_phase, 0.01)}
    provider = PerturbationTolerances(estimate=PerturbationEstimate(precision="bf16", num_samples=4, relative=2.0**-8,
                                                                    tensors=tensors), precision="bf16")
    aligned = provider.structure_tolerances(KEY, "bfloat16", (64, 128))["scale"]
    assert aligned == pytest.approx(provider.alpha * 0.4 * noise)
    assert 0.3 * noise / aligned <= 0.5
    own = provider.structure_tolerances(key_other_phase, "bfloat16", (64, 128))["scale"]
    assert own < aligned / 4


@pytest.mark.parametrize("values, spread", [
    (torch.full((1000,), 3.0), 1.0),
    (torch.tensor([1.0, -1.0] * 500), 1.0),
    (torch.tensor([10.0] + [0.0] * 99), 10.0),  # sqrt(100 * 1e4) / 100
], ids=["constant", "one-magnitude", "one-spike"])
def test_rounding_spread_is_one_for_values_of_one_magnitude_and_grows_with_their_tail(values, spread):
    assert rounding_spread(values) == pytest.approx(spread)


def test_exact_inputs_scale_tolerance_holds_relative_rounding_of_heavy_tailed_values():
    """An exact-inputs tensor's two runs differ by rounding relative to each element; on heavy-tailed values
    (a Student-t activation) its projection on the values exceeds the flat r / sqrt(n) model, not the spread one."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():  # StudentT samples from the global generator: seed it, or the test depends on order
        torch.manual_seed(0)
        expected = torch.distributions.StudentT(3.0).sample((64, 2, 128)).double()
    exact_rel = 4 * math.sqrt(2) * 2.0**-23
    worst_flat, worst_spread = 0.0, 0.0
    for _ in range(20):
        # each element rounded by up to a few units relative to itself: relative norm 0.3 x exact_rel, as measured
        uniform = 2 * torch.rand(expected.shape, generator=generator, dtype=torch.float64) - 1
        error = expected * uniform * math.sqrt(3) * 0.3 * exact_rel
        scale = abs(statistics(error, expected)["scale"])
        flat = with_exact_inputs({"scale": 1.0}, exact_rel, tuple(expected.shape))["scale"]
        spread = with_exact_inputs({"scale": 1.0}, exact_rel, tuple(expected.shape), rounding_spread(expected))["scale"]
        worst_flat, worst_spread = max(worst_flat, scale / flat), max(worst_spread, scale / spread)
    assert worst_spread <= 0.5 < worst_flat
    # and a real scale error of 4 roundings still fails: x (1 + 4 eps) on every element
    assert abs(statistics(expected * 4 * 2.0**-23, expected)["scale"]) / (
        with_exact_inputs({"scale": 1.0}, exact_rel, tuple(expected.shape), rounding_spread(expected))["scale"]) > 3


def test_a_tensor_whose_draws_are_tighter_than_its_layers_gets_their_tail():
    """4 draws of one MoE expert's step-1 gradient ranged 0.25 to 0.36 while the same expert of another layer drew
    0.54 to 2.0 (a router sending tokens elsewhere): r_t is at least the median of a tensor's draws times the largest
    tail (largest / median) of its family; a tensor of another family keeps its own largest draw."""
    def key(fqn):
        return TensorKey(step=1, micro_batch=NO_MICRO_BATCH, phase="grad", fqn=fqn, slot="grad")

    draws = {key("layers.6.experts.0.fc2.weight"): [0.29, 0.35, 0.25, 0.33],
             key("layers.1.experts.0.fc2.weight"): [0.54, 0.77, 1.04, 1.98],
             key("layers.6.attn.weight"): [0.29, 0.35, 0.25, 0.33]}
    tensors = {k: TensorDeviation(key=k, deviation=max(v), reference_norm=1.0, numel=4096, per_sample=v) for k, v in draws.items()}
    provider = PerturbationTolerances(estimate=PerturbationEstimate(precision="fp8", num_samples=4, relative=2.0**-8,
                                                                    tensors=tensors), precision="fp8")
    tail = 1.98 / ((0.77 + 1.04) / 2)
    widened = provider.tolerance_for(key("layers.6.experts.0.fc2.weight"), "bfloat16")
    assert widened.rel == pytest.approx(provider.alpha * 0.31 * tail)
    assert "tail" in widened.source
    assert provider.tolerance_for(key("layers.1.experts.0.fc2.weight"), "bfloat16").rel == pytest.approx(provider.alpha * 1.98)
    assert provider.tolerance_for(key("layers.6.attn.weight"), "bfloat16").rel == pytest.approx(provider.alpha * 0.35)


def test_one_stale_shard_fires_the_shard_test_and_noise_alone_stays_under_half():
    """Rank 1's quarter of the rows holds values 30% off on a TP4 layout of 4 row blocks: over the whole tensor
    that is under 3 of the norm's tolerance, in its shard over 3 of the shard's (a quarter's error is up to
    sqrt(4) times the whole's). The estimate's draws measure every equal partition. Noise alone stays <= 0.5."""
    generator = torch.Generator().manual_seed(21)
    expected = torch.randn(256, 64, generator=generator, dtype=torch.float64)
    shards = {(((64 * r, 64), (0, 64)),): (r,) for r in range(4)}
    draws = [_noisy(expected, generator) for _ in range(4)]
    relatives = [float((d - expected).norm() / expected.norm()) for d in draws]
    samples = [{**statistics(d - expected, expected), "shard": largest_block_error(d - expected, expected)} for d in draws]
    tolerances = _estimate(KEY, expected, samples, relatives).structure_tolerances(KEY, "bfloat16", tuple(expected.shape))

    def shard_test(candidate):
        worst = worst_shard(candidate - expected, expected, shards)
        return next(t for t in structure_tests({"shard": worst[0]}, tolerances) if t.name == "shard"), worst

    stale = _noisy(expected, generator)
    stale[64:128] *= 1 + 0.3 * torch.randn(64, 64, generator=generator, dtype=torch.float64)
    assert float((stale - expected).norm() / expected.norm()) < 3 * 4 * max(relatives)  # the norm ratio stays under 3
    test, (_, ranks, others) = shard_test(stale)
    assert test.ratio >= 3 and ranks == (1,) and others <= test.tolerance
    for seed in range(10):
        clean, _ = shard_test(_noisy(expected, torch.Generator().manual_seed(200 + seed)))
        assert clean.ratio <= 0.5, (seed, clean.ratio)


def test_the_largest_block_error_covers_every_equal_partition():
    expected = torch.ones(8, 6, dtype=torch.float64)
    diff = torch.zeros(8, 6, dtype=torch.float64)
    diff[7, 0] = 1.0  # one element of the last row: the last of 8 row blocks holds it alone
    assert largest_block_error(diff, expected) == pytest.approx(math.sqrt(1 / 6))
    assert largest_block_error(torch.zeros(7), torch.ones(7)) is None  # 7 elements: no equal partition
