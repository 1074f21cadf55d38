import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.compare.estimate_file import PerturbationEstimate, TensorDeviation, read_estimate, write_estimate
from ttrace_core.record.generator import WeightPerturbation
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey
from ttrace_core.compare.tolerances import (
    FP32_UNIT_ROUNDOFF,
    REDUCTION_K,
    PerturbationTolerances,
    TheoremTolerances,
    layer_position,
    machine_epsilon,
    theorem_depth,
    with_step_scalars,
)

BF16_EPS = 2.0 ** -7


def key(phase: str, fqn: str, micro_batch: int = 0, slot: str = "output.0") -> TensorKey:
    micro_batch = NO_MICRO_BATCH if phase in ("grad", "param") else micro_batch
    return TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot)


@pytest.mark.parametrize(
    "phase, fqn, depth",
    [
        ("forward", "embedding.word_embeddings", 1),
        ("forward", "decoder.layers.0.mlp", 1),
        ("forward", "decoder.layers.3.mlp", 4),
        ("forward", "decoder.final_layernorm", 5),
        ("backward", "decoder.final_layernorm", 1),
        ("backward", "decoder.layers.3.mlp", 1),
        ("grad", "decoder.layers.0.mlp.linear_fc1.weight", 4),
        ("grad", "embedding.word_embeddings.weight", 5),
        ("param", "layers.1.attn.wq.weight", 3),
    ],
    ids=["embedding-fwd", "layer0-fwd", "layer3-fwd", "top-fwd", "top-bwd", "layer3-bwd", "layer0-grad",
         "embedding-grad", "torch-gpt-param"],
)
def test_theorem_depth_counts_layers_from_the_input_or_the_loss(phase, fqn, depth):
    assert theorem_depth(key(phase, fqn), num_layers=4) == depth


def test_layer_position_is_one_based_with_embeddings_below_and_heads_above():
    assert [layer_position(f, 4) for f in ("tok_emb", "layers.0.attn", "h.2.mlp", "output_layer")] == [0, 1, 3, 5]


def test_theorem_tolerance_is_k_c_pow_depth_eps():
    provider = TheoremTolerances(num_layers=4, precision="bf16")
    tolerance = provider.tolerance_for(key("grad", "decoder.layers.0.mlp.linear_fc1.weight"), "float32")
    assert tolerance.rel == pytest.approx(4 * 1.03 ** 4 * BF16_EPS)
    megatron_l0 = TheoremTolerances(num_layers=32, precision="bf16", fixed_depth=33)
    assert megatron_l0.tolerance_for(key("forward", "x"), "bfloat16").rel == pytest.approx(0.0832, abs=5e-4)


def test_fp8_recipes_use_the_bf16_epsilon():
    assert machine_epsilon("fp8") == machine_epsilon("bf16") == BF16_EPS
    with pytest.raises(TtraceError, match="precision 'int4'"):
        machine_epsilon("int4")


def _estimate(*deviations: tuple[TensorKey, float, float]) -> PerturbationEstimate:
    tensors = {k: TensorDeviation(key=k, deviation=d, reference_norm=n, numel=4) for k, d, n in deviations}
    return PerturbationEstimate(precision="bf16", num_samples=2, relative=BF16_EPS / 2, tensors=tensors)


def test_perturbation_tolerance_is_alpha_times_deviation_pooled_over_micro_batches():
    quiet, loud = key("forward", "layers.0", micro_batch=0), key("forward", "layers.0", micro_batch=1)
    provider = PerturbationTolerances(estimate=_estimate((quiet, 0.02, 1.0), (loud, 0.05, 1.0)), precision="bf16", alpha=4)
    tolerance = provider.tolerance_for(quiet, "bfloat16")
    assert tolerance.rel == pytest.approx(4 * 0.05) and "perturbation" in tolerance.source


def test_perturbation_tolerance_has_a_floor_and_an_absolute_bound_for_zero_references():
    still, zero = key("forward", "layers.0"), key("forward", "layers.1")
    provider = PerturbationTolerances(estimate=_estimate((still, 0.0, 1.0), (zero, 0.5, 0.0)), precision="bf16")
    assert provider.tolerance_for(still, "bfloat16").rel == BF16_EPS
    assert provider.tolerance_for(zero, "bfloat16").abs == pytest.approx(4 * 0.5 / math.sqrt(4))


