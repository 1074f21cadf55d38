"""A CI-sized subset of the bug zoo: each bug, in a layout that triggers it, makes `ttrace compare`
exit 1, the first divergence is at or downstream of the bug's ground-truth tensor, and
`ttrace localize` names the ground-truth culprit: a module (forward), or the parameters and the
reduction (gradient sync, scaling, optimizer). The full sweep is the detection benchmark."""

import pytest

from tests.conftest import MEGATRON_SIZE, load_comparison, run_ttrace
from ttrace_core.examples.megatron_gpt.bugs import CULPRITS, ZOO, localized_correctly
from ttrace_core.localize import Localization

pytestmark = pytest.mark.distributed

CI_SUBSET = {
    "sp-final-norm-grad": ["--tp", "2", "--sp"],
    "row-parallel-bias-per-rank": ["--tp", "2"],
    "dp-grad-avg-twice": ["--dp", "2"],
    "distopt-stale-params": ["--dp", "2", "--dist-opt"],
}


# A replay costs a relaunch: CI localizes a forward module (one subtree) and a TP gradient-sync bug;
# DP scaling and the optimizer rule are unit-tested (tests/core/test_localize.py) and in the benchmark.
LOCALIZED_IN_CI = ("row-parallel-bias-per-rank", "sp-final-norm-grad")


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

    if name not in LOCALIZED_IN_CI:
        return
    # The row-parallel bug is localized the way the dashboard replays one layer: only its subtree.
    module = ["--module", "decoder.layers.0.self_attention"] if name == "row-parallel-bias-per-rank" else []
    localized = run_ttrace("localize", str(megatron_reference), str(out), *module, "--json", str(traces / f"zoo-{name}-loc.json"))
    assert localized.returncode == 1, localized.stdout + localized.stderr
    localization = Localization.from_json((traces / f"zoo-{name}-loc.json").read_text())
    assert localized_correctly(name, localization), (CULPRITS[name], localization.culprits)
    assert f"reproduce: ttrace localize {megatron_reference} {out}" in localized.stdout
    if module:
        assert localization.culprits[0] == "decoder.layers.0.self_attention.linear_proj"
        assert all(m.fqn.startswith(module[1]) for m in localization.modules)


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
