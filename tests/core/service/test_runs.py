"""service/runs.py: the runs under a root from their manifests and file names, which pair of them says nothing,
and the dashboard's path confinement, which compares whole path components (runs/ab is not inside runs/a).

Runs are tests/synthetic_runs.py's (write_run: a manifest and one complete step per rank), their manifests
edited where a field matters. tests/core/test_api.py pins find_runs' basics (nested runs, a broken
manifest, the .ttrace folder) and path_under_root's plain escapes; here the rest."""

import json

import pytest

from tests.synthetic_runs import write_run
from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.format.schema import FORMAT_VERSION, RunManifest
from ttrace_core.format.writer import write_manifest
from ttrace_core.service.runs import (MAPPED_RUNS, RunInfo, entrypoint_text, example_config, find_runs, pair_problem,
                                      path_under_root, run_info)


def _run(path, *, role: str = "reference", world_size: int = 1, **manifest_fields):
    """A recorded run at `path` (directories made), its manifest's `manifest_fields` replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_run(path, role=role, world_size=world_size)
    if manifest_fields:
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, **manifest_fields}))
    return path


def test_every_run_under_the_root_is_found_sorted_by_path(tmp_path):
    root = tmp_path / "root"
    _run(root / "a")
    _run(root / "a" / "inner")  # a run inside a run's directory is a run too
    _run(root / "ab", role="candidate", world_size=2)
    _run(root / "team" / "nested" / "run")
    _run(root.joinpath("a", *MAPPED_RUNS, "tiny"))  # a mapped reference kept inside its reference
    _run(root.joinpath("a", *MAPPED_RUNS, "half.partial"))  # one still being written
    _run(root / "a" / ".ttrace" / "elsewhere")  # derived data, not a run
    _run(root / "a" / ".localize" / "replay")
    _run(root / ".hidden" / "run")
    (root / "empty").mkdir()
    _run(tmp_path / "outside")
    (root / "link").symlink_to(tmp_path / "outside")  # not followed out of the root
    runs = find_runs(root)
    assert [run.path for run in runs] == ["a", "a/.ttrace/mapped/tiny", "a/inner", "ab", "team/nested/run"]
    assert all(run.error is None and run.steps == [0] for run in runs)
    assert [(run.role, run.world_size) for run in runs if run.path == "ab"] == [("candidate", 2)]


def test_a_root_that_is_a_run_lists_itself_as_dot_and_run_info_names_it_after_its_folder(tmp_path):
    run = _run(tmp_path / "the-run")
    assert [info.path for info in find_runs(run)] == ["."]
    assert run_info(run).path == "the-run" and run_info(tmp_path / "x" / ".." / "the-run").path == "the-run"


def test_a_root_that_is_no_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    for root in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(TraceFormatError) as raised:
            find_runs(root)
        assert str(raised.value) == (f"{root.resolve()}: not a directory; pass the folder that holds your run "
                                     "directories")


def test_what_a_run_info_reads_from_the_manifest_and_the_file_names(tmp_path):
    command = ["python", "-m", "ttrace_examples", "torch-gpt", "--config", json.dumps({"bug": "row-bias", "tp": 2})]
    run = _run(tmp_path / "run", role="candidate", world_size=2, precision="bf16",
               entrypoint={"command": command},
               environment={"python": "3.12.1", "packages": {"torch": "2.13.0", "h5py": None, "numpy": ""}},
               blind_spots={"layers.0.bda": "returns a function"})
    (run / "tolerance_estimate.json").write_text("{}")
    (run / "tolerance_estimate.fp8.json").write_text("{}")
    (run / "rank_00000.step_000001.h5.partial").write_bytes(b"")
    info = run_info(run)
    assert (info.path, info.role, info.precision, info.world_size, info.error) == ("run", "candidate", "bf16", 2, None)
    assert (info.steps, info.partial_steps, info.degrees, info.layout) == ([0], [1], {"tp": 2}, "tp2")
    assert info.model == {"num_layers": 2, "hidden": 8} and info.format_version == FORMAT_VERSION
    assert info.bug == "row-bias" and info.entrypoint == f"python -m ttrace_examples torch-gpt --config '{command[-1]}'"
    assert info.versions == {"python": "3.12.1", "torch": "2.13.0"}  # packages without a version are left out
    assert info.blind_spots == {"layers.0.bda": "returns a function"}
    assert info.has_estimate and info.estimates_for == ["fp8"]


def test_a_run_without_a_complete_step_or_manifest_carries_its_error(tmp_path):
    started = tmp_path / "started"
    write_manifest(started, RunManifest(role="reference", world_size=2))
    (started / "rank_00000.step_000000.h5").write_bytes(b"")  # rank 1 never wrote step 0
    info = run_info(started)
    assert (info.steps, info.partial_steps, info.role) == ([], [0], "reference")
    assert info.error == f"{started.resolve()}: no complete step (partial: [0]); re-record the run"
    (tmp_path / "no-manifest").mkdir()
    assert "manifest.json: missing" in run_info(tmp_path / "no-manifest").error


@pytest.mark.parametrize("degrees, layout", [
    ({}, "single rank"),
    ({"tp": 1, "pp": 1, "dp": 1}, "single rank"),
    ({"tp": 2, "sp": 1, "pp": 1, "dp": 1}, "sp tp2"),
    ({"dp": 4, "dist_opt": 1, "sp": 0}, "dist_opt dp4"),
    ({"pp": 2, "tp": 2, "ep": 4}, "ep4 pp2 tp2"),
    ({"tp": "2", "fsdp": 2.0}, "single rank"),
], ids=["none", "all 1", "flags that are on", "a flag that is off", "sorted by name", "not integers"])
def test_layout_names_the_degrees_above_one_and_the_flags_that_are_on(degrees, layout):
    assert RunInfo(path="x", degrees=degrees).layout == layout


@pytest.mark.parametrize("entrypoint, config", [
    ({"factory": "examples:build", "config": {"bug": "x"}}, {"bug": "x"}),
    ({"command": ["python", "-m", "ttrace_examples", "torch-gpt", "--config", '{"bug": "y"}']}, {"bug": "y"}),
    ({"command": ["python", "-m", "ttrace_examples", "torch-gpt", "--config"]}, {}),
    ({"command": ["python", "-m", "ttrace_examples", "torch-gpt", "--config", "{not json"]}, {}),
    ({"command": ["python", "-m", "ttrace_examples", "torch-gpt", "--config", "[1, 2]"]}, {}),
    ({"command": ["python", "train.py", "--config", '{"bug": "z"}']}, {}),
    ({}, {}),
], ids=["an older trace's factory", "the example's command", "--config last", "not JSON", "not an object",
        "a user's own command", "nothing recorded"])
def test_example_config(entrypoint, config):
    assert example_config(entrypoint) == config


@pytest.mark.parametrize("entrypoint, text", [
    ({"command": ["torchrun", "--nproc-per-node", "2", "train.py", "--name", "a b"]},
     "torchrun --nproc-per-node 2 train.py --name 'a b'"),
    ({"factory": "examples:build"}, "examples:build"),
    ({"command": [], "factory": "examples:build"}, "examples:build"),
    ({}, None),
], ids=["a command, shell-quoted", "a factory", "an empty command", "neither"])
def test_entrypoint_text(entrypoint, text):
    assert entrypoint_text(entrypoint) == text


def test_pair_problem(tmp_path):
    reference, candidate = _run(tmp_path / "ref"), _run(tmp_path / "cand", role="candidate", world_size=2)
    other_reference = _run(tmp_path / "ref2")
    assert pair_problem(reference, candidate) is None
    assert pair_problem(reference, other_reference) is None  # two references: left to the comparison
    assert pair_problem(reference, tmp_path / "missing") is None  # unreadable: the comparison names it
    assert pair_problem(reference, tmp_path / "cand" / ".." / "ref") == (
        f"{reference} is compared with itself, which always passes; pass a reference and a different candidate run")
    assert pair_problem(candidate, reference) == (
        f"the runs are swapped: {candidate} was recorded as a candidate and {reference} as a reference; "
        "pass the reference first")


@pytest.mark.parametrize("relative, inside", [
    ("run", True),
    (".", True),
    ("run/../run", True),
    ("../a/run", True),  # leaves the root by name only to come back into it
    ("../ab", False),  # a sibling whose name starts with the root's: outside
    ("../ab/run", False),
    ("..", False),
], ids=["a run", "the root", "back into the run", "out and back in", "a sibling that starts alike",
        "inside that sibling", "the parent"])
def test_path_under_root_compares_whole_components(tmp_path, relative, inside):
    root = tmp_path / "runs" / "a"
    (root / "run").mkdir(parents=True)
    (tmp_path / "runs" / "ab" / "run").mkdir(parents=True)
    if inside:
        assert path_under_root(root, relative) == (root / relative).resolve()
    else:
        with pytest.raises(TtraceError) as raised:
            path_under_root(root, relative)
        target = (root / relative).resolve()
        assert str(raised.value) == (f"{relative}: resolves to {target}, outside the dashboard root {root.resolve()}; "
                                     "only runs under the root are served")


def test_a_symlink_is_judged_by_where_it_leads(tmp_path, monkeypatch):
    root = tmp_path / "runs" / "a"
    (root / "run").mkdir(parents=True)
    (tmp_path / "runs" / "ab").mkdir()
    (root / "to-run").symlink_to(root / "run")
    (root / "to-sibling").symlink_to(tmp_path / "runs" / "ab")
    assert path_under_root(root, "to-run") == (root / "run").resolve()
    with pytest.raises(TtraceError, match="outside the dashboard root"):
        path_under_root(root, "to-sibling")
    monkeypatch.chdir(tmp_path)  # a relative root is resolved from where the dashboard runs
    assert path_under_root("runs/a", "run") == (root / "run").resolve()
