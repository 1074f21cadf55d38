"""CI-sized held-out case of benchmarks/detection.py: a model size, sequence length, micro-batch count
and seed that ttrace's settings (alpha 4, floor 1 eps, exact-inputs k 4) were never chosen on. A clean
layout passes, a zoo bug is caught with ratio >= 3, and the same bf16 reference judges fp8 runs
through an estimate re-run in fp8 (`ttrace estimate --for-precision fp8`)."""

import json
from pathlib import Path

import pytest

from tests.conftest import load_comparison, run_ttrace

pytestmark = pytest.mark.slow  # megatron-core runs at 3 layers, in 3 precisions

# Calibration saw 4 layers, hidden 64, 4 micro-batches of 2 x 16 tokens, seed 0.
HELD_OUT = ["--num-layers", "3", "--hidden-size", "96", "--seq-len", "24", "--micro-batches", "2", "--seed", "7"]


@pytest.fixture(scope="module")
def reference16(tmp_path_factory) -> Path:
    """The bf16 reference with its own estimate and one re-run in fp8, shared by both tests (a recording and two
    estimates of minutes in CI)."""
    reference = _record(tmp_path_factory.mktemp("held-out") / "ref16", "bf16")
    run_ttrace("estimate", str(reference), "--samples", "4", check_codes=(0,))
    crossed = run_ttrace("estimate", str(reference), "--samples", "4", "--for-precision", "fp8", check_codes=(0,))
    assert "re-runs in fp8" in crossed.stdout
    return reference


@pytest.fixture(scope="module")
def clean8(tmp_path_factory) -> Path:
    """A clean fp8 TP 2 + SP layout, judged in both tests."""
    return _record(tmp_path_factory.mktemp("held-out") / "clean8", "fp8", "--tp", "2", "--sp")


def _record(out: Path, precision: str, *flags: str) -> Path:
    run_ttrace("example", "megatron-gpt", *HELD_OUT, "--precision", precision, *flags, "--out", str(out), check_codes=(0,))
    return out


def _compare(reference: Path, candidate: Path, json_path: Path) -> tuple[int, object]:
    result = run_ttrace("compare", str(reference), str(candidate), "--json", str(json_path), check_codes=(0, 1))
    return result.returncode, load_comparison(json_path)


def _max_ratio(comparison) -> float:
    return max(c.ratio for c in comparison.comparisons if c.ratio is not None)


def test_held_out_model_clean_passes_bug_caught_and_fp8_judged_against_bf16(tmp_path, reference16, clean8):
    reference = reference16
    assert json.loads((reference / "tolerance_estimate.fp8.json").read_text())["reference_precision"] == "bf16"

    # bf16 against bf16: the clean layout well inside, a bias added twice (where inputs are exact) >= 3
    code, clean = _compare(reference, _record(tmp_path / "clean", "bf16", "--tp", "2", "--sp"), tmp_path / "clean.json")
    assert code == 0 and _max_ratio(clean) <= 0.5, [str(c.key) for c in clean.failures][:3]
    code, buggy = _compare(reference, _record(tmp_path / "bias", "bf16", "--tp", "2", "--sp", "--bug",
                                              "row-parallel-bias-per-rank"), tmp_path / "bias.json")
    first = buggy.first_divergence
    assert code == 1 and "decoder.layers.0.self_attention.linear_proj / output.0" in str(first.key)
    assert first.ratio >= 3, first.ratio

    # fp8 against the bf16 reference: quantization-aware tolerances, no exact-inputs tightening,
    # the fp8-only scale tensors noted instead of failing as extra
    code, judged8 = _compare(reference, clean8, tmp_path / "clean8.json")
    assert code == 0, [str(c.key) for c in judged8.failures][:3]
    assert _max_ratio(judged8) <= 0.5 and any("quantization scales" in n for n in judged8.notes)
    assert {c.tolerance.method for c in judged8.comparisons if c.tolerance and not c.key.slot.startswith("scalar.")} \
        <= {"perturbation", "perturbation-floor"}
    code, buggy8 = _compare(reference, _record(tmp_path / "norm8", "fp8", "--tp", "2", "--sp", "--bug", "sp-final-norm-grad"),
                            tmp_path / "norm8.json")
    first = buggy8.first_divergence
    assert code == 1 and "decoder.final_layernorm" in str(first.key) and first.ratio >= 3, (str(first.key), first.ratio)


