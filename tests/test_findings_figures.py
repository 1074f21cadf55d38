"""docs/findings.md and the results file it quotes agree (no runs: reads files only).

benchmarks/feature_matrix.py writes benchmarks/results/feature_matrix.json; docs/findings.md quotes
its counts and has one table row per configuration. Checked: the counts in the doc's summary line are
the json's, every configuration has a row with the json's verdict, every configuration that is not
equivalent has a triage section, and the json names the versions it ran with. The check returns its
problems, so a planted mismatch shows that it can fail.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "feature_matrix.json"
FINDINGS = ROOT / "docs" / "findings.md"
SUMMARY = re.compile(r"(\d+) configurations in (\d+) groups: (\d+) equivalent, (\d+) not equivalent, (\d+) errors")


def _rows(markdown: str) -> dict[tuple[str, str, str], list[str]]:
    """The matrix table's rows by (group, layout name, precision): `| group | layout | precision | verdict | ...`."""
    rows = {}
    for line in markdown.splitlines():
        cells = [cell.strip().replace("`", "") for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4:
            rows[(cells[0], cells[1], cells[2])] = cells
    return rows


def findings_problems(results: dict, doc: str) -> list[str]:
    problems = [] if results.get("versions") else ["the json names no versions"]
    configurations = [(group, c) for group in results["groups"] for c in group["configurations"]]
    outcomes = [c["outcome"] for _, c in configurations]
    expected = (len(configurations), len(results["groups"]), outcomes.count("equivalent"),
                outcomes.count("not equivalent"), outcomes.count("error"))
    summary = SUMMARY.search(doc)
    if summary is None:
        problems.append("docs/findings.md: no summary line 'N configurations in G groups: ...'")
    elif tuple(int(n) for n in summary.groups()) != expected:
        problems.append(f"docs/findings.md summary says {summary.group(0)!r}; the json: {expected}")
    rows = _rows(doc)
    for group, c in configurations:
        key = (group["name"], c["name"], c["precision"])
        row = rows.get(key)
        if row is None:
            problems.append(f"docs/findings.md: no table row for {key}")
        elif row[3] != c["outcome"]:
            problems.append(f"docs/findings.md {key}: verdict {row[3]!r}, the json says {c['outcome']!r}")
        if c["outcome"] != "equivalent" and f"{group['name']} / {c['name']}" not in doc:
            problems.append(f"docs/findings.md: no triage of {key} ({c['outcome']}); a heading naming "
                            f"'{group['name']} / {c['name']}' is expected")
    return problems


def test_findings_quote_the_feature_matrix():
    assert findings_problems(json.loads(RESULTS.read_text()), FINDINGS.read_text()) == []


def test_a_changed_verdict_or_count_is_caught():
    results, doc = json.loads(RESULTS.read_text()), FINDINGS.read_text()
    flipped = copy.deepcopy(results)
    configuration = flipped["groups"][0]["configurations"][0]
    configuration["outcome"] = "error" if configuration["outcome"] != "error" else "equivalent"
    problems = findings_problems(flipped, doc)
    assert any("verdict" in p for p in problems) and any("summary says" in p for p in problems), problems
