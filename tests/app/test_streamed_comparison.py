"""A large pair's first comparison is a job that streams its rows: the heatmap draws the first
divergence before the table is complete (service/comparison_jobs.py, app/ui.load_comparison).

The job is paused after a few rows (PAUSE_ENV) until the test lets it go on, so "before the table is
complete" holds by construction, not by timing."""

import time

import pytest
from streamlit.testing.v1 import AppTest

from tests.synthetic_runs import write_pair
from ttrace_core import api
from ttrace_core.service import comparison_jobs
from ttrace_core.service.comparison_jobs import PAUSE_ENV, RESUME_FILE, comparison_job_dir
from ttrace_core.service.dashboard import ROOT_ENV
from ttrace_core.service.jobs import Job, JobStatus
from tests.support.pages import MAIN

FIRST = "forward/layers.0.act/output.0"
PAUSED_AFTER = 4


@pytest.fixture
def streamed_pair(tmp_path, monkeypatch):
    reference, candidate = write_pair(tmp_path)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    monkeypatch.setattr(comparison_jobs, "STREAM_ABOVE_BYTES", 0)  # this small pair streams too
    return reference.resolve(), candidate.resolve()


def _heatmap() -> AppTest:
    app = AppTest.from_file(MAIN, default_timeout=60)
    app.switch_page("../pages/heatmap.py")
    app.query_params["ref"], app.query_params["cand"] = "reference", "candidate"
    return app.run()


def _rows_when(job: Job, condition, timeout_s: float = 120.0) -> comparison_jobs.StreamedRows:
    deadline = time.monotonic() + timeout_s
    while not condition(rows := api.streamed_rows(job)):
        assert rows.state == "running", f"the job ended early: {rows.state} {rows.message}"
        assert time.monotonic() < deadline, f"no rows after {timeout_s} s: {job.log_tail()}"
        time.sleep(0.1)
    return rows


def test_heatmap_shows_the_first_divergence_before_the_table_is_complete(streamed_pair, monkeypatch):
    reference, candidate = streamed_pair
    monkeypatch.setenv(PAUSE_ENV, str(PAUSED_AFTER))
    app = _heatmap()
    assert not app.exception
    job = Job(comparison_job_dir(reference, candidate, api.CompareSettings()))
    rows = _rows_when(job, lambda r: len(r.frame) >= PAUSED_AFTER)

    app.run()  # what the page's next poll draws: the rows so far, the table still incomplete
    assert not app.exception
    assert api.cached_comparison_table(reference, candidate) is None
    assert any(f"First divergence: `{FIRST}`" in error.value for error in app.error)
    (bar,) = app.get("progress")
    assert f"comparing {PAUSED_AFTER}/" in bar.proto.text
    assert len(app.get("plotly_chart")) == 1  # the heatmap so far, no timeline yet
    assert not [button for button in app.get("download_button")]

    (job.directory / RESUME_FILE).touch()
    assert job.wait(timeout_s=120).state == "complete", job.log_tail()
    app.run()  # the whole page, from the cached table
    assert not app.exception
    table = api.cached_comparison_table(reference, candidate)
    assert table is not None
    assert any(f"First divergence: `{FIRST}`" in error.value for error in app.error)
    assert len(app.get("plotly_chart")) == 1 and not app.get("progress")  # the whole heatmap (the timeline on request)
    assert any(line.startswith(f"FAILED (not equivalent): first divergence at `{FIRST}`") for line in job.log_tail())
    # the streamed rows are the finished table's first rows, and reading on from them gives the whole table
    columns = ["tensor", "order", "status", "passed", "ratio"]
    assert rows.frame[columns].equals(table.frame[columns].iloc[:len(rows.frame)].reset_index(drop=True))
    rest = api.streamed_rows(job, rows)
    assert rest.num_chunks > rows.num_chunks and rest.state == "complete"
    assert rest.frame[columns].equals(table.frame[columns])


def test_the_rows_are_complete_once_the_table_is_cached(tmp_path):
    """After it caches the table the job still prints its verdict before it exits; the page need not wait for that:
    the rows are complete once the job has named the table (`table.json`)."""
    class Running:
        directory = tmp_path

        def status(self) -> JobStatus:
            return JobStatus(state="running", progress="3/3 tensors compared")

    job = Running()
    assert api.streamed_rows(job).state == "running"
    (tmp_path / comparison_jobs.TABLE_RESULT).write_text('{"table": "t.parquet", "num_rows": 3}')
    rows = api.streamed_rows(job)
    assert rows.state == "complete" and rows.message == ""


def test_a_comparison_job_that_fails_shows_its_one_line_error(streamed_pair):
    reference, candidate = streamed_pair
    step_file = next(candidate.glob("rank_00001.step_*.h5"))
    step_file.write_bytes(step_file.read_bytes()[:200])  # a truncated step file
    app = _heatmap()
    job = Job(comparison_job_dir(reference, candidate, api.CompareSettings()))
    job.wait(timeout_s=120)
    app.run()
    assert not app.exception
    (error,) = app.error
    assert "the comparison stopped (failed)" in error.value and step_file.name in error.value


def test_a_streamed_comparison_is_submitted_with_the_pages_cache_answer(streamed_pair, monkeypatch):
    """load_comparison asks the cache once (api.comparison_lookup) and submits the job with that answer: the
    submission neither fingerprints a run nor reads a manifest again, and finds the same job directory."""
    from ttrace_core.service import comparisons

    reference, candidate = streamed_pair
    lookup = api.comparison_lookup(reference, candidate)
    asked = []
    monkeypatch.setattr(comparisons, "comparison_fingerprint", lambda run_dir: asked.append(run_dir))
    monkeypatch.setattr(comparisons, "read_manifest", lambda run_dir: asked.append(run_dir))
    monkeypatch.setattr(comparison_jobs, "submit", lambda directory, spec: directory)
    directory = api.submit_comparison(reference, candidate, lookup=lookup)
    assert asked == []
    monkeypatch.undo()
    assert directory == comparison_job_dir(reference, candidate, api.CompareSettings())
