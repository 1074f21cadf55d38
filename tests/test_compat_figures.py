"""The compatibility results (benchmarks/compat.py) name what was tried, and their Markdown and the docs
show the json's figures: a Python 3.12 row with megatron-core >= 0.17 beside the 3.11 baseline, each
row with its versions, counts and one line per failure."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COUNTS = ("passed", "failed", "skipped")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3])


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return json.loads((RESULTS / "compat.json").read_text())["rows"]


def _md_rows() -> dict[str, list[str]]:
    """compat.md's table: combination -> cells."""
    table = [line for line in (RESULTS / "compat.md").read_text().splitlines() if line.startswith("| `")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    return {row[0].strip("`"): row[1:] for row in cells}


def test_the_rows_cover_the_baseline_and_python_3_12_with_a_newer_megatron(rows):
    assert len({row["combo"] for row in rows}) == len(rows)
    baseline = [r for r in rows if r["combo"] == "3.11:pinned:pinned"]
    assert baseline and _version(baseline[0]["python"])[:2] == (3, 11), rows
    newer = [r for r in rows if _version(r["python"])[:2] == (3, 12) and _version(r["megatron_core"]) >= (0, 17)]
    assert newer, [(r["python"], r["megatron_core"]) for r in rows]
    for row in rows:
        for name in ("python", "torch", "megatron_core"):
            assert row[name] not in ("", "absent"), (row["combo"], name)
            _version(row[name])  # an exact version, not a spec
        assert all(isinstance(row[name], int) and row[name] >= 0 for name in COUNTS), row["combo"]
        assert row["passed"] > 0, row["combo"]
        assert len(row["failures"]) == row["failed"], row["combo"]
        assert all(f["id"].startswith("tests/") and f["reason"] and "\n" not in f["reason"] for f in row["failures"])


def test_the_markdown_shows_the_json_figures(rows):
    table = _md_rows()
    assert set(table) == {row["combo"] for row in rows}
    text = (RESULTS / "compat.md").read_text()
    for row in rows:
        commit = row["commit"][:10] + (f" + {len(row['overlay'])} files" if row["overlay"] else "")
        expected = [commit, row["python"], row["torch"], row["megatron_core"], row["transformer_engine"],
                    *(str(row[name]) for name in COUNTS), f"{row['tests_s']:.0f}", f"{row['install_s']:.0f}"]
        assert table[row["combo"]] == expected, row["combo"]
        for failure in row["failures"]:
            assert f"- `{failure['id']}`: {failure['reason']}" in text, failure["id"]


def test_the_docs_quote_the_results(rows):
    docs = " ".join((ROOT / "docs" / "compatibility.md").read_text().split())
    for row in rows:
        figures = (f"{row['python']} | {row['torch']} | {row['megatron_core']} | {row['passed']} | "
                   f"{row['failed']} | {row['skipped']}")
        assert figures in docs, (row["combo"], figures)
