"""Long work as jobs: a command run in a subprocess, in its own directory, that a caller polls.

A job directory holds `spec.json` (the command, its explicit environment, the timeout), `lock`
(the supervisor's pid while it runs), `status.json` (state, exit code, message, times), `log.txt`
(the command's stdout and stderr) and, when the command succeeds, `result.json`. The supervisor
(`python ttrace_core/jobs.py DIR`, standard library only) starts the command in a new process group, enforces the timeout,
turns SIGTERM into a cancel, and writes the final status; the caller's own environment is never
changed. A job whose `status.json` says complete is a cache hit: asking again answers at once.

States: "running", then "complete" (the command exited with one of its success codes and wrote
its result), "failed" (any other exit, or the supervisor died), "timed_out", "cancelled".
A job that is not complete never has a `result.json` the caller would read.
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


@dataclass(kw_only=True, slots=True)
class JobStatus:
    state: str
    pid: int | None = None
    exit_code: int | None = None
    message: str = ""
    started: float | None = None
    finished: float | None = None
    progress: str = ""

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def seconds(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started


def _write_json(path: Path, data: dict) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    staging.write_text(json.dumps(data, indent=1))
    os.replace(staging, path)


def process_alive(pid: int | None) -> bool:
    """Whether process `pid` is running (a zombie is not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


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
        return self.directory / json.loads((self.directory / "spec.json").read_text())["result_file"]

    def status(self) -> JobStatus:
        path = self.directory / "status.json"
        if not path.exists():  # the supervisor has not written its first status yet
            holder = (self.directory / "lock").read_text().strip() if (self.directory / "lock").exists() else ""
            if holder and not process_alive(int(holder)):
                return JobStatus(state="failed", message="the job's supervisor died before starting; submit it again")
            return JobStatus(state="running", message="starting")
        status = JobStatus(**json.loads(path.read_text()))
        if not status.done and not process_alive(status.pid):
            # The supervisor is gone without a final word (killed with SIGKILL, machine restart).
            status = JobStatus(**{**asdict(status), "state": "failed", "finished": time.time(),
                                  "message": "the job's supervisor died before finishing; submit it again"})
            _write_json(path, asdict(status))
            (self.directory / "lock").unlink(missing_ok=True)
        status.progress = self._progress()
        return status

    def _progress(self) -> str:
        if not self.log_path.exists():
            return ""
        lines = [line for line in self.log_tail(200) if line.startswith(PROGRESS_PREFIX)]
        return lines[-1][len(PROGRESS_PREFIX):] if lines else ""

    def log_tail(self, num_lines: int = 20) -> list[str]:
        if not self.log_path.exists():
            return []
        with open(self.log_path, "rb") as handle:
            handle.seek(max(0, self.log_path.stat().st_size - 64 * 1024))
            return handle.read().decode(errors="replace").splitlines()[-num_lines:]

    def result(self) -> dict | None:
        """The command's result, only once the job is complete."""
        if self.status().state != "complete":
            return None
        return json.loads(self.result_path.read_text())

    def cancel(self) -> None:
        """Ask the supervisor to stop the command; the final status says "cancelled"."""
        status = self.status()
        holder = (self.directory / "lock").read_text().strip() if (self.directory / "lock").exists() else ""
        pid = status.pid or (int(holder) if holder.isdigit() else None)
        if not status.done and pid:
            os.kill(pid, signal.SIGTERM)

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.2) -> JobStatus:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not (status := self.status()).done:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.directory}: still {status.state} after {timeout_s} s")
            time.sleep(poll_s)
        return status


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
        holder = (directory / "lock").read_text().strip()
        if process_alive(int(holder) if holder.isdigit() else None) or not holder:
            return job
        (directory / "lock").unlink(missing_ok=True)
        return submit(directory, spec, rerun=rerun)
    for stale in ("status.json", spec.result_file, "log.txt"):
        (directory / stale).unlink(missing_ok=True)
    _write_json(directory / "spec.json", asdict(spec))
    # Run by path, not `-m ttrace_core.jobs`: the supervisor needs the standard library only, and the
    # package's __init__ would import torch (seconds) before every job.
    supervisor = subprocess.Popen([sys.executable, __file__, str(directory)], cwd=spec.cwd,
                                  env=spec.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
    os.write(descriptor, str(supervisor.pid).encode())
    os.close(descriptor)
    return job


class _Cancelled(Exception):
    pass


def _raise_cancelled(signum: int, frame: object) -> None:
    raise _Cancelled


def _final_status(spec: JobSpec, directory: Path, exit_code: int) -> tuple[str, str]:
    if exit_code in spec.success_codes and (directory / spec.result_file).exists():
        return "complete", f"exit code {exit_code}"
    if exit_code in spec.success_codes:
        (directory / spec.result_file).unlink(missing_ok=True)
        return "failed", f"exit code {exit_code} but no {spec.result_file} was written"
    (directory / spec.result_file).unlink(missing_ok=True)
    return "failed", f"exit code {exit_code}; see the log"


def supervise(directory: Path) -> int:
    """Run the job's command to its end and write the final status (the supervisor's main)."""
    spec = JobSpec(**json.loads((directory / "spec.json").read_text()))
    status = JobStatus(state="running", pid=os.getpid(), started=time.time(), message="running")
    signal.signal(signal.SIGTERM, _raise_cancelled)
    _write_json(directory / "status.json", asdict(status))
    with open(directory / "log.txt", "ab") as log:
        child = subprocess.Popen(spec.command, cwd=spec.cwd, env=spec.env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            exit_code = child.wait(timeout=spec.timeout_s)
            status.state, status.message = _final_status(spec, directory, exit_code)
            status.exit_code = exit_code
        except subprocess.TimeoutExpired:
            status.state, status.message = "timed_out", f"killed after its {spec.timeout_s:.0f} s timeout"
        except _Cancelled:
            status.state, status.message = "cancelled", "cancelled"
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    if status.state != "complete":
        (directory / spec.result_file).unlink(missing_ok=True)
    status.finished = time.time()
    _write_json(directory / "status.json", asdict(status))
    (directory / "lock").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python ttrace_core/jobs.py JOB_DIR")
    sys.exit(supervise(Path(sys.argv[1])))
