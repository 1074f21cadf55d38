"""Long work as jobs: a command run in a subprocess, in its own directory, that a caller polls.

A job directory holds `spec.json` (the command, its explicit environment, the timeout), `lock`
(the supervisor's pid, start time and boot id while it runs), `status.json` (state, exit code,
message, times, the supervisor's and the command's process), `log.txt`
(the command's stdout and stderr) and, when the command succeeds, `result.json`. The supervisor
(`python ttrace_core/service/jobs.py DIR`, no torch import) starts the command in a new process group, enforces the timeout,
turns SIGTERM into a cancel, and writes the final status; the caller's own environment is never
changed. A job whose `status.json` says complete is a cache hit: asking again answers at once.

States: "running", then "complete" (the command exited with one of its success codes and wrote
its result), "failed" (any other exit, or the supervisor died), "timed_out", "cancelled".
A job that is not complete never has a `result.json` the caller would read.

A job directory may come from elsewhere (a candidate shared with its replay): every file is
type-checked before use, and a process it names is trusted only if pid, start time and boot id match.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from ttrace_core.format.regular_files import regular_file_bytes
from ttrace_core.record.processes import ProcessRef
from ttrace_core.record import warm_client

FINAL_STATES = ("complete", "failed", "timed_out", "cancelled")
PROGRESS_PREFIX = "[progress] "
"""A log line `[progress] 2/3 replaying the candidate` is the job's progress."""


@dataclass(kw_only=True, slots=True)
class JobSpec:
    command: list[str]
    env: dict[str, str]
    """The command's whole environment, written out: nothing is inherited implicitly."""
    cwd: str
    timeout_s: float = 900.0
    success_codes: tuple[int, ...] = (0,)
    """Exit codes that mean the command did its work (localize: 0 none, 1 culprit, 4 unexplained)."""
    result_file: str = "result.json"
    """A plain file name inside the job directory."""

    def __post_init__(self) -> None:
        if Path(self.result_file).name != self.result_file or self.result_file in ("", ".", ".."):
            raise ValueError(f"result_file {self.result_file!r} must be a plain file name inside the job directory")


@dataclass(kw_only=True, slots=True)
class JobStatus:
    state: Literal["running", "complete", "failed", "timed_out", "cancelled"]
    supervisor: ProcessRef | None = None
    command: ProcessRef | None = None
    """The command's process, the leader of its own process group (killed with it)."""
    exit_code: int | None = None
    message: str = ""
    started: float | None = None
    finished: float | None = None
    progress: str = ""
    warm: bool = False
    """The command was forked by the dashboard's warm worker (warm_worker.py), not started as a new process."""

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def pid(self) -> int | None:
        return None if self.supervisor is None else self.supervisor.pid

    @property
    def seconds(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started


class JobFileError(ValueError):
    pass


def _record_from_file(path: Path, record: type[JobSpec] | type[JobStatus], what: str):
    """A JobSpec or JobStatus from its JSON file, every field's type checked: the directory may come
    from a shared trace, and nothing in it is trusted."""
    try:
        return msgspec.convert(json.loads(regular_file_bytes(path)), type=record, strict=True)
    except (OSError, ValueError, RecursionError, msgspec.ValidationError) as error:
        raise JobFileError(f"{path}: not a valid job {what} ({str(error)[:160]})") from error


def _write_json(path: Path, data: dict) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    staging.write_text(json.dumps(data, indent=1))
    os.replace(staging, path)


@dataclass(slots=True)
class Job:
    """A handle on one job directory; every method reads the files, so any process may hold one."""

    directory: Path
    cached: bool = field(default=False)

    @property
    def log_path(self) -> Path:
        return self.directory / "log.txt"

    @property
    def result_path(self) -> Path:
        return self.directory / self.spec().result_file

    def spec(self) -> JobSpec:
        return _record_from_file(self.directory / "spec.json", JobSpec, "spec")

    def status(self) -> JobStatus:
        path = self.directory / "status.json"
        if not path.exists():  # the supervisor has not written its first status yet
            return _status_before_start(self.directory)
        try:
            status = _record_from_file(path, JobStatus, "status")
        except JobFileError as error:
            return JobStatus(state="failed", message=f"{error}; run it again")
        if not status.done and not (status.supervisor and status.supervisor.alive()):
            status = _supervisor_died(self.directory, status)
        status.progress = self._progress()
        return status

    def _progress(self) -> str:
        if not self.log_path.exists():
            return ""
        lines = [line for line in self.log_tail(200) if line.startswith(PROGRESS_PREFIX)]
        return lines[-1][len(PROGRESS_PREFIX):] if lines else ""

    def log_tail(self, num_lines: int = 20) -> list[str]:
        if not self.log_path.is_file():
            return []
        with open(self.log_path, "rb") as handle:
            handle.seek(max(0, self.log_path.stat().st_size - 64 * 1024))
            return handle.read().decode(errors="replace").splitlines()[-num_lines:]

    def result(self) -> dict | None:
        """The command's result, only once the job is complete; JobFileError if it is not a JSON object."""
        if self.status().state != "complete":
            return None
        return _result_of(self.result_path)

    def cancel(self) -> None:
        """Ask the supervisor to stop the command; the final status says "cancelled"."""
        status = self.status()
        supervisor = status.supervisor or _lock_holder(self.directory)
        if not status.done and supervisor is not None and supervisor.alive():
            os.kill(supervisor.pid, signal.SIGTERM)

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.2) -> JobStatus:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not (status := self.status()).done:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.directory}: still {status.state} after {timeout_s} s")
            time.sleep(poll_s)
        return status


