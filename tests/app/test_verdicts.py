import copy

import pytest

from ttrace_dashboard import verdicts
from tests.app.test_localize_page import CULPRIT


LISTED = {"embedding", "embedding.embedding_dropout", "decoder.layers.0", "decoder.layers.0.mlp",
          "decoder.layers.0.mlp.linear_fc1"}


@pytest.mark.parametrize("fqn, depth", [("embedding", 0), ("embedding.embedding_dropout", 1), ("decoder.layers.0", 0),
                                        ("decoder.layers.0.mlp", 1), ("decoder.layers.0.mlp.linear_fc1", 2),
                                        ("decoder.layers.0.self_attention.linear_proj", 1)],
                         ids=["top", "child", "sibling-of-top", "child-of-layer", "grandchild", "parent-not-listed"])
def test_depth_counts_the_listed_ancestors(fqn, depth):
    # Issue 41: counting dots put decoder.layers.0 (2 dots) under embedding.embedding_dropout (1 dot).
    assert verdicts.depth_of(fqn, LISTED) == depth


def test_a_module_whose_parameters_reduction_is_a_culprit_is_not_clean_and_every_culprit_is_named():
    # Issue 41: culprits named decoder.final_layernorm.weight and .bias while the table said the module was clean,
    # with ratios None; and "(and 3 more)" hid culprits.
    from ttrace_core.localize.verdicts import Evidence, Localization, ModuleVerdict, SyncFinding

    key = "step 0 / grad / decoder.final_layernorm.weight / grad"
    result = Localization(
        reference="r", candidate="c", replay="x", diverged=True, bug_class="sp grad: TP all-reduce",
        culprits=["decoder.final_layernorm.weight, decoder.final_layernorm.bias (TP all-reduce)", "a", "b", "c"],
        modules=[ModuleVerdict(fqn="decoder.final_layernorm", verdict="clean"), ModuleVerdict(fqn="head", verdict="clean")],
        sync=[SyncFinding(params=["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"],
                          reduction="TP all-reduce", bug_class="sequence-parallel gradient", detail="d",
                          evidence=[Evidence(key=key, ratio_before=81347.2804, ratio_after=81347.2804, status="mismatch")])])
    rows = verdicts.verdict_rows(result).set_index("fqn")
    norm = rows.loc["decoder.final_layernorm"]
    assert norm["verdict"] == "🔴 its TP all-reduce" and norm["ratio after"] == "8.13e+04" and norm["evidence"] == key
    assert rows.loc["head", "verdict"] == "🟢 clean" and rows.loc["head", "ratio after"] == "-"
    level, line = verdicts.summary(result)
    assert level == "error" and "more" not in line
    assert line.startswith("Culprits (each introduces an error): decoder.final_layernorm.weight, "
                           "decoder.final_layernorm.bias (TP all-reduce); a; b; c")


@pytest.mark.parametrize("progress, seconds, text", [
    ("2/3 replaying the candidate (t=0.1 s)", 42.0, "2/3 replaying the candidate · running for 42 s, this stage for 42 s"),
    ("3/3 judging (t=30.0 s)", 42.0, "3/3 judging · running for 42 s, this stage for 12 s"),
    ("", None, "starting · running for 0 s"),
], ids=["long-stage", "later-stage", "nothing-yet"])
def test_the_progress_text_moves_while_a_stage_runs(progress, seconds, text):
    # Issue 41: the page printed the log line as it was, "2/3 ... (t=0.1 s)", which read as a frozen clock.
    assert verdicts.progress_text(progress, seconds) == text


def test_bisect_targets_are_culprits_with_modules_below():
    assert verdicts.bisect_targets(CULPRIT, None) == []  # layers.0.act is a leaf
    parent_culprit = copy.deepcopy(CULPRIT)
    parent_culprit.modules[0].verdict = "introduces error"
    assert verdicts.bisect_targets(parent_culprit, None) == ["layers.0"]
    assert verdicts.bisect_targets(parent_culprit, "layers.0") == []


@pytest.mark.parametrize("text, fraction", [("1/3 comparing", 1 / 3), ("3/3 judging", 1.0), ("", 0.05), ("x/y", 0.05)],
                         ids=["first", "last", "empty", "garbage"])
def test_progress_fraction(text, fraction):
    assert verdicts.progress_fraction(text) == pytest.approx(fraction)


COVERAGE = {"compared_elementwise": 10, "tensors_expected": 10, "compared_by_stats": 0, "copies_present": 19,
            "copies_expected": 20, "steps_compared": [0], "steps_expected": [0]}


@pytest.mark.parametrize("verdict, findings, level, start", [
    ("equivalent", [], "success", "PASSED (equivalent): the candidate matches the reference. Evidence: 10/10"),
    ("equivalent by statistics", [], "success", "PASSED (equivalent by statistics)"),
    ("partial", ["missing-replica: 1 of 20"], "warning", "PASSED (partial): what was recorded matches, but missing-replica: 1 of 20."),
    ("incomplete", ["missing-replica: 1 of 20"], "error", "FAILED (incomplete): missing-replica: 1 of 20. Evidence: 10/10"),
], ids=["equivalent", "by-statistics", "partial", "incomplete"])
def test_the_verdict_banner_says_how_much_evidence_stands_behind_it(verdict, findings, level, start):
    from ttrace_core.api import verdict_of

    provenance = {"verdict": verdict, "findings": findings, "coverage": COVERAGE, "first_divergence": None,
                  "passed": verdict != "incomplete"}
    got_level, text = verdict_of(provenance).banner()
    assert got_level == level and text.startswith(start), text
    assert "19/20 copies; 0/0 ranks; steps [0] of [0]" in text
