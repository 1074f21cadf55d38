"""The first comparison of a pair as a job (jobs.py) that streams its table: the dashboard draws the
rows compared so far, and the first divergence as soon as it is known, instead of a spinner.

The job runs `ttrace compare REF CAND --rows-to JOB_DIR`. Its rows arrive in execution order and a
row's verdict never depends on a later row (engine.compare_runs' `on_row`), so every chunk written
is final: the rows so far are the finished table's first rows, and the first failing row among
them is the run's first divergence. Each chunk is a Parquet file `rows-NNNNNN.parquet`, written
atomically (table.write_table); the job's progress is its log's `[progress] done/total` line. When
the whole table is cached (comparisons.py), the job writes `table.json` (its path): from then on the
rows are complete (`streamed_rows` says so while the job prints its verdict and exits), the cache
answers and the chunks are never read again.

Small pairs are compared in the page's own process: starting the job's Python and torch costs
about as much as comparing them (`STREAM_ABOVE_BYTES`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ttrace_core.compare.settings import CompareSettings
from ttrace_core.service.comparisons import CacheLookup, cache_path, lookup_table
from ttrace_core.service.jobs import PROGRESS_PREFIX, Job, JobSpec, submit
from ttrace_core.service.replays import job_environment, project_root

STREAM_ABOVE_BYTES = 64 * 2**20
"""Pairs whose step files hold more bytes than this are compared as a streamed job. Below it a
comparison takes a second or two (benchmarks/results/scale.md: 0.8 s for a 23 MiB pair of 2,934
tensors), about what the job's own start costs (a Python with torch); a 250 MiB pair of 31,000 small
tensors takes 10 s, and its page would show nothing meanwhile."""
CHUNK_ROWS = 256
CHUNK_SECONDS = 0.5
"""A chunk is written after this many rows or seconds, whichever comes first."""
TABLE_RESULT = "table.json"
PAUSE_ENV = "TTRACE_COMPARE_PAUSE_AFTER_ROWS"
"""Tests and demos: the job stops after writing this many rows, until a `resume` file appears in
its directory (a deterministic 'slow' comparison, with no timing involved)."""
RESUME_FILE = "resume"
BAD_INPUT_EXIT = 2
"""`ttrace compare`'s exit code for a trace it cannot read: a job that ended so is not started again."""


def trace_bytes(run_dir: Path) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(run_dir) if entry.name.endswith((".h5", ".partial"))
               and entry.is_file(follow_symlinks=False))


def streams(reference: Path, candidate: Path) -> bool:
    """Whether this pair's first comparison runs as a streamed job rather than in the caller."""
    return trace_bytes(reference) + trace_bytes(candidate) > STREAM_ABOVE_BYTES


def comparison_job_dir(reference: Path, candidate: Path, settings: CompareSettings) -> Path:
    """Next to the cached table it will write, named by the same digest of the inputs."""
    table_path, _ = cache_path(reference, candidate, settings)
    return _job_dir_of(table_path)


def _job_dir_of(table_path: Path) -> Path:
    table_path = table_path.resolve()  # the job runs in another working directory
    return table_path.parent.parent / "jobs" / table_path.stem


def _chunk_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("rows-*.parquet"))


def submit_comparison(reference: str | os.PathLike, candidate: str | os.PathLike,
                      settings: CompareSettings | None = None, *, lookup: CacheLookup | None = None) -> Job:
    """Start (or find, running or finished) the streamed comparison of a pair under `settings`; `lookup`: the
    caller's answer of comparisons.lookup_table for these runs and settings, not asked again."""
    reference, candidate = Path(reference).resolve(), Path(candidate).resolve()
    if lookup is None:
        lookup = lookup_table(reference, candidate, settings, read=False)
    assert settings is None or settings == lookup.settings, "a lookup made for other settings"
    settings = lookup.settings
    directory = _job_dir_of(lookup.path)
    if (directory / "spec.json").exists():
        status = Job(directory).status()
        if status.state == "failed" and status.exit_code == BAD_INPUT_EXIT:
            return Job(directory)  # the same files would fail the same way; a changed file is a new job
        if status.state not in ("running", "complete"):
            for stale in _chunk_files(directory) + [directory / RESUME_FILE]:
                stale.unlink(missing_ok=True)  # a failed attempt's rows must not show as this one's
    command = [sys.executable, "-m", "ttrace_core", "compare", str(reference), str(candidate),
               "--rows-to", str(directory), *settings.cli_args()]
    spec = JobSpec(command=command, env=job_environment(), cwd=str(project_root()), timeout_s=3600.0,
                   success_codes=(0, 1), result_file=TABLE_RESULT)
    return submit(directory, spec)