def test_perturbation_tolerance_falls_back_to_the_dtype_table_and_says_so():
    provider = PerturbationTolerances(estimate=_estimate(), precision="bf16")
    tolerance = provider.tolerance_for(key("forward", "layers.9"), "bfloat16")
    assert tolerance.rel == 4e-2 and "not in the perturbation estimate" in tolerance.source


def test_estimate_round_trips_and_a_broken_one_is_named(tmp_path: Path):
    estimate = _estimate((key("forward", "layers.0"), 0.25, 2.0))
    write_estimate(tmp_path, estimate)
    loaded = read_estimate(tmp_path)
    assert loaded.tensors == estimate.tensors and loaded.relative == estimate.relative
    (tmp_path / "tolerance_estimate.json").write_text('{"format": "something else"}')
    with pytest.raises(TraceFormatError, match="tolerance_estimate.json.*run `ttrace estimate` again"):
        read_estimate(tmp_path)


def test_weight_perturbation_is_bounded_deterministic_and_layout_independent():
    full = torch.randn(8, 6)
    perturbation = WeightPerturbation(sample=1, relative=1e-3)
    moved = perturbation.apply(0, "w", full)
    assert torch.equal(moved, perturbation.apply(0, "w", full))
    assert ((moved / full - 1).abs() <= 1e-3 * (1 + 1e-6)).all() and not torch.equal(moved, full)
    assert not torch.equal(moved, WeightPerturbation(sample=2, relative=1e-3).apply(0, "w", full))
    with pytest.raises(ValueError, match="relative"):
        WeightPerturbation(sample=0, relative=0.0)


def test_replicas_may_differ_by_one_rounding_not_by_the_layout_tolerance():
    quiet = key("forward", "layers.0")
    provider = PerturbationTolerances(estimate=_estimate((quiet, 0.05, 1.0)), precision="bf16", alpha=4)
    tolerance = provider.tolerance_for(quiet, "bfloat16")
    assert tolerance.rel == pytest.approx(0.2) and tolerance.drift_rel == BF16_EPS
    from ttrace_core.compare.engine import _drift_ratio

    drift = {"ranks": (0, 1), "max_abs_diff": 0.1, "relative_diff": 0.02}
    assert _drift_ratio(drift, tolerance) == pytest.approx(0.02 / BF16_EPS)


def test_a_loss_the_perturbation_did_not_move_may_still_differ_by_its_reductions_round_off():
    """A mean over 64 tokens of a log-sum-exp over 128 logits, in fp32: weights perturbed by round-off leave
    it bit-identical (deviation 0, so the floor of 1 eps), but a vocab-parallel loss sums in another order."""
    loss = TensorKey(step=1, micro_batch=0, phase="forward", fqn="(loss)", slot="scalar.loss")
    logits = TensorKey(step=1, micro_batch=0, phase="forward", fqn="output_layer", slot="output.0")
    other_batch = TensorKey(step=1, micro_batch=1, phase="forward", fqn="output_layer", slot="output.0")

    def meta(shape):
        return [SimpleNamespace(dtype="float32", layout=SimpleNamespace(global_shape=shape))]

    reference = SimpleNamespace(index={loss: meta(()), logits: meta((32, 2, 128)), other_batch: meta((64, 2, 128))})
    estimate = PerturbationEstimate(precision="fp32", num_samples=4, relative=2.0**-24,
                                    tensors={loss: TensorDeviation(key=loss, deviation=0.0, reference_norm=4.2, numel=1)})
    provider = PerturbationTolerances(estimate=estimate, precision="fp32")
    assert provider.tolerance_for(loss, "float32").rel == torch.finfo(torch.float32).eps
    judged = with_step_scalars(provider, reference).tolerance_for(loss, "float32")
    assert judged.rel == pytest.approx(REDUCTION_K * math.sqrt(32 * 2 * 128) * FP32_UNIT_ROUNDOFF)
    assert judged.method == "reduction" and "loss" in judged.source
