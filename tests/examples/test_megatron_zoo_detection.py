"""A CI-sized subset of the bug zoo: each bug, in a layout that triggers it, makes `ttrace compare`
exit 1 and the first divergence is at or downstream of the bug's ground-truth tensor. Localization
is tested on the committed samples (tests/test_localize_samples.py: a module alone, TP gradient
sync in fp32 and bf16, DP scaling, fp8 scales); the full sweep is the detection benchmark."""

import pytest

from tests.conftest import MEGATRON_SIZE, load_comparison, run_ttrace
from ttrace_examples.megatron_gpt.bugs import ZOO

pytestmark = pytest.mark.distributed

CI_SUBSET = {
    "sp-final-norm-grad": ["--tp", "2", "--sp"],
    "row-parallel-bias-per-rank": ["--tp", "2"],
    "dp-grad-avg-twice": ["--dp", "2"],
    "distopt-stale-params": ["--dp", "2", "--dist-opt"],
}


def _position(comparisons, phase_fqn_slot: str) -> int:
    phase, fqn, slot = (part.strip() for part in phase_fqn_slot.split(" / "))
    return next(i for i, c in enumerate(comparisons) if (c.key.phase, c.key.fqn, c.key.slot) == (phase, fqn, slot))


@pytest.mark.parametrize("name", list(CI_SUBSET), ids=list(CI_SUBSET))
def test_zoo_bug_is_detected_at_or_after_its_ground_truth(traces, megatron_reference, name):
    out = traces / f"zoo-{name}"
    run_ttrace("example", "megatron-gpt", *MEGATRON_SIZE, *CI_SUBSET[name], "--steps", "2", "--bug", name, "--out", str(out),
               check_codes=(0,))
    report = traces / f"zoo-{name}.json"
    result = run_ttrace("compare", str(megatron_reference), str(out), "--json", str(report))
    assert result.returncode == 1, result.stdout + result.stderr
    comparisons = load_comparison(report).comparisons
    first_failure = next(i for i, c in enumerate(comparisons) if not c)
    ground_truth = _position(comparisons, ZOO[name].first_divergence)
    assert first_failure >= ground_truth, (
        f"{name}: first divergence {comparisons[first_failure].key} precedes the ground truth {comparisons[ground_truth].key}")
    assert comparisons[first_failure].ratio is None or comparisons[first_failure].ratio > 10


def test_router_replicas_not_synchronized_under_sp_are_caught(traces, megatron_moe_reference):
    out = traces / "zoo-sp-router-replica"
    run_ttrace("example", "megatron-gpt", *MEGATRON_SIZE, "--moe", "--tp", "2", "--sp", "--bug", "sp-router-replica",
               "--out", str(out), check_codes=(0,))
    report = traces / "zoo-sp-router-replica.json"
    assert run_ttrace("compare", str(megatron_moe_reference), str(out), "--json", str(report)).returncode == 1
    comparisons = load_comparison(report).comparisons
    first = next(c for c in comparisons if not c)
    assert first.key.fqn == "decoder.layers.0.mlp.router.weight" and first.key.phase == "grad"
    assert first.replica_drift is not None  # each TP rank kept its own partial router gradient
