"""Every committed sample trace still reads and gives its documented verdict against its own reference.

The comparison is what `ttrace compare REF CAND` does: tolerances from `select_tolerances("auto", ...)`,
so the bf16 and fp8 samples are judged with their reference's perturbation estimate. A reference
(no "reference" in samples.json) is compared with itself, which must pass.
"""

import json
from pathlib import Path

import pytest

from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.tolerances import select_tolerances

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "sample_traces"
SAMPLES = json.loads((SAMPLES_DIR / "samples.json").read_text())
MAX_TOTAL_BYTES = 50 * 10**6


@pytest.mark.parametrize("sample", SAMPLES, ids=[s["name"] for s in SAMPLES])
def test_sample_gives_its_documented_verdict(sample: dict) -> None:
    reference_dir = SAMPLES_DIR / (sample["reference"] or sample["name"])
    with RunReader(reference_dir) as reference, RunReader(SAMPLES_DIR / sample["name"]) as candidate:
        result = compare_runs(reference, candidate, select_tolerances("auto", reference, candidate))
    assert (0 if result else 1) == sample["expected_exit"]
    # every sample holds every copy its layout calls for; a clean one is complete in every respect
    # (a bug may drop tensors: row-parallel-bias-per-rank returns no separate bias output)
    coverage = result.coverage
    assert coverage.copies_present == coverage.copies_expected >= coverage.compared_elementwise > 0
    if sample["expected_exit"] == 0:
        assert coverage.full and result.findings == [], result.findings
        assert coverage.compared_elementwise == coverage.tensors_expected == len(result.comparisons)
    expected, first = sample["first_divergence"], result.first_divergence
    if expected is None:
        assert first is None
    else:
        assert (first.key.phase, first.key.fqn, first.key.slot) == (expected["phase"], expected["fqn"], expected["slot"])


@pytest.mark.parametrize("sample", [s for s in SAMPLES if "bug" in s], ids=lambda s: s["name"])
def test_bug_sample_matches_the_zoo(sample: dict) -> None:
    from ttrace_examples.megatron_gpt.bugs import ZOO

    flags = sample["flags"]
    assert flags[flags.index("--bug") + 1] == sample["bug"]
    assert sample["culprit"] == ZOO[sample["bug"]].culprit


def test_estimated_references_hold_their_estimate() -> None:
    for sample in SAMPLES:
        assert (SAMPLES_DIR / sample["name"] / "tolerance_estimate.json").is_file() == sample.get("estimate", False)


def _committed(path: Path) -> bool:
    """Not a cache the dashboard or Python leaves next to the samples (.ttrace/, __pycache__/)."""
    parts = path.relative_to(SAMPLES_DIR).parts
    return path.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in parts)


def test_sample_traces_fit_in_the_repository() -> None:
    total = sum(p.stat().st_size for p in SAMPLES_DIR.rglob("*") if _committed(p))
    assert total < MAX_TOTAL_BYTES, f"sample_traces/ holds {total / 1e6:.1f} MB, over {MAX_TOTAL_BYTES / 1e6:.0f} MB"
