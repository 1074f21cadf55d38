import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.compare.estimate_file import PerturbationEstimate, TensorDeviation, read_estimate, write_estimate
from ttrace_core.record.generator import WeightPerturbation
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey
from ttrace_core.compare.step_scalars import REDUCTION_K, with_step_scalars
from ttrace_core.compare.structure import FP32_UNIT_ROUNDOFF
from ttrace_core.compare.tolerances import (
    PerturbationTolerances,
    TheoremTolerances,
    layer_position,
    machine_epsilon,
    theorem_depth,
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
    from ttrace_core.canonicalize.replicas import ReplicaDrift
    from ttrace_core.compare.engine import _drift_ratio

    drift = ReplicaDrift(ranks=(0, 1), max_abs_diff=0.1, relative_diff=0.02)
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


def _fp8_pair(input_amaxes: list[tuple[float, float]]):
    """Reference and candidate readers (as far as fp8_scales reads them) of one fp8 linear called on one
    micro-batch per step: its input's (reference, candidate) amax per step, and its scale keys."""
    from ttrace_core.format.schema import TensorStats

    def metas(amax: float, placements=("R",)):
        stats = TensorStats(numel=8, sum=0.0, sumsq=1.0, min=-amax, max=amax / 2, num_nan=0, num_inf=0)
        return [SimpleNamespace(stats=stats, scale=1.0, layout=SimpleNamespace(placements=placements, global_shape=(1,)),
                                dtype="float32")]

    reference, candidate = SimpleNamespace(index={}), SimpleNamespace(index={})
    for step, (ref_amax, cand_amax) in enumerate(input_amaxes):
        linear_input = TensorKey(step=step, micro_batch=0, phase="forward", fqn="layers.0.fc1", slot="input.0")
        scale = TensorKey(step=step, micro_batch=0, phase="forward", fqn="layers.0.fc1.fp8_scale_inv", slot="input.0")
        for reader, amax in ((reference, ref_amax), (candidate, cand_amax)):
            reader.index[linear_input] = metas(amax)
            reader.index[scale] = metas(amax / 448.0)
    return reference, candidate


def _tight_estimate(keys: list[TensorKey]) -> PerturbationTolerances:
    """An estimate whose draws moved each key by 2% only (a scale's few draws can come out that small)."""
    tensors = {k: TensorDeviation(key=k, deviation=0.02, reference_norm=1.0, numel=1) for k in keys}
    return PerturbationTolerances(estimate=PerturbationEstimate(precision="fp8", num_samples=4, relative=2.0**-8,
                                                                tensors=tensors), precision="fp8")


def test_an_fp8_scale_may_move_as_far_as_the_amax_it_follows_and_no_further():
    """Step 1's input amax differs by 41% between two correct runs (the step moved the weights): its scale
    follows, and is judged against alpha x 41%, not against the estimate's few draws (2%). A scale at step 0,
    whose input amaxes agree, keeps the estimate's tolerance; at step 2 a delayed scale may still come from
    step 1's amax, so the bound keeps the largest difference so far."""
    reference, candidate = _fp8_pair([(10.0, 10.0), (10.0, 14.1), (10.0, 10.2)])
    scales = [k for k in reference.index if k.fqn.endswith("fp8_scale_inv")]
    provider = _tight_estimate(scales)
    judged = with_step_scalars(provider, reference, candidate)
    by_step = {k.step: judged.tolerance_for(k, "float32") for k in scales}
    assert by_step[0].rel == pytest.approx(provider.alpha * 0.02) and by_step[0].method == "perturbation"
    assert by_step[1].rel == pytest.approx(provider.alpha * 0.41) and by_step[1].method == "amax"
    assert by_step[2].rel == pytest.approx(provider.alpha * 0.41)
    assert "amax" in by_step[1].source
    # replicas of a scale are bitwise equal in a correct run: one fp32 rounding, not the compute dtype's eps
    assert {t.drift_rel for t in by_step.values()} == {torch.finfo(torch.float32).eps}


def test_an_fp8_scale_that_does_not_follow_its_amax_still_fails():
    """A scale computed from a rank's own shard (fp8-amax-wrong-group) is 2x off while the logical input's
    amax is the same in both runs: the amax bound adds nothing and the scale fails its norm test."""
    from ttrace_core.compare.engine import compare_values

    reference, candidate = _fp8_pair([(10.0, 10.0)])
    scale = next(k for k in reference.index if k.fqn.endswith("fp8_scale_inv"))
    tolerance = with_step_scalars(_tight_estimate([scale]), reference, candidate).tolerance_for(scale, "float32")
    metrics = compare_values(torch.tensor([10.0 / 448 / 2], dtype=torch.float64),
                             torch.tensor([10.0 / 448], dtype=torch.float64), tolerance)
    assert metrics.ratio > 3


def test_an_fp32_pair_failing_only_by_near_misses_of_the_flat_table_is_told_to_estimate():
    """The flat table's fp32 row is no measure of a model's round-off: a pair failing it only within 3x gets a note
    naming `ttrace estimate`; failures past 3x, a real bug's, or a pass get none. The verdict is unchanged."""
    from tests.support.paths import SAMPLES_DIR
    from ttrace_core.compare.engine import compare_runs
    from ttrace_core.compare.tolerances import DtypeTolerances
    from ttrace_core.format.reader import RunReader

    def notes_and_verdict(candidate_name: str, rel: float) -> tuple[list[str], bool, float]:
        with RunReader(SAMPLES_DIR / "fp32" / "reference") as reference, \
                RunReader(SAMPLES_DIR / "fp32" / candidate_name) as candidate:
            result = compare_runs(reference, candidate, DtypeTolerances(overrides={"float32": (rel, 0.0)}))
        notes = [note for note in result.notes if note.startswith("tolerances: every failing tensor")]
        return notes, result.passed, max((row.ratio for row in result.failures if row.ratio is not None), default=0.0)

    with RunReader(SAMPLES_DIR / "fp32" / "reference") as reference, \
            RunReader(SAMPLES_DIR / "fp32" / "tp2_sp_clean") as candidate:
        clean = compare_runs(reference, candidate)
    worst = max(row.error for row in clean.comparisons if row.error is not None and row.value_ratio is not None)
    assert clean.passed and worst > 0
    near, passed, ratio = notes_and_verdict("tp2_sp_clean", worst / 2)  # the clean run's worst tensor at ratio 2
    assert not passed and 1 < ratio <= 2.01 and len(near) == 1, (ratio, near)
    assert "by at most 2x the flat fp32 row" in near[0] and "`ttrace estimate " in near[0]
    assert notes_and_verdict("tp2_sp_clean", worst / 10)[0] == []  # failures past 3x: no near miss
    assert notes_and_verdict("tp2_row_parallel_bias", 1e-5)[0] == []  # a real bug
    assert notes_and_verdict("tp2_sp_clean", worst * 2)[0] == []  # a pass
