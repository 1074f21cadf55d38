"""The inner loop and the full run: `python -m pytest -m "not slow"` leaves the slow tests out, and the
plain command (no -m, as the README gives it) runs every test.

Checked on the repository's own configuration (pyproject.toml and tests/conftest.py), by collecting a
few modules in a fresh pytest: `slow` is registered (--strict-markers), a test is slow when it is marked
so, `distributed` or `slow_install`, and the default run deselects nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

MODULES = ("tests/test_packaging.py", "tests/distributed/test_launch.py", "tests/test_robustness.py")
"""Installs (slow_install), spawned ranks (distributed), and a module of both kinds (its damaged-trace
harness runs are marked slow, its check of the docs' figures is not)."""


def _collected(*options: str) -> tuple[list[str], str]:
    """The node ids collected from MODULES, and pytest's summary line."""
    env = {name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--strict-markers",
                           "-p", "no:cacheprovider", *options, *MODULES], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    return [line for line in lines if "::" in line], lines[-1]


def test_slow_is_registered_and_no_addopts_selects_by_marker(pytestconfig):
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
    addopts = " ".join(pytestconfig.getini("addopts"))
    assert not re.search(r"(^|\s)(-m|-k|--deselect|--ignore)\b", addopts), addopts


def test_the_default_run_deselects_nothing_and_not_slow_leaves_the_slow_tests_out():
    every, summary = _collected()
    assert "deselected" not in summary and summary.startswith(f"{len(every)} tests collected"), summary
    inner, summary = _collected("-m", "not slow")
    assert f"/{len(every)} tests collected" in summary and "deselected" in summary, summary
    robustness = [node for node in every if node.startswith("tests/test_robustness.py")]
    assert inner and set(inner) < set(robustness), inner  # installs and spawned ranks all left out, a figure check kept
