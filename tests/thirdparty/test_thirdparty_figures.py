"""The third-party results files and the docs that quote them agree (no runs: reads files only).

benchmarks/thirdparty_{torchtitan,transformers,hf_trainer,lightning}.py write
benchmarks/results/thirdparty_{torchtitan,transformers,hf_trainer,lightning}.{json,md}; docs/torchtitan.md,
docs/transformers.md (both Hugging Face tables) and docs/your-own-script.md (Lightning's) quote their
tables. Checked: every layout expected to pass passed (for transformers, directly or in the row that
re-compares it after `ttrace estimate`), every tensors-passed figure a docs table quotes is the json's,
every measured row is quoted, and each results file names the versions it ran with. Each check returns its problems, so the planted-mismatch tests can show it fails.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"thirdparty_{name}.json").read_text())


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of every markdown table body row (header and separator rows excluded)."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[\s\-:|]+\|", line.strip()):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _quoted(rows: list[list[str]], key: tuple[str, ...]) -> list[list[str]]:
    """Table rows whose leading cells are `key` (layout names may carry backticks in prose tables)."""
    def plain(cells) -> tuple[str, ...]:
        return tuple(cell.replace("`", "") for cell in cells)

    return [row for row in rows if plain(row[:len(key)]) == plain(key)]


# ---- torchtitan ----------------------------------------------------------------------------------

def _torchtitan_key(row: dict) -> tuple[str, str, str]:
    return row["layout"], row["model"], row["precision"]


def torchtitan_problems(results: dict, doc: str) -> list[str]:
    problems = [f"torchtitan: {key} not named in the json" for key in ("torch", "torchtitan") if not results.get(key)]
    doc_rows = table_rows(doc)
    for row in results["rows"]:
        key = _torchtitan_key(row)
        if row["expected"] == "pass" and row["verdict"] != "PASSED":
            problems.append(f"torchtitan {key}: expected to pass, verdict {row['verdict']!r} {row['why']}")
        if not row["total"]:
            continue
        figure = f"{row['passed']}/{row['total']}"
        quoted = _quoted(doc_rows, key)
        if not quoted:
            problems.append(f"docs/torchtitan.md: no table row for {key} ({figure})")
        problems += [f"docs/torchtitan.md {key}: quotes {cells}, the json says {figure}"
                     for cells in quoted if figure not in cells]
    return problems


# ---- transformers --------------------------------------------------------------------------------

def transformers_problems(results: dict, doc: str) -> list[str]:
    problems = [f"transformers: {key} not named in the json" for key in ("torch", "transformers")
                if not results.get(key)]
    estimated = results.get("with_estimate") or {}
    doc_rows = table_rows(doc)
    for case in [*results["cases"], *([estimated] if estimated else [])]:
        name = case["case"]
        rescued = (estimated.get("case", "").startswith(f"{name}, with") and estimated.get("verdict") == "pass")
        if case.get("expected", "pass") == "pass" and case["verdict"] != "pass" and not rescued:
            problems.append(f"transformers {name!r}: expected to pass, verdict {case['verdict']!r}")
        figure = f"{case['passed']} / {case['total']}"
        quoted = _quoted(doc_rows, (name,))
        if not quoted:
            problems.append(f"docs/transformers.md: no table row for {name!r} ({figure})")
        problems += [f"docs/transformers.md {name!r}: quotes {cells}, the json says {figure}"
                     for cells in quoted if figure not in cells]
    return problems


# ---- the Hugging Face and Lightning Trainers ------------------------------------------------------

def trainer_problems(name: str, results: dict, doc: str) -> list[str]:
    """Every case ended as expected (a correct run passed, a wrong one failed and, where a module was broken,
    localize named it), and the Trainer's doc quotes each case's figure."""
    problems = [f"{name}: {key} not named in the json" for key in PACKAGES_OF[name] if not results.get(key)]
    doc_rows = table_rows(doc)
    for case in results["cases"]:
        case_name, figure = case["case"], f"{case['passed']} / {case['total']}"
        if case["verdict"] != case["expected"]:
            problems.append(f"{name} {case_name!r}: expected {case['expected']!r}, verdict {case['verdict']!r}")
        if case.get("broken_module") and case.get("localized") != [case["broken_module"]]:
            problems.append(f"{name} {case_name!r}: localized {case.get('localized')!r}, the broken module is "
                            f"{case['broken_module']!r}")
        quoted = _quoted(doc_rows, (case_name,))
        if not quoted:
            problems.append(f"docs/{DOC_OF[name]}: no Trainer table row for {case_name!r} ({figure})")
        problems += [f"docs/{DOC_OF[name]} {case_name!r}: quotes {cells}, the json says {figure}"
                     for cells in quoted if figure not in cells]
    return problems


# ---- the tests -----------------------------------------------------------------------------------

CHECKS = {"torchtitan": torchtitan_problems, "transformers": transformers_problems,
          "hf_trainer": functools.partial(trainer_problems, "hf_trainer"),
          "lightning": functools.partial(trainer_problems, "lightning")}
DOC_OF = {"torchtitan": "torchtitan.md", "transformers": "transformers.md", "hf_trainer": "transformers.md",
          "lightning": "your-own-script.md"}
PACKAGES_OF = {"torchtitan": ("torch", "torchtitan"), "transformers": ("torch", "transformers"),
               "hf_trainer": ("torch", "transformers", "accelerate"), "lightning": ("torch", "lightning")}


@pytest.mark.parametrize("name", list(CHECKS), ids=list(CHECKS))
def test_results_and_docs_agree(name):
    results, doc = _load(name), (DOCS / DOC_OF[name]).read_text()
    assert CHECKS[name](results, doc) == []


@pytest.mark.parametrize("name", list(CHECKS), ids=list(CHECKS))
def test_each_results_markdown_names_its_versions(name):
    results, markdown = _load(name), (RESULTS / f"thirdparty_{name}.md").read_text()
    for package in PACKAGES_OF[name]:
        assert results[package] in markdown, (package, results[package])


def _first_measured(rows: list[dict]) -> dict:
    return next(row for row in rows if row["total"])


@pytest.mark.parametrize("plant", ["figure", "verdict", "version"])
def test_a_planted_torchtitan_mismatch_is_caught(plant):
    results, doc = copy.deepcopy(_load("torchtitan")), (DOCS / "torchtitan.md").read_text()
    row = _first_measured([row for row in results["rows"] if row["expected"] == "pass"])
    if plant == "figure":
        row["passed"] -= 1
    elif plant == "verdict":
        row["verdict"] = "FAILED (mismatch)"
    else:
        del results["torchtitan"]
    assert torchtitan_problems(results, doc)


@pytest.mark.parametrize("plant", ["figure", "verdict", "version"])
def test_a_planted_transformers_mismatch_is_caught(plant):
    results, doc = copy.deepcopy(_load("transformers")), (DOCS / "transformers.md").read_text()
    case = next(case for case in results["cases"] if case["expected"] == "pass" and case["verdict"] == "pass")
    if plant == "figure":
        case["total"] += 1
    elif plant == "verdict":
        case["verdict"] = "fail"
    else:
        results["torch"] = ""
    assert transformers_problems(results, doc)


def test_a_doc_quoting_another_figure_is_caught():
    results = _load("torchtitan")
    row = _first_measured(results["rows"])
    figure = f"{row['passed']}/{row['total']}"
    doc = (DOCS / "torchtitan.md").read_text()
    line = next(line for line in doc.splitlines()
                if _quoted(table_rows(line), _torchtitan_key(row)) and figure in line)
    planted = doc.replace(line, line.replace(figure, f"{row['passed'] + 1}/{row['total']}"))
    assert torchtitan_problems(results, planted)


@pytest.mark.parametrize("name", ["hf_trainer", "lightning"])
@pytest.mark.parametrize("plant", ["figure", "verdict", "localized", "version"])
def test_a_planted_trainer_mismatch_is_caught(name, plant):
    results, doc = copy.deepcopy(_load(name)), (DOCS / DOC_OF[name]).read_text()
    assert trainer_problems(name, results, doc) == []
    case = next(case for case in results["cases"] if case["expected"] == "pass")
    if plant == "figure":
        case["passed"] -= 1
    elif plant == "verdict":
        case["verdict"] = "fail"
    elif plant == "localized":
        next(case for case in results["cases"] if case.get("broken_module"))["localized"] = ["some.other.module"]
    else:
        results[PACKAGES_OF[name][-1]] = ""
    assert trainer_problems(name, results, doc)
