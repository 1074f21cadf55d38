"""The real-bug results and the docs that quote them agree (no runs: reads files only).

benchmarks/real_bugs.py writes benchmarks/results/real_bugs.json and real_bugs.md; docs/real-bugs.md quotes the
summary lines. Checked: the Markdown is exactly what the json renders to (every row, ratio, deciding
test and culprit), every bug row names its public source, every summary line the doc quotes is the
results file's, and the json names the versions it ran with. Each check returns its problems, so the
planted-mismatch tests can show it fails.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from tests.real_bugs.results_table import markdown as rendered_markdown

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SUMMARY_LINE = re.compile(r"^- (fp32|bf16): .*$", re.MULTILINE)


def results_problems(results: dict, markdown: str) -> list[str]:
    problems = [f"versions: {package} not named" for package in ("torch", "megatron-core")
                if not results.get("versions", {}).get(package)]
    for row in results["rows"]:
        if not row["source"].startswith("https://github.com/"):
            problems.append(f"{row['name']}: source {row['source']!r} is not a public GitHub link")
        if not row["control"] and row["ratio"] is None and row["detected"] and not row["deciding_test"]:
            problems.append(f"{row['name']} ({row['precision']}): detected without a deciding test")
    rendered = rendered_markdown(results)
    if rendered != markdown:
        differing = [f"{mine!r} != {theirs!r}" for mine, theirs in zip(markdown.splitlines(), rendered.splitlines())
                     if mine != theirs][:3]
        problems.append("real_bugs.md is not what real_bugs.json renders to: " + "; ".join(differing or ["length"]))
    return problems


def readme_problems(markdown: str, readme: str) -> list[str]:
    quoted = [match.group(0) for match in SUMMARY_LINE.finditer(readme)]
    if not quoted:
        return ["docs/real-bugs.md quotes no summary line of real_bugs.md"]
    lines = set(markdown.splitlines())
    return [f"docs/real-bugs.md quotes {line!r}, which real_bugs.md does not say" for line in quoted if line not in lines]


def _load() -> tuple[dict, str]:
    return json.loads((RESULTS / "real_bugs.json").read_text()), (RESULTS / "real_bugs.md").read_text()


def test_the_markdown_is_the_json_rendered():
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
    summary = SUMMARY_LINE.search(markdown).group(0)
    assert readme_problems(markdown, summary.replace("detected", "caught"))
