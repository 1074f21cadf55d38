"""The cached comparison table (ttrace_core/service/comparisons.py): what its key is bound to, and how its
provenance names the tolerance provider."""

import shutil

import pytest

from tests.faults.stale_cache import doubled_and_moved_over, doubled_in_place
from tests.synthetic_runs import write_pair
from ttrace_core import api
from ttrace_core.compare.estimate_file import PerturbationEstimate, TensorDeviation, estimate_path
from ttrace_core.format.schema import TensorKey


@pytest.fixture
def pair(tmp_path):
    return write_pair(tmp_path / "runs")


def _write_estimate(reference) -> None:
    """A perturbation estimate of one tensor: enough for `--tolerance auto` to choose the perturbation provider."""
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.lin", slot="output.0")
    deviation = TensorDeviation(key=key, deviation=1e-7, reference_norm=1.0, numel=48, per_sample=[1e-7] * 4)
    estimate_path(reference).write_text(PerturbationEstimate(precision="fp32", num_samples=4, relative=1e-7,
                                                             tensors={key: deviation}).to_json())


@pytest.mark.parametrize("tolerance, estimate, named", [
    ("auto", True, "perturbation estimate"),
    ("perturbation", True, "perturbation estimate"),
    ("auto", False, "dtype table"),
    ("dtype", True, "dtype table"),
    ("theorem", False, "theorem bound"),
], ids=["auto with an estimate", "perturbation", "auto without an estimate", "dtype", "theorem"])
def test_the_provenance_names_the_provider_behind_the_step_scalars(pair, tolerance, estimate, named):
    """Never "custom": every comparison puts the step scalars' tolerances in front of the provider, and the
    name is the provider's behind them (issue 42, defect 1: it looked up the wrapper's class name)."""
    reference, candidate = pair
    if estimate:
        _write_estimate(reference)
    table = api.comparison_table(reference, candidate, api.CompareSettings(tolerance=tolerance))
    assert table.provenance["tolerance_provider"] == named


@pytest.mark.parametrize("rewrite", [doubled_in_place, doubled_and_moved_over], ids=["in place", "moved over"])
@pytest.mark.parametrize("role", ["candidate", "reference"])
def test_values_rewritten_with_size_and_mtime_kept_are_compared_again(pair, rewrite, role):
    """The cache key holds what the file system changes on every write (ctime, inode), not only the name,
    size and mtime, which a rewrite can keep (issue 42, defect 8: the stale verdict was reused)."""
    reference, candidate = pair
    first = api.comparison_table(reference, candidate)
    rewrite((candidate if role == "candidate" else reference) / "rank_00000.step_000000.h5")
    assert api.cached_comparison_table(reference, candidate) is None
    again = api.comparison_table(reference, candidate)
    assert not again.cached and again.path != first.path


def test_a_copied_run_is_not_judged_by_the_tables_of_the_run_it_was_copied_from(pair, tmp_path):
    """A table is bound to the directories it was computed for: a copy (mtimes and the cache copied along)
    is compared again, and its provenance names the directories passed, not the source's."""
    reference, candidate = pair
    api.comparison_table(reference, candidate)
    copy = tmp_path / "copy"
    shutil.copytree(candidate, copy, copy_function=shutil.copy2)
    assert api.cached_comparison_table(reference, copy) is None
    copied = api.comparison_table(reference, copy)
    assert not copied.cached and (copied.provenance["reference"], copied.provenance["candidate"]) == (str(reference), str(copy))
    assert api.comparison_table(reference, copy).cached  # and the copy's own table is reused


def test_a_streamed_comparison_makes_each_row_once_and_its_table_equals_one_made_whole(pair, tmp_path, monkeypatch):
    """The job's table is its streamed chunks put together: the same frame, column types included, as making every
    row at once, and no row is made twice (it was: 3 s of the 48-layer pair's job)."""
    from ttrace_core.compare import table
    from ttrace_core.service import comparison_jobs, comparisons

    reference, candidate = pair
    whole = comparisons.comparison_table(reference, candidate, rebuild=True).frame
    made = []
    frame_from_comparisons = table.frame_from_comparisons
    monkeypatch.setattr(table, "frame_from_comparisons", lambda rows, *args, **kwargs: made.append(len(rows)) or
                        frame_from_comparisons(rows, *args, **kwargs))
    monkeypatch.setattr(comparison_jobs, "CHUNK_ROWS", 3)  # several chunks, some with no value in a column
    writer = comparison_jobs.RowChunkWriter(tmp_path / "rows")
    streamed = comparisons.comparison_table(reference, candidate, rebuild=True, stream=writer).frame
    assert sum(made) == len(whole) and len(made) > 1
    assert streamed.equals(whole) and list(streamed.dtypes) == list(whole.dtypes)
    assert comparison_jobs.RowChunkWriter(tmp_path / "other").frame_of([object()]) is None  # not its rows: made whole
