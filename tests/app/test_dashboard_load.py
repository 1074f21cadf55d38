"""CI slice of benchmarks/dashboard_load.py: two browser sessions at once (each its own chromium, the
sessions of tests/faults/dashboard_sessions.py) visit every page of the dashboard (Runs, Heatmap,
Tensor, Localize) while the other does the same; every visit must draw what the page is for, without
an exception, within the page limit. Render times are the benchmark's to measure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.dashboard_sessions import PAGES, PAIRS, run_sessions, serve, stop_dashboard, warm_up

try:
    import playwright  # noqa: F401
except ImportError:  # pragma: no cover - CI installs it
    playwright = None
if (playwright is None or not Path("/usr/bin/chromium").exists()) and not os.environ.get("CI"):
    pytest.skip("needs playwright and Debian's chromium (apt-get install -y chromium)", allow_module_level=True)
pytestmark = pytest.mark.slow  # two browsers at once


def test_two_sessions_at_once_get_every_page_answered(tmp_path):
    root, base, server = serve(tmp_path)
    try:
        warm_up(root, base, pairs=PAIRS[:2])  # the pairs 4 visits per session reach
        visits = run_sessions(base, 2, seconds=300, max_visits=len(PAGES), work=tmp_path)
    finally:
        stop_dashboard(server)
    assert [v for v in visits if not v.answered] == []  # answered: drawn, no exception, within PAGE_LIMIT_S
    assert sorted(v.page for v in visits) == sorted(list(PAGES) * 2)
