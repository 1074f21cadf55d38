import os

import pandas as pd
import pytest

from tests.synthetic_runs import write_pair
from ttrace_core import api
from ttrace_core.compare.table import read_provenance
from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.format.schema import FORMAT_VERSION


@pytest.fixture
def pair(tmp_path):
    return write_pair(tmp_path / "runs")


def test_comparison_is_cached_and_rebuilt_when_an_input_changes(pair):
    reference, candidate = pair
    first = api.comparison_table(reference, candidate)
    again = api.comparison_table(reference, candidate)
    assert not first.cached and again.cached and again.path == first.path
    assert first.path.parent == candidate / ".ttrace" / "comparisons"
    pd.testing.assert_frame_equal(first.frame, again.frame)
    step_file = candidate / "rank_00001.step_000000.h5"
    os.utime(step_file, ns=(step_file.stat().st_atime_ns, step_file.stat().st_mtime_ns + 10**9))
    changed = api.comparison_table(reference, candidate)
    assert not changed.cached and changed.path != first.path


def test_settings_are_part_of_the_cache_key_and_the_provenance(pair):
    reference, candidate = pair
    default = api.comparison_table(reference, candidate)
    theorem = api.comparison_table(reference, candidate, api.CompareSettings(tolerance="theorem"))
    assert theorem.path != default.path and not theorem.cached
    assert theorem.provenance["settings"]["tolerance"] == "theorem"
    assert set(theorem.frame["tolerance_method"].dropna()) == {"theorem"}


def test_the_table_opens_in_plain_pandas_with_its_provenance(pair):
    reference, candidate = pair
    result = api.comparison_table(reference, candidate)
    frame = pd.read_parquet(result.path)
    assert len(frame) == len(result.frame) == 11
    provenance = read_provenance(result.path)
    assert provenance["reference_manifest_sha256"] and provenance["candidate_manifest_sha256"]
    assert provenance["ttrace_version"] == api.ttrace_version() and provenance["trace_format"] == FORMAT_VERSION == 5
    assert provenance["first_divergence"] == {"tensor": "forward/layers.0.act/output.0", "step": 0, "micro_batch": 0}
    assert provenance["num_failed"] == 8 and not provenance["passed"]
    assert api.comparison(reference, candidate).attrs["ttrace"]["created"] == provenance["created"]


def test_a_damaged_cache_file_is_rebuilt(pair):
    reference, candidate = pair
    path = api.comparison_table(reference, candidate).path
    path.write_bytes(b"not parquet")
    again = api.comparison_table(reference, candidate)
    assert not again.cached and len(again.frame) == 11


def test_cli_compare_goes_through_the_cached_table(pair, capsys):
    from ttrace_core.cli.main import main

    reference, candidate = pair
    assert main(["compare", str(reference), str(candidate)]) == 1
    assert "first divergence" in capsys.readouterr().out
    assert list((candidate / ".ttrace" / "comparisons").glob("comparison-*.parquet"))


def test_find_runs_lists_nested_runs_and_reports_broken_ones(tmp_path, pair):
    root = tmp_path / "runs"
    api.comparison_table(*pair)  # a .ttrace folder inside the candidate is not a run
    broken = root / "team" / "broken"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{not json")
    runs = {run.path: run for run in api.find_runs(root)}
    assert set(runs) == {"reference", "candidate", "team/broken"}
    assert runs["candidate"].role == "candidate" and runs["candidate"].world_size == 2 and runs["candidate"].steps == [0]
    assert runs["reference"].error is None
    assert "manifest.json: not a valid manifest" in runs["team/broken"].error


def test_a_truncated_trace_is_one_line_naming_the_file(pair):
    reference, candidate = pair
    step_file = candidate / "rank_00001.step_000000.h5"
    step_file.write_bytes(step_file.read_bytes()[:300])
    with pytest.raises(TraceFormatError, match=r"rank_00001\.step_000000\.h5: not a readable HDF5 file"):
        api.comparison_table(reference, candidate)


@pytest.mark.parametrize("relative, allowed", [("reference", True), ("a/../reference", True), (".", True),
                                               ("..", False), ("../../etc", False), ("/etc", False)],
                         ids=["inside", "dotdot-inside", "root", "parent", "escape", "absolute"])
def test_path_under_root(tmp_path, relative, allowed):
    (tmp_path / "reference").mkdir()
    if allowed:
        assert api.path_under_root(tmp_path, relative).is_relative_to(tmp_path.resolve())
    else:
        with pytest.raises(TtraceError, match="outside the dashboard root"):
            api.path_under_root(tmp_path, relative)


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(TtraceError, match="outside the dashboard root"):
        api.path_under_root(root, "link")


def test_tensor_view_maps_the_error_to_the_rank_that_holds_it(pair, monkeypatch):
    import ttrace_core.format.reader as store

    def no_full_index(*args, **kwargs):
        raise AssertionError("tensor_view opened the whole run index")

    monkeypatch.setattr(store.RunReader, "__init__", no_full_index)
    reference, candidate = pair
    view = api.tensor_view(reference, candidate, "forward/layers.0.act/output.0", 0, 0)
    assert view.shape == (8, 6) and view.reference.shape == (8, 6)
    assert [(s.rank, s.region) for s in view.shards] == [(0, ((0, 4), (0, 6))), (1, ((4, 8), (0, 6)))]
    assert view.shards[0].error == 0.0 and view.shards[1].error > 0.1
    assert view.worst[0]["index"][0] >= 4 and view.worst[0]["abs_diff"] == pytest.approx(1.0)
    assert view.image.shape == (8, 6) and view.image_block == (1, 1)
    assert view.histogram_counts.sum() + view.num_exact == 48 and view.num_exact == 24


def test_tensor_view_shows_which_replica_drifts(pair):
    reference, candidate = pair
    view = api.tensor_view(reference, candidate, "forward/layers.1.norm/output.0", 0, 1)
    assert view.shards[0].error == 0.0 and view.shards[1].error == pytest.approx(1e-3, rel=1e-3)
    assert view.replica_drift.ranks == (0, 1)


def test_tensor_view_of_an_unrecorded_tensor_is_one_line(pair):
    reference, candidate = pair
    with pytest.raises(TraceFormatError, match="no rank recorded"):
        api.tensor_view(reference, candidate, "forward/nothing/output.0", 0, 0)


def test_big_tensors_are_max_pooled_so_a_single_bad_element_shows():
    import numpy as np

    from ttrace_core.service.tensor_view import as_matrix, max_pool

    matrix = np.zeros((1000, 700))
    matrix[777, 3] = 5.0
    image, block = max_pool(matrix, max_side=100)
    assert image.shape == (100, 100) and block == (10, 7) and image.max() == 5.0 and image[77, 0] == 5.0
    assert as_matrix(np.arange(10.0)).shape == (1, 10)  # a vector stays one row: drawn as a vector, not a 4 x 3 image
    image, block = max_pool(as_matrix(np.arange(1000.0)), max_side=100)
    assert image.shape == (1, 100) and block == (1, 10) and image[0, -1] == 999.0  # pooled along its length
    assert as_matrix(np.zeros((2, 3, 4))).shape == (6, 4)

