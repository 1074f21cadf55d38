import copy

import pytest

from app import verdicts
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
