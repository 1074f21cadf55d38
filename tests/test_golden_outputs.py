"""The CLI gives what it gave before the stage-packages move, on every sample pair.

tests/golden/*.json.gz were written by tests/golden/capture.py from the code before the move: the
exit codes and text of `ttrace compare` and `ttrace inspect`, the `--json` output and the comparison
table. A refactor must give them back: text and structure exactly, numbers to float rounding (another
CPU may sum in another order), the numbers inside a cell that holds JSON (the structure tests' column) too.
"""

import gzip
import json
import math
from pathlib import Path

import pytest

from tests.golden import capture

pytestmark = pytest.mark.slow  # the CLI end to end on every sample pair
PAIRS = capture.sample_pairs()


def _json_in_text(value):
    """A table cell holding JSON (the structure tests' column) as its parsed value, so its numbers are compared
    to float rounding too; else None."""
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return None


def _assert_same(actual, expected, where: str) -> None:
    if _json_in_text(expected) is not None and _json_in_text(actual) is not None:
        _assert_same(_json_in_text(actual), _json_in_text(expected), where)
    elif isinstance(expected, float) and isinstance(actual, (int, float)):
        assert math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-300), f"{where}: {actual} != {expected}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{where}: keys differ"
        for name in expected:
            _assert_same(actual[name], expected[name], f"{where}.{name}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: lengths differ"
        for index, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.parametrize(("reference", "candidate"), PAIRS, ids=[c for _, c in PAIRS])
def test_cli_outputs_equal_the_recorded_ones(reference: str, candidate: str) -> None:
    golden = Path(capture.GOLDEN_DIR) / f"{candidate.replace('/', '__')}.json.gz"
    expected = json.loads(gzip.decompress(golden.read_bytes()))
    actual = json.loads(json.dumps(capture.run_outputs(reference, candidate), sort_keys=True))
    _assert_same(actual, expected, candidate)