def _result_of(path: Path) -> dict:
    try:
        result = json.loads(regular_file_bytes(path))
    except (OSError, ValueError, RecursionError) as error:
        raise JobFileError(f"{path}: not a readable job result ({str(error)[:120]}); run the job again") from error
    if not isinstance(result, dict):
        raise JobFileError(f"{path}: a job result must be a JSON object; run the job again")
    return result


STALE_LOCK_S = 30.0
"""A lock file still empty this long after its creation belongs to a submitter that died mid-submit."""


def _lock_holder(directory: Path) -> ProcessRef | None:
    try:
        return ProcessRef.decode(regular_file_bytes(directory / "lock").decode(errors="replace"))
    except OSError:
        return None


def _lock_is_stale(directory: Path) -> bool:
    """The lock's holder is gone: dead, of another boot or machine, or never named (and not just being written)."""
    try:
        text = regular_file_bytes(directory / "lock").decode(errors="replace")
        age = time.time() - (directory / "lock").stat().st_mtime
    except FileNotFoundError:
        return False
    except OSError:  # not a regular file (a FIFO, a directory, a symlink loop): it names no holder
        return True
    holder = ProcessRef.decode(text)
    if holder is None:
        return bool(text.strip()) or age > STALE_LOCK_S
    return not holder.alive()


def _status_before_start(directory: Path) -> JobStatus:
    if _lock_is_stale(directory) or not (directory / "lock").exists():
        return JobStatus(state="failed", message="the job's supervisor died before starting; run it again")
    return JobStatus(state="running", message="starting")


