"""`--json PATH` and `--json -` of compare and localize write strict JSON: no bare NaN or Infinity.

The synthetic candidate (tests/synthetic_runs.py) holds a NaN on rank 0 of `layers.1.lin`, so its
comparison carries an infinite ratio and a NaN replica difference; a pretend finished replay carries
an infinite ratio after rewriting.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.cli_support import localization_for, run_main, write_finished_replay
from tests.conftest import run_ttrace
from tests.synthetic_runs import write_pair
from ttrace_core.compare.engine import RunComparison
from ttrace_core.localize.verdicts import Localization
from ttrace_core.format.strict_json import dumps, finite_or_none


def strict_loads(text: str):
    def refuse(constant: str):
        raise AssertionError(f"not strict JSON: bare {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    reference, candidate = write_pair(tmp_path_factory.mktemp("json"))
    write_finished_replay(reference, candidate, None, localization_for(1))
    return reference, candidate


def _nonfinite(data: dict) -> dict:
    return next(c for c in data["comparisons"] if c["status"] == "nonfinite")


def test_strict_json_writes_null_for_every_non_finite_float():
    value = {"a": math.nan, "b": [math.inf, -math.inf, 1.5, (2.0, math.nan)], "c": {"d": "nan", "e": 3}}
    assert finite_or_none(value) == {"a": None, "b": [None, None, 1.5, [2.0, None]], "c": {"d": "nan", "e": 3}}
    assert strict_loads(dumps(value)) == finite_or_none(value)


def test_compare_json_file_is_strict(pair, tmp_path, capsys):
    reference, candidate = pair
    path = tmp_path / "comparison.json"
    code, out, _ = run_main(["compare", str(reference), str(candidate), "--json", str(path)], capsys)
    assert code == 1 and "FAILED (not equivalent) |" in out
    data = strict_loads(path.read_text())
    nonfinite = _nonfinite(data)
    assert nonfinite["ratio"] is None and nonfinite["num_nan"] == [1, 0]  # inf in memory, null on disk
    assert nonfinite["replica_drift"]["max_abs_diff"] is None
    again = RunComparison.from_json(path.read_text())
    assert not again and [c.status for c in again.comparisons] == [c["status"] for c in data["comparisons"]]


def test_compare_json_to_stdout_keeps_the_table_on_stderr(pair, capsys):
    reference, candidate = pair
    code, out, err = run_main(["compare", str(reference), str(candidate), "--json", "-"], capsys)
    assert code == 1
    data = strict_loads(out)  # the whole of stdout is the JSON
    assert data["passed"] is False and _nonfinite(data)["ratio"] is None
    assert "FAILED (not equivalent) | 3/11 tensors pass" in err


def test_compare_json_to_stdout_from_the_shell(pair):
    reference, candidate = pair
    result = run_ttrace("compare", str(reference), str(candidate), "--json", "-", timeout=120)
    assert result.returncode == 1
    assert strict_loads(result.stdout)["candidate"] == str(candidate)
    assert "FAILED (not equivalent) |" in result.stderr


def test_localize_json_file_and_stdout_are_strict(pair, tmp_path, capsys):
    reference, candidate = pair
    path = tmp_path / "localization.json"
    code, out, _ = run_main(["localize", str(reference), str(candidate), "--json", str(path)], capsys)
    assert code == 1 and "layers.0.act" in out
    evidence = strict_loads(path.read_text())["modules"][0]["evidence"][0]
    assert (evidence["ratio_before"], evidence["ratio_after"]) == (6e4, None)  # ratio_after was inf
    assert Localization.from_json(path.read_text()).culprits == ["layers.0.act"]

    code, out, err = run_main(["localize", str(reference), str(candidate), "--json", "-"], capsys)
    assert code == 1
    assert strict_loads(out) == strict_loads(path.read_text())
    assert "(cached replay:" in err and "layers.0.act" in err
