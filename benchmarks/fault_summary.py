"""One table for every fault benchmark: each writes results/<name>.summary.json (rows of FaultRow),
and robustness.md shows them beside the damaged-trace classes (`python benchmarks/robustness.py
--summary-only` redraws it without re-running the cases)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

SUMMARIES = ("recording_faults", "replay_faults", "dashboard_load")


@dataclass
class FaultRow:
    fault: str
    cases: int
    crashes: int = 0
    """Unreadable traces, tracebacks, or pages showing an exception."""
    hangs: int = 0
    lost: int | None = None
    """Completed steps lost (None where no step can be lost)."""
    failures: int = 0
    """Cases failing any of the benchmark's checks (crashes and hangs included)."""
    measured: str = ""
    """The benchmark's headline figure for the class (stop time, p95 render time, ...)."""
    source: str = ""


def write_rows(results: Path, name: str, rows: list[FaultRow]) -> None:
    (results / f"{name}.summary.json").write_text(json.dumps([{**asdict(row), "source": f"{name}.md"} for row in rows], indent=1))


def render(results: Path) -> str:
    lines = ["## Faults beyond damaged files", "",
             "Each row comes from its own benchmark's results file (column source), where every case is listed.", "",
             "| fault | cases | crashes | hangs | completed steps lost | failed checks | measured | source |",
             "|---|---|---|---|---|---|---|---|"]
    missing = []
    for name in SUMMARIES:
        path = results / f"{name}.summary.json"
        if not path.is_file():
            missing.append(name)
            continue
        for row in json.loads(path.read_text()):
            lost = "-" if row["lost"] is None else row["lost"]
            lines.append(f"| {row['fault']} | {row['cases']} | {row['crashes']} | {row['hangs']} | {lost} | "
                         f"{row['failures']} | {row['measured']} | [{row['source']}]({row['source']}) |")
    if missing:
        lines += ["", f"Not run yet: {', '.join(f'`benchmarks/{name}.py`' for name in missing)}."]
    return "\n".join(lines) + "\n"
