"""integrations/patching.py: a patch is undone exactly, whether the owner had the attribute or inherited it."""

from __future__ import annotations

import pytest

from ttrace_core.integrations.patching import patch_attribute


class Base:
    def compute(self) -> str:
        return "base"


class Own(Base):
    def compute(self) -> str:
        return "own"


class Inherits(Base):
    pass


@pytest.mark.parametrize("owner, before", [(Own, "own"), (Inherits, "base")], ids=["own", "inherited"])
def test_the_undo_restores_what_the_owner_had(owner, before):
    had_own = "compute" in vars(owner)
    undo = patch_attribute(owner, "compute", lambda self: "patched")
    assert owner().compute() == "patched" and Base().compute() == "base"
    undo()
    assert owner().compute() == before
    assert ("compute" in vars(owner)) is had_own  # an inherited attribute leaves no override behind


def test_patches_undone_in_reverse_order_restore_the_original():
    undo_first = patch_attribute(Own, "compute", lambda self: "first")
    undo_second = patch_attribute(Own, "compute", lambda self: "second")
    assert Own().compute() == "second"
    undo_second()
    assert Own().compute() == "first"
    undo_first()
    assert Own().compute() == "own"
