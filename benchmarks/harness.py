"""The one seam between benchmarks/ and tests/: a fault harness or data generator of tests/ run as a child
process, which hands back its raw records as JSON.

The harnesses are test fixtures and stay in tests/ (tests/faults/, tests/support/, tests/real_bugs/).
A benchmark never imports them: it runs `python -m tests.<package>.<module> ARGS --out FILE` with the
repository root as the working directory (so `tests` is importable without touching sys.path), reads
FILE, and does the statistics, the tables and the results files itself. Where timing is the
measurement and the work runs in the child, the child reports raw durations.
tests/test_layout.py checks that nothing under benchmarks/ imports tests/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_harness(module: str, *args: str, timeout_s: float | None = None) -> Any:
    """`python -m MODULE ARGS --out FILE` from the repository root; FILE's JSON. The child's stdout and
    stderr (its progress lines) pass through; a failed child raises CalledProcessError."""
    with tempfile.TemporaryDirectory(prefix="ttrace-harness-") as scratch:
        out = Path(scratch) / "records.json"
        subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)], cwd=ROOT, check=True,
                       timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        return json.loads(out.read_text())