def _first(comparison):
    first = comparison.first_divergence
    return first, str(first.key)


def test_structure_tests_lift_bugs_the_norm_leaves_under_3(tmp_path, reference16, clean8):
    """Bugs whose norm ratio sits under 3 at this size (issue: verdicts in bf16/fp8), each lifted to >= 3 by the
    structure test built for its shape, in bf16 and fp8 against their own references and fp8 against bf16;
    a clean fp8 layout stays <= 0.5 against both references."""
    reference8 = _record(tmp_path / "ref8", "fp8")
    run_ttrace("estimate", str(reference8), "--samples", "4", check_codes=(0,))

    # bf16: a distributed-optimizer shard never refreshed is one Adam step next to weights of size 1
    _, stale = _compare(reference16, _record(tmp_path / "stale", "bf16", "--dp", "2", "--dist-opt", "--bug",
                                             "distopt-stale-params"), tmp_path / "stale.json")
    first, where = _first(stale)
    assert "/ param /" in where and first.decided_by in ("update", "replica update") and first.ratio >= 3, (where, first.message)
    assert max(first.value_ratio, first.drift_ratio) < 3 and ("update differs" in first.message or "differ by 100% of the update" in first.message)

    # fp8 against its own reference: the attention backward's dq no longer follows the reference
    _, dq = _compare(reference8, _record(tmp_path / "dq", "fp8", "--tp", "2", "--bug", "attn-dq-wrong"), tmp_path / "dq.json")
    first, where = _first(dq)
    assert "core_attention / grad_input.0" in where and first.decided_by == "scale" and first.ratio >= 3, where
    assert first.value_ratio < 3 and "does not follow the reference" in first.message

    # fp8 against the bf16 reference: a gradient averaged twice is halved, inside e5m2's norm noise
    halved = _record(tmp_path / "halved", "fp8", "--dp", "2", "--bug", "dp-grad-avg-twice")
    _, crossed = _compare(reference16, halved, tmp_path / "halved.json")
    first, where = _first(crossed)
    assert "/ grad /" in where and first.decided_by == "scale" and first.ratio >= 3 and first.value_ratio < 3, where
    scale = next(t for t in first.structure if t.name == "scale")
    assert abs(scale.value + 0.5) < 0.05 and scale.finding.startswith("scaled by 0.4")

    # fp8 against the bf16 reference: TP ranks cast their weight shards with their own amax's scale; the reference
    # has no scales to compare with, but the candidate's replicas of each scale must be bitwise equal
    _, amax = _compare(reference16, _record(tmp_path / "amax", "fp8", "--tp", "2", "--bug", "fp8-amax-wrong-group"),
                       tmp_path / "amax.json")
    first, where = _first(amax)
    assert "fp8_scale_inv" in where and first.decided_by == "replica drift" and first.ratio >= 3, (where, first.message)
    assert first.value_ratio is None and "amax was not reduced" in first.message

    # fp8 against the bf16 reference: the bias added on both TP ranks before the all-reduce lies along the module's
    # own bias, under the quantization noise of the norm and offset tests
    _, bias = _compare(reference16, _record(tmp_path / "bias8", "fp8", "--tp", "2", "--bug", "row-parallel-bias-per-rank"),
                       tmp_path / "bias8.json")
    first, where = _first(bias)
    assert "linear_proj / output.0" in where and first.decided_by == "bias" and first.ratio >= 3, (where, first.message)
    assert first.value_ratio < 3 and "x its module's own bias" in first.message

    for reference in (reference8, reference16):
        code, result = _compare(reference, clean8, tmp_path / f"clean-{reference.name}.json")
        assert code == 0 and _max_ratio(result) <= 0.5, (reference.name, [str(c.key) for c in result.failures][:3])
        assert {t.name for c in result.comparisons for t in c.structure} >= {"scale", "offset", "bias", "shard", "update"}
