"""The real-bug results and the docs that quote them agree (no runs: reads files only).

benchmarks/real_bugs.py writes benchmarks/results/real_bugs.json and real_bugs.md; docs/real-bugs.md quotes the
summary lines. Checked: the Markdown says what the json holds (its summary counts, its notes, and every
bug and control row in the json's order with its precision, verdict, ratio, deciding test, first
divergence and culprits), every bug row names its public source, every summary line the doc quotes is
the results file's, and the json names the versions it ran with. The Markdown is read as a table here,
not rendered again: the renderer is the benchmark's, and nothing under tests/ imports a benchmark.
Each check returns its problems, so the planted-mismatch tests can show it fails.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SUMMARY_LINE = re.compile(r"^- (fp32|bf16): .*$", re.MULTILINE)
COUNTS = re.compile(r"^- (fp32|bf16): (\d+)/(\d+) bugs detected .*?, (\d+)/(\d+) localized .*?; (\d+)/(\d+) controls passed",
                    re.MULTILINE)


def table(markdown: str, section: str) -> list[list[str]]:
    """The cells of every body row of the table under `## section`."""
    body = markdown.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line[2:-2].split(" | ") for line in body.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # rows[0] is the header


def _ratio_agrees(cell: str, ratio: float | None) -> bool:
    """The table's ratio is the json's to the three significant digits it prints."""
    if ratio is None:
        return cell == "-"
    return cell != "-" and abs(float(cell) - ratio) <= 5e-3 * abs(ratio)


def _bug_cells(row: dict) -> list[str]:
    """What the Bugs table must say of a json row: name, framework, precision, detected, deciding test,
    first divergence, culprits, localized (the ratio is checked numerically)."""
    detected = "error" if row["error"] else ("yes" if row["detected"] else "no")
    return [row["name"], row["framework"], row["precision"], detected, row["deciding_test"] or "-",
            f"`{row['first_divergence'] or '-'}`", "; ".join(row["culprits"]) or "-", "yes" if row["localized"] else "no"]


def table_problems(results: dict, markdown: str) -> list[str]:
    bugs = [row for row in results["rows"] if not row["control"]]
    controls = [row for row in results["rows"] if row["control"]]
    problems = []
    shown = table(markdown, "Bugs")
    if len(shown) != len(bugs):
        problems.append(f"real_bugs.md shows {len(shown)} bug rows, the json holds {len(bugs)}")
    for row, cells in zip(bugs, shown):
        said = [cells[i] for i in (0, 1, 6, 7, 9, 10, 11, 13)]
        if said != _bug_cells(row) or not _ratio_agrees(cells[8], row["ratio"]):
            problems.append(f"{row['name']} ({row['precision']}): real_bugs.md says {cells}, the json {row}")
    shown = table(markdown, "Negative controls")
    expected = [[row["name"], row["framework"], row["precision"]] for row in controls]
    if [cells[:3] for cells in shown] != expected:
        problems.append(f"real_bugs.md's controls {[cells[:3] for cells in shown]} are not the json's {expected}")
    problems += [f"{row['name']} ({row['precision']}): verdict {cells[3]!r} is not the json's {row['verdict']!r}"
                 for row, cells in zip(controls, shown) if not row["error"] and cells[3] != row["verdict"]]
    return problems


def summary_problems(results: dict, markdown: str) -> list[str]:
    problems = []
    said = {match.group(1): [int(n) for n in match.groups()[1:]] for match in COUNTS.finditer(markdown)}
    for precision in results["precisions"]:
        bugs = [r for r in results["rows"] if not r["control"] and r["precision"] == precision]
        controls = [r for r in results["rows"] if r["control"] and r["precision"] == precision]
        counted = [sum(r["detected"] for r in bugs), len(bugs), sum(r["localized"] for r in bugs), len(bugs),
                   sum(not r["detected"] and not r["error"] for r in controls), len(controls)]
        if said.get(precision) != counted:
            problems.append(f"{precision}: real_bugs.md's summary says {said.get(precision)}, the json counts {counted}")
    problems += [f"note {note!r} missing" for note in results["notes"] if f"- note: {note}" not in markdown]
    return problems


def results_problems(results: dict, markdown: str) -> list[str]:
    problems = [f"versions: {package} not named" for package in ("torch", "megatron-core")
                if not results.get("versions", {}).get(package)]
    for row in results["rows"]:
        if not row["source"].startswith("https://github.com/"):
            problems.append(f"{row['name']}: source {row['source']!r} is not a public GitHub link")
        if not row["control"] and row["ratio"] is None and row["detected"] and not row["deciding_test"]:
            problems.append(f"{row['name']} ({row['precision']}): detected without a deciding test")
    return problems + table_problems(results, markdown) + summary_problems(results, markdown)


def readme_problems(markdown: str, readme: str) -> list[str]:
    quoted = [match.group(0) for match in SUMMARY_LINE.finditer(readme)]
    if not quoted:
        return ["docs/real-bugs.md quotes no summary line of real_bugs.md"]
    lines = set(markdown.splitlines())
    return [f"docs/real-bugs.md quotes {line!r}, which real_bugs.md does not say" for line in quoted if line not in lines]


def _load() -> tuple[dict, str]:
    return json.loads((RESULTS / "real_bugs.json").read_text()), (RESULTS / "real_bugs.md").read_text()


def test_the_markdown_says_what_the_json_holds():
    results, markdown = _load()
    assert results["rows"], "no measured case"
    assert results_problems(results, markdown) == []


def test_the_doc_quotes_the_results_summary():
    _, markdown = _load()
    assert readme_problems(markdown, (ROOT / "docs" / "real-bugs.md").read_text()) == []


def test_a_planted_ratio_or_culprit_or_readme_figure_is_caught():
    results, markdown = _load()
    bug = next(index for index, row in enumerate(results["rows"]) if not row["control"] and row["ratio"])
    planted = copy.deepcopy(results)
    planted["rows"][bug]["ratio"] *= 10
    assert results_problems(planted, markdown)
    planted = copy.deepcopy(results)
    planted["rows"][bug]["culprits"] = ["somewhere.else"]
    assert results_problems(planted, markdown)
    planted = copy.deepcopy(results)
    planted["rows"][bug]["localized"] = not planted["rows"][bug]["localized"]
    assert results_problems(planted, markdown)  # a row and the summary's count
    planted = copy.deepcopy(results)
    planted["rows"].pop(next(index for index, row in enumerate(results["rows"]) if row["control"]))
    assert results_problems(planted, markdown)
    summary = SUMMARY_LINE.search(markdown).group(0)
    assert readme_problems(markdown, summary.replace("detected", "caught"))
