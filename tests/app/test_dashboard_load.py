"""CI slice of benchmarks/dashboard_load.py: two browser sessions at once (each its own chromium)
visit every page of the dashboard (Runs, Heatmap, Tensor, Localize) while the other does the same;
every visit must draw what the page is for, without an exception, within the page limit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

try:
    import playwright  # noqa: F401
except ImportError:  # pragma: no cover - CI installs it
    playwright = None
if (playwright is None or not Path("/usr/bin/chromium").exists()) and not os.environ.get("CI"):
    pytest.skip("needs playwright and Debian's chromium (apt-get install -y chromium)", allow_module_level=True)

sys.path.insert(0, str(ROOT / "benchmarks"))
import dashboard_load  # noqa: E402


def test_two_sessions_at_once_get_every_page_answered(tmp_path):
    root, base, server = dashboard_load.serve(tmp_path)
    try:
        dashboard_load.warm_up(root, base, pairs=dashboard_load.PAIRS[:2])  # the pairs 4 visits per session reach
        visits = dashboard_load.run_sessions(base, 2, seconds=300, max_visits=len(dashboard_load.PAGES), work=tmp_path)
    finally:
        dashboard_load.stop_dashboard(server)
    assert [v for v in visits if not v.answered] == []
    assert sorted(v.page for v in visits) == sorted(list(dashboard_load.PAGES) * 2)
    rows = {row["page"]: row for row in dashboard_load.summary(visits)}
    assert rows["all"]["answered"] == 8 and rows["all"]["p95_s"] < dashboard_load.PAGE_LIMIT_S