def _supervisor_died(directory: Path, status: JobStatus) -> JobStatus:
    """The supervisor is gone without a final word (SIGKILL, a crash, a restart, or a directory copied
    from elsewhere): stop its orphaned command, release the lock, and say so. Never complete."""
    if status.command is not None and status.command.alive():
        try:
            os.killpg(status.command.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    died = JobStatus(state="failed", supervisor=status.supervisor, command=status.command, exit_code=status.exit_code,
                     started=status.started, finished=time.time(),
                     message="the job's supervisor died before finishing; run it again")
    try:  # a read-only directory (a trace shared on read-only storage) still gets the answer, just not kept
        spec_result = _spec_result_file(directory)
        if spec_result is not None:
            spec_result.unlink(missing_ok=True)
        _write_json(directory / "status.json", asdict(died))
        if _lock_is_stale(directory):
            (directory / "lock").unlink(missing_ok=True)
    except OSError:
        pass
    return died


def _spec_result_file(directory: Path) -> Path | None:
    try:
        return directory / _record_from_file(directory / "spec.json", JobSpec, "spec").result_file
    except JobFileError:
        return None


def submit(directory: str | os.PathLike, spec: JobSpec, *, rerun: bool = False) -> Job:
    """Start the job in `directory`, or hand back the one already there: complete (a cache hit) or
    still running (two callers asking for the same job share it). A failed, timed-out or cancelled
    job is started again; so is any job with `rerun`."""
    directory = Path(directory)
    job = Job(directory)
    if directory.exists() and (directory / "spec.json").exists() and not rerun:
        state = job.status().state
        if state == "complete":
            return Job(directory, cached=True)
        if state == "running":
            return job
    directory.mkdir(parents=True, exist_ok=True)
    try:  # the lock makes submission atomic: of two concurrent submitters, one starts the job
        descriptor = os.open(directory / "lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        if not _lock_is_stale(directory):
            return job
        (directory / "lock").unlink(missing_ok=True)
        return submit(directory, spec, rerun=rerun)
    for stale in ("status.json", spec.result_file, "log.txt"):
        (directory / stale).unlink(missing_ok=True)
    _write_json(directory / "spec.json", asdict(spec))
    # Run by path, not `-m ttrace_core.service.jobs`: the package's __init__ would import torch (seconds)
    # before every job.
    supervisor = subprocess.Popen([sys.executable, __file__, str(directory)], cwd=spec.cwd,
                                  env=spec.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
    os.write(descriptor, ProcessRef.of(supervisor.pid).encode().encode())
    os.close(descriptor)
    return job


class _Cancelled(Exception):
    pass


def _raise_cancelled(signum: int, frame: object) -> None:
    raise _Cancelled


def _final_status(spec: JobSpec, directory: Path, exit_code: int) -> tuple[str, str]:
    result = directory / spec.result_file
    if exit_code not in spec.success_codes:
        return "failed", f"exit code {exit_code}; see the log"
    if not result.exists():
        return "failed", f"exit code {exit_code} but no {spec.result_file} was written"
    try:
        _result_of(result)
    except JobFileError as error:
        return "failed", f"exit code {exit_code} but {error}"
    return "complete", f"exit code {exit_code}"


def supervise(directory: Path) -> int:
    """Run the job's command to its end and write the final status (the supervisor's main)."""
    spec = _record_from_file(directory / "spec.json", JobSpec, "spec")
    status = JobStatus(state="running", supervisor=ProcessRef.of(os.getpid()), started=time.time(), message="running")
    signal.signal(signal.SIGTERM, _raise_cancelled)
    _write_json(directory / "status.json", asdict(status))
    command = None
    try:
        command = _start_command(spec, directory / "log.txt")
        status.command, status.warm = ProcessRef.of(command.pid), command.warm
        _write_json(directory / "status.json", asdict(status))
        exit_code = command.wait(spec.timeout_s)
        status.state, status.message = _final_status(spec, directory, exit_code)
        status.exit_code = exit_code
    except subprocess.TimeoutExpired:
        status.state, status.message = "timed_out", f"killed after its {spec.timeout_s:.0f} s timeout"
    except _Cancelled:
        status.state, status.message = "cancelled", "cancelled"
    except warm_client.WorkerSilent as error:  # not started again here: it could run twice
        status.state, status.message = "failed", f"{error}; run it again"
    finally:
        if command is not None:
            command.kill_group()
    if status.state != "complete":
        (directory / spec.result_file).unlink(missing_ok=True)
    status.finished = time.time()
    _write_json(directory / "status.json", asdict(status))
    (directory / "lock").unlink(missing_ok=True)
    return 0


def _start_command(spec: JobSpec, log_path: Path) -> warm_client.RunningCommand:
    """The job's command, in its own process group: forked by the dashboard's warm worker (warm_worker.py) when the
    job's environment names one and the command is ttrace's, else a new process."""
    argv = warm_client.warm_argv(spec.command)
    worker = spec.env.get(warm_client.WARM_ENV)
    if argv is not None and worker:
        started = warm_client.run(worker, {"argv": argv, "cwd": spec.cwd, "env": spec.env, "log": str(log_path)})
        if started is not None:
            return warm_client.RunningCommand.forked(started)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(spec.command, cwd=spec.cwd, env=spec.env, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return warm_client.RunningCommand(pid=process.pid, warm=False, process=process)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python ttrace_core/service/jobs.py JOB_DIR")
    sys.exit(supervise(Path(sys.argv[1])))