@dataclass(kw_only=True, slots=True)
class StreamedRows:
    """What a streamed comparison has produced so far."""

    frame: pd.DataFrame
    """The rows compared so far, in execution order: the finished table's first rows."""
    num_done: int
    num_total: int | None
    """Tensors to compare in all, once the job has planned its comparison."""
    state: str
    """The job's state: running, complete, failed, timed_out, cancelled."""
    message: str
    """Why the job failed (the last line its command printed), empty otherwise."""
    num_chunks: int = 0
    """Chunk files read: a later call given these rows reads only the chunks after them."""


def streamed_rows(job: Job, known: StreamedRows | None = None) -> StreamedRows:
    """What the job has compared so far; with `known` (an earlier answer for the same job), only the chunks
    written since are read (chunks are final and numbered in order)."""
    from ttrace_core.compare.table import read_table

    status = job.status()
    state = status.state
    if state == "running" and (job.directory / TABLE_RESULT).exists():
        state = "complete"  # the table is cached: the job only prints its verdict now
    files = _chunk_files(job.directory)
    start = known.num_chunks if known is not None and known.num_chunks <= len(files) else 0
    chunks = ([known.frame] if start and not known.frame.empty else []) + [read_table(path)[0] for path in files[start:]]
    frame = pd.concat(chunks, ignore_index=True) if chunks else pd.DataFrame()
    done, total = _progress_numbers(status.progress, len(frame))
    message = ""
    if state in ("failed", "timed_out", "cancelled"):
        tail = [line for line in job.log_tail(5) if line.strip() and not line.startswith(PROGRESS_PREFIX)]
        message = tail[-1].removeprefix("ttrace: error: ") if tail else status.message
    return StreamedRows(frame=frame, num_done=done, num_total=total, state=state, message=message,
                        num_chunks=len(files))


def _progress_numbers(progress: str, num_rows: int) -> tuple[int, int | None]:
    done, _, total = progress.partition(" ")[0].partition("/")
    if done.isdigit() and total.isdigit():
        return max(int(done), num_rows), int(total)
    return num_rows, None


class RowChunkWriter:
    """The job's side: collects rows as they are compared and writes them as chunk files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in _chunk_files(directory):
            stale.unlink()
        self._pending: list = []
        self._num_written = 0
        self._last_write = time.monotonic()
        self._pause_after = int(os.environ.get(PAUSE_ENV, "0") or 0)
        self._failure_written = False
        self._frames: list[pd.DataFrame] = []
        self._written: list = []
        """The chunks' frames and the comparisons they hold, in order: the whole table is their concatenation."""

    def add(self, comparison, candidate_reader) -> None:
        self._pending.append(comparison)
        pause_now = self._pause_after and self._num_written + len(self._pending) >= self._pause_after
        first_failure = not comparison and not self._failure_written  # the first divergence: show it at once
        self._failure_written = self._failure_written or first_failure
        if len(self._pending) >= CHUNK_ROWS or time.monotonic() - self._last_write >= CHUNK_SECONDS or pause_now \
                or first_failure:
            self.flush(candidate_reader)

    def flush(self, candidate_reader) -> None:
        from ttrace_core.compare.table import frame_from_comparisons, write_table

        if not self._pending:
            return
        frame = frame_from_comparisons(self._pending, candidate_reader, first_order=self._num_written)
        write_table(self.directory / f"rows-{len(_chunk_files(self.directory)):06d}.parquet", frame, {})
        self._frames.append(frame)
        self._written += self._pending
        self._num_written += len(self._pending)
        self._pending, self._last_write = [], time.monotonic()
        self._pause_if_asked()

    def frame_of(self, comparisons: list) -> pd.DataFrame | None:
        """The chunks concatenated, when they hold exactly `comparisons` in order (else None): the table
        `frame_from_comparisons(comparisons)` makes, without making its rows again."""
        if len(comparisons) != len(self._written) or any(a is not b for a, b in zip(comparisons, self._written)):
            return None
        if not self._frames:
            return None
        frame = pd.concat(self._frames, ignore_index=True)
        for column in frame.columns[frame.dtypes == object]:  # a chunk without a value there left it untyped
            frame[column] = pd.Series(frame[column].tolist(), index=frame.index)  # typed as one frame's would be
        return frame

    def progress(self, done: int, total: int) -> None:
        if done == 1 or done == total or done % 50 == 0:
            print(f"{PROGRESS_PREFIX}{done}/{total} tensors compared", flush=True)

    def finish(self, table_path: Path) -> None:
        (self.directory / TABLE_RESULT).write_text(json.dumps({"table": str(table_path), "num_rows": self._num_written}))

    def _pause_if_asked(self) -> None:
        if self._pause_after and self._num_written >= self._pause_after:
            self._pause_after = 0
            while not (self.directory / RESUME_FILE).exists():
                time.sleep(0.05)
