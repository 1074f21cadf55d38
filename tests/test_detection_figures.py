"""The README's detection figures are the results file's (benchmarks/results/detection.md): the held-out
summary row of each precision, bug runs at >= 3 and the largest clean ratio, in-sample | held-out."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _summary() -> dict[str, list[str]]:
    text = (ROOT / "benchmarks" / "results" / "detection.md").read_text()
    table = text.split("### Summary, in-sample | held-out")[1].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0]] = [c.replace("\\|", "|") for c in cells[1:]]
    return rows


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_readme_states_each_precisions_bug_runs_at_3_and_largest_clean_ratio(precision):
    readme = (ROOT / "README.md").read_text()
    figures = _summary()[precision]
    at_three, largest_clean = figures[3], figures[4]
    assert f"{precision} {at_three}" in readme.replace("\n  ", " ").replace("\n", " ")
    assert f"{largest_clean} ({precision})" in readme.replace("\n  ", " ").replace("\n", " ")


def test_readme_states_the_fp8_against_bf16_row():
    readme = " ".join((ROOT / "README.md").read_text().split())
    detected, alarms, _, at_three, largest, within = _summary()["fp8 vs bf16"]
    assert f"{detected} bug runs detected" in readme and f"{alarms} false alarms, {at_three} bug runs at >= 3" in readme
    assert f"largest clean ratio is {largest} ({within} clean runs at or below 0.5)" in readme
