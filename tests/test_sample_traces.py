"""Every committed sample trace still reads and gives its documented verdict against the reference."""

import json
from pathlib import Path

import pytest

from ttrace_core.compare import compare_runs
from ttrace_core.store import RunReader

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "sample_traces"
SAMPLES = [s for s in json.loads((SAMPLES_DIR / "samples.json").read_text()) if s["name"] != "reference"]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s["name"] for s in SAMPLES])
def test_sample_gives_its_documented_verdict(sample):
    with RunReader(SAMPLES_DIR / "reference") as reference, RunReader(SAMPLES_DIR / sample["name"]) as candidate:
        result = compare_runs(reference, candidate)
    assert bool(result) == (sample["expected_exit"] == 0)
    expected = sample["first_divergence"]
    first = result.first_divergence
    if expected is None:
        assert first is None
    else:
        assert (first.key.phase, first.key.fqn, first.key.slot) == (expected["phase"], expected["fqn"], expected["slot"])
