"""Which process is which, and whether it runs (ttrace_core/record/processes.py)."""

import json
import subprocess
import sys
import time

import psutil
import pytest

import ttrace_core.record.processes as processes
from ttrace_core.record.processes import ProcessRef, process_alive
from ttrace_core.service.jobs import Job


def test_a_running_process_is_alive_and_a_killed_one_a_reused_pid_and_a_zombie_are_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ref = ProcessRef.of(child.pid)
        assert ref.start is not None and ref.alive() and process_alive(child.pid)
        assert ProcessRef.decode(ref.encode()) == ref
        assert not ProcessRef(pid=child.pid, start=ref.start + 1, boot=ref.boot).alive()  # a reused pid
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not process_alive(child.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(200):  # exited, not reaped: a zombie
        if psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    assert not process_alive(zombie.pid)
    zombie.wait(timeout=30)


class _PlatformWithoutProcfs:
    """psutil as it answers on macOS or Windows, for one running process that /proc does not list."""

    STATUS_ZOMBIE = psutil.STATUS_ZOMBIE
    Error, NoSuchProcess, AccessDenied = psutil.Error, psutil.NoSuchProcess, psutil.AccessDenied

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def boot_time(self) -> float:
        return 1_700_000_000.0

    def Process(self, pid: int):  # noqa: N802 (psutil's name)
        if pid != self.pid:
            raise psutil.NoSuchProcess(pid)
        return type("RunningProcess", (), {"status": lambda _: psutil.STATUS_RUNNING,
                                           "create_time": lambda _: 1_700_000_123.456})()


def _pid_nobody_has() -> int:
    return next(pid for pid in range(4_194_000, 4_000_000, -1) if not psutil.pid_exists(pid))


def test_a_running_job_is_alive_where_there_is_no_procfs(tmp_path, monkeypatch):
    """Off Linux there is no /proc: liveness is psutil's answer, so a running job's supervisor is not
    reported dead on its first poll (issue 42, defect 3; it read /proc/PID/stat by hand)."""
    pid = _pid_nobody_has()
    monkeypatch.setattr(processes, "psutil", _PlatformWithoutProcfs(pid), raising=False)
    supervisor = ProcessRef.of(pid)
    assert supervisor.start is not None and supervisor.alive() and process_alive(pid)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "status.json").write_text(json.dumps({"state": "running", "supervisor": {
        "pid": supervisor.pid, "start": supervisor.start, "boot": supervisor.boot}}))
    assert Job(job_dir).status().state == "running"


@pytest.mark.parametrize("pid", [0, None], ids=["zero", "none"])
def test_no_pid_is_not_alive(pid):
    assert not process_alive(pid)
