"""Every committed sample trace still reads and gives its documented verdict against its own reference.

The comparison is what `ttrace compare REF CAND` does: tolerances from `select_tolerances("auto", ...)`,
so the bf16 and fp8 samples are judged with their reference's perturbation estimate. A reference
(no "reference" in samples.json) is compared with itself, which must pass. The samples show today's
product: the writer's trace format, a relaunch command this installation runs, and one sample whose
first divergence is a single rank's shard (what the tensor page's per-rank error is for).
"""

import json
import shutil
from pathlib import Path

import pytest

from ttrace_core import api
from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import FORMAT_VERSION
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


@pytest.mark.parametrize("sample", SAMPLES, ids=[s["name"] for s in SAMPLES])
def test_sample_is_in_the_writers_format_and_relaunches_from_anywhere(sample: dict) -> None:
    """Regenerate the samples (make_samples.py) when the writer's format moves on: an older sample hides what
    the dashboard shows today. The manifest's command runs from any directory with this installation's
    `python -m ttrace_examples`; the Runs page reads the injected bug from it."""
    run = api.run_info(SAMPLES_DIR / sample["name"])
    assert run.error is None and run.format_version == FORMAT_VERSION, (run.format_version, FORMAT_VERSION)
    manifest = json.loads((SAMPLES_DIR / sample["name"] / "manifest.json").read_text())
    assert manifest["entrypoint"]["command"][:3] == ["python", "-m", "ttrace_examples"]
    assert manifest["entrypoint"]["cwd"] == ""
    assert run.bug == sample.get("bug")


SINGLE_RANK = [s for s in SAMPLES if "single_rank_shard" in s]


@pytest.mark.parametrize("sample", SINGLE_RANK, ids=[s["name"] for s in SINGLE_RANK])
def test_single_rank_sample_has_exactly_one_bad_shard_at_its_first_divergence(sample: dict, tmp_path) -> None:
    """Through the facade the tensor page uses: at the first divergence, the named rank's shard is beyond the
    tolerance and every other rank's is within it. (On copies: the facade caches its table beside the candidate.)"""
    reference, candidate = tmp_path / "reference", tmp_path / "candidate"
    for name, copy in ((sample["reference"], reference), (sample["name"], candidate)):
        shutil.copytree(SAMPLES_DIR / name, copy, ignore=shutil.ignore_patterns(".ttrace"))
    first = api.verdict_of(api.comparison_table(reference, candidate).provenance).first_divergence
    expected = sample["first_divergence"]
    assert first.tensor == f"{expected['phase']}/{expected['fqn']}/{expected['slot']}"
    frame = api.comparison(reference, candidate)
    row = frame[(frame["tensor"] == first.tensor) & (frame["step"] == first.step)
                & (frame["micro_batch"] == first.micro_batch)].iloc[0]
    view = api.tensor_view(reference, candidate, first.tensor, first.step, first.micro_batch)
    errors = {shard.rank: shard.error for shard in view.shards}
    assert len(errors) > 1 and None not in errors.values(), errors
    beyond = [rank for rank, error in errors.items() if error > row["tolerance_rel"]]
    assert beyond == [sample["single_rank_shard"]], (errors, row["tolerance_rel"])


def test_the_dashboard_lands_on_the_single_rank_sample() -> None:
    """The Runs page's first pair (no link) is the sample the README's walk follows."""
    from ttrace_dashboard.runs import default_pair

    (landing,) = [s for s in SAMPLES if "single_rank_shard" in s]
    assert default_pair(api.find_runs(SAMPLES_DIR), None, None) == (landing["reference"], landing["name"])


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
