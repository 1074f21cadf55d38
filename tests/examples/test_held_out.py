"""CI-sized held-out case of benchmarks/detection.py: a model size, sequence length, micro-batch count
and seed that ttrace's settings (alpha 4, floor 1 eps, exact-inputs k 4) were never chosen on. A clean
layout passes, a zoo bug is caught with ratio >= 3, and the same bf16 reference judges fp8 runs
through an estimate re-run in fp8 (`ttrace estimate --for-precision fp8`)."""

import json
from pathlib import Path

from tests.conftest import load_comparison, run_ttrace

# Calibration saw 4 layers, hidden 64, 4 micro-batches of 2 x 16 tokens, seed 0.
HELD_OUT = ["--num-layers", "3", "--hidden-size", "96", "--seq-len", "24", "--micro-batches", "2", "--seed", "7"]


def _record(out: Path, precision: str, *flags: str) -> Path:
    run_ttrace("example", "megatron-gpt", *HELD_OUT, "--precision", precision, *flags, "--out", str(out), check_codes=(0,))
    return out


def _compare(reference: Path, candidate: Path, json_path: Path) -> tuple[int, object]:
    result = run_ttrace("compare", str(reference), str(candidate), "--json", str(json_path), check_codes=(0, 1))
    return result.returncode, load_comparison(json_path)


def _max_ratio(comparison) -> float:
    return max(c.ratio for c in comparison.comparisons if c.ratio is not None)


def test_held_out_model_clean_passes_bug_caught_and_fp8_judged_against_bf16(tmp_path):
    reference = _record(tmp_path / "reference", "bf16")
    run_ttrace("estimate", str(reference), "--samples", "4", check_codes=(0,))
    crossed = run_ttrace("estimate", str(reference), "--samples", "4", "--for-precision", "fp8", check_codes=(0,))
    assert "re-runs in fp8" in crossed.stdout
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
    code, clean8 = _compare(reference, _record(tmp_path / "clean8", "fp8", "--tp", "2", "--sp"), tmp_path / "clean8.json")
    assert code == 0, [str(c.key) for c in clean8.failures][:3]
    assert _max_ratio(clean8) <= 0.5 and any("quantization scales" in n for n in clean8.notes)
    assert {c.tolerance.method for c in clean8.comparisons if c.tolerance and not c.key.slot.startswith("scalar.")} \
        <= {"perturbation", "perturbation-floor"}
    code, buggy8 = _compare(reference, _record(tmp_path / "norm8", "fp8", "--tp", "2", "--sp", "--bug", "sp-final-norm-grad"),
                            tmp_path / "norm8.json")
    first = buggy8.first_divergence
    assert code == 1 and "decoder.final_layernorm" in str(first.key) and first.ratio >= 3, (str(first.key), first.ratio)
