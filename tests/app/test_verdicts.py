import copy

import pytest

from ttrace_dashboard import verdicts
from tests.app.test_localize_page import CULPRIT


@pytest.mark.parametrize("fqn, root, depth", [("layers.0", None, 1), ("layers.0.attn.proj", None, 3),
                                              ("layers.0.attn.proj", "layers.0", 2), ("layers.0", "layers.0", 0)],
                         ids=["top", "deep", "below-root", "root"])
def test_depth_of(fqn, root, depth):
    assert verdicts.depth_of(fqn, root) == depth


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
