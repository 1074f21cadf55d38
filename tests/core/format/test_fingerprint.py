"""format/fingerprint.py: the environment a run was recorded in (every manifest's `environment`), and the
lines a replay prints for what differs from it. tests/core/localize/test_reproduction.py checks one
difference of each group through a replay; here each field is pinned, with exact tables."""

from __future__ import annotations

import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest

import ttrace_core
from ttrace_core.format import fingerprint
from ttrace_core.format.fingerprint import PACKAGES, VARIABLES, environment_fingerprint, fingerprint_differences


def _fingerprint(**fields) -> dict:
    """A recorded fingerprint of fixed values, `fields` replacing some."""
    base = {"command": ["train.py", "--steps", "2"], "python": "3.11.7", "platform": "Linux-x86_64",
            "packages": {"torch": "2.13.0", "numpy": "2.4.6", "h5py": "3.16.0"},
            "variables": {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": None}, "world_size": 2}
    return {**base, **fields}


def test_the_fingerprint_holds_the_interpreter_every_package_and_variable_and_the_world_size(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("TTRACE_REWRITE_FROM", "/elsewhere")  # ttrace's own variables are not the environment's
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.1"])
    found = environment_fingerprint(4)
    assert set(found) == {"command", "python", "platform", "packages", "variables", "world_size"}
    assert found["command"] == ["train.py", "--lr", "0.1"] and found["command"] is not sys.argv  # a copy
    assert (found["python"], found["platform"], found["world_size"]) == (platform.python_version(), platform.platform(), 4)
    assert list(found["packages"]) == list(PACKAGES)
    assert found["variables"] == {name: ("3" if name == "OMP_NUM_THREADS" else None) for name in VARIABLES}
    assert environment_fingerprint()["world_size"] is None
    assert json.loads(json.dumps(found)) == found  # stored as it is in manifest.json


def test_a_package_that_is_not_installed_is_none(monkeypatch):
    def only_torch(name: str) -> str:
        if name != "torch":
            raise PackageNotFoundError(name)
        return "2.13.0"

    monkeypatch.setattr(fingerprint, "version", only_torch)
    assert environment_fingerprint()["packages"] == {name: ("2.13.0" if name == "torch" else None) for name in PACKAGES}


def test_ttraces_distribution_is_named_as_the_package_names_it():
    """Stage 0 cannot import ttrace_core's root, so it writes the distribution's name again: the two agree."""
    assert fingerprint.DISTRIBUTIONS["ttrace"] == ttrace_core.DISTRIBUTION


def test_the_fingerprint_records_ttraces_own_version():
    """ttrace is installed as the distribution ttrace-dist (`ttrace` on the package index is someone else's):
    its entry is that distribution's version, not whatever a package named `ttrace` is."""
    try:
        installed = version(ttrace_core.DISTRIBUTION)
    except PackageNotFoundError:
        pytest.skip(f"{ttrace_core.DISTRIBUTION} is not installed (a source checkout run without pip install)")
    assert environment_fingerprint()["packages"]["ttrace"] == installed


def test_every_difference_is_one_line_in_a_fixed_order():
    """Packages then variables, each by name, then python, platform and world size; a name only one side
    has reads None on the other."""
    recorded = _fingerprint()
    now = _fingerprint(command=["other.py"], python="3.12.1", platform="Darwin", world_size=4,
                       packages={"torch": "2.14.0", "numpy": "2.4.6", "megatron-core": "0.16.1"},
                       variables={"OMP_NUM_THREADS": "8", "PYTHONHASHSEED": "0"})
    assert fingerprint_differences(recorded, now) == [
        "h5py: 3.16.0 -> None", "megatron-core: None -> 0.16.1", "torch: 2.13.0 -> 2.14.0",
        "OMP_NUM_THREADS: 1 -> 8", "PYTHONHASHSEED: None -> 0",
        "python: 3.11.7 -> 3.12.1", "platform: Linux-x86_64 -> Darwin", "world_size: 2 -> 4"]


def test_the_command_and_ttraces_own_variables_are_left_out():
    """A replay runs another command with TTRACE_* variables set, by design: neither is a difference."""
    recorded = _fingerprint(variables={"OMP_NUM_THREADS": "1", "TTRACE_REWRITE_FROM": None})
    now = _fingerprint(command=["python", "-m", "ttrace_core", "localize"],
                       variables={"OMP_NUM_THREADS": "1", "TTRACE_REWRITE_FROM": "/ref", "TTRACE_RANK_SETTINGS": "{}"})
    assert fingerprint_differences(recorded, now) == []


@pytest.mark.parametrize("recorded", [{}, None], ids=["empty", "none"])
def test_a_manifest_without_a_fingerprint_is_said_once(recorded):
    assert fingerprint_differences(recorded, _fingerprint()) == [
        "the candidate's manifest has no environment fingerprint (recorded by an older ttrace)"]


def test_a_fingerprint_missing_a_group_reads_it_as_empty():
    """An older fingerprint without `variables`: each variable set now is a difference, none is an error."""
    recorded = {key: value for key, value in _fingerprint().items() if key != "variables"}
    assert fingerprint_differences(recorded, _fingerprint()) == ["OMP_NUM_THREADS: None -> 1"]
