import json
import os
import signal
import sys
import time
from dataclasses import asdict

import pytest

from ttrace_core.record.processes import ProcessRef, process_alive
from ttrace_core.service.jobs import Job, JobFileError, JobSpec, submit


def _spec(code: str, tmp_path, *, timeout_s: float = 60, success_codes=(0,), extra_env: dict | None = None) -> JobSpec:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path), **(extra_env or {})}
    return JobSpec(command=[sys.executable, "-c", code], env=env, cwd=str(tmp_path), timeout_s=timeout_s,
                   success_codes=success_codes)



def test_a_job_runs_to_its_result_and_asking_again_is_a_cache_hit(tmp_path):
    job_dir = tmp_path / "job"
    spec = _spec("import pathlib; print('[progress] 1/2 working', flush=True); "
                 f"pathlib.Path({str(job_dir / 'result.json')!r}).write_text('{{\"answer\": 42}}')", tmp_path)
    job = submit(job_dir, spec)
    status = job.wait(timeout_s=60)
    assert status.state == "complete" and status.exit_code == 0 and not job.cached
    assert job.result() == {"answer": 42}
    assert job.status().progress == "1/2 working" and "[progress] 1/2 working" in job.log_tail()
    again = submit(job_dir, spec)
    assert again.cached and again.status().state == "complete" and again.result() == {"answer": 42}


@pytest.mark.parametrize("code, message", [
    ("raise SystemExit(3)", "exit code 3"),
    ("import pathlib; pathlib.Path('RESULT').write_text('{}'); raise SystemExit(2)", "exit code 2"),
    ("pass", "no result.json was written"),
], ids=["crash", "crash-after-writing-a-result", "success-without-result"])
def test_a_failed_job_never_leaves_a_result(tmp_path, code, message):
    job_dir = tmp_path / "job"
    job = submit(job_dir, _spec(code.replace("RESULT", str(job_dir / "result.json")), tmp_path))
    status = job.wait(timeout_s=60)
    assert status.state == "failed" and message in status.message
    assert job.result() is None and not (job_dir / "result.json").exists()


def test_a_job_past_its_timeout_is_killed(tmp_path):
    """The command would sleep 60 s; the wait gives up at 30 s, so only a kill at the timeout ends it in time."""
    job = submit(tmp_path / "job", _spec("import time; time.sleep(60)", tmp_path, timeout_s=1))
    status = job.wait(timeout_s=30)
    assert status.state == "timed_out"


def test_cancel_stops_the_command_and_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (f"import os, subprocess, sys, time, pathlib; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); time.sleep(60)")
    job = submit(tmp_path / "job", _spec(code, tmp_path))
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    job.cancel()
    status = job.wait(timeout_s=30)
    assert status.state == "cancelled" and job.result() is None
    time.sleep(0.2)
    assert not process_alive(int(pid_file.read_text()))


SIDE_BY_SIDE = """import os, pathlib, time
with open('runs-' + os.environ['NAME'], 'a') as runs:
    runs.write('ran\\n')
pathlib.Path('started-' + os.environ['NAME']).touch()
while not (pathlib.Path('started-' + os.environ['OTHER']).exists() and pathlib.Path('release').exists()):
    time.sleep(0.02)
pathlib.Path(os.environ['RESULT']).write_text('{}')
"""
"""A job that says it started, then waits for the other job's word and the test's release."""


def test_two_jobs_run_side_by_side_and_one_directory_is_one_job(tmp_path):
    """Checked by events, not durations: each job waits until the other has started, so jobs run one
    after the other would leave the first waiting until its timeout (state timed_out)."""
    def spec(name: str, other: str) -> JobSpec:
        return _spec(SIDE_BY_SIDE, tmp_path, timeout_s=60,
                     extra_env={"NAME": name, "OTHER": other, "RESULT": str(tmp_path / name / "result.json")})

    first = submit(tmp_path / "a", spec("a", "b"))
    second = submit(tmp_path / "b", spec("b", "a"))
    again = submit(tmp_path / "a", spec("a", "b"))  # the same job: it cannot finish before the release below
    (tmp_path / "release").touch()
    assert first.wait(timeout_s=90).state == "complete" and second.wait(timeout_s=90).state == "complete"
    assert again.status().state == "complete"
    runs = {name: (tmp_path / f"runs-{name}").read_text().splitlines() for name in "ab"}
    assert runs == {"a": ["ran"], "b": ["ran"]}  # asking twice for job a ran it once


def test_the_job_gets_exactly_its_environment_and_the_caller_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TTRACE_PARENT_ONLY", "1")
    before = dict(os.environ)
    job_dir = tmp_path / "job"
    code = (f"import os, json, pathlib; pathlib.Path({str(job_dir / 'result.json')!r}).write_text(json.dumps("
            "{'mine': os.environ.get('TTRACE_MINE'), 'parent': os.environ.get('TTRACE_PARENT_ONLY')}))")
    job = submit(job_dir, _spec(code, tmp_path, extra_env={"TTRACE_MINE": "yes"}))
    job.wait(timeout_s=30)
    assert job.result() == {"mine": "yes", "parent": None}
    assert dict(os.environ) == before


def test_a_job_whose_supervisor_is_killed_reports_failure(tmp_path):
    job = submit(tmp_path / "job", _spec("import time; time.sleep(60)", tmp_path))
    deadline = time.monotonic() + 30
    while job.status().pid is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(job.status().pid, signal.SIGKILL)
    status = job.wait(timeout_s=30)
    assert status.state == "failed" and "supervisor died" in status.message


def _wait_for(path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _sleeper_with_child(tmp_path, pid_file) -> str:
    """A command that starts a grandchild, names it in pid_file, and sleeps."""
    return (f"import subprocess, sys, time, pathlib; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); time.sleep(120)")


def test_a_killed_command_fails_without_a_result_and_releases_the_lock(tmp_path):
    job_dir = tmp_path / "job"
    code = (f"import os, pathlib, time; pathlib.Path({str(job_dir / 'result.json')!r}).write_text('{{\"half\": '); "
            f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text(str(os.getpid())); time.sleep(120)")
    job = submit(job_dir, _spec(code, tmp_path))
    _wait_for(tmp_path / "ready")
    os.kill(int((tmp_path / "ready").read_text()), signal.SIGKILL)
    status = job.wait(timeout_s=30)
    assert status.state == "failed" and status.exit_code == -9 and job.result() is None
    assert not (job_dir / "result.json").exists() and not (job_dir / "lock").exists()


def test_a_killed_supervisor_takes_its_orphaned_command_down_and_the_next_submit_runs_afresh(tmp_path):
    job_dir, pid_file = tmp_path / "job", tmp_path / "grandchild.pid"
    job = submit(job_dir, _spec(_sleeper_with_child(tmp_path, pid_file), tmp_path))
    _wait_for(pid_file)
    command_pid = job.status().command.pid
    os.kill(job.status().pid, signal.SIGKILL)
    status = job.wait(timeout_s=30)
    assert status.state == "failed" and "supervisor died" in status.message and job.result() is None
    time.sleep(0.2)
    assert not process_alive(command_pid) and not process_alive(int(pid_file.read_text()))
    assert not (job_dir / "lock").exists()
    done = submit(job_dir, _spec(f"import pathlib; pathlib.Path({str(job_dir / 'result.json')!r}).write_text('{{}}')", tmp_path))
    assert done.wait(timeout_s=30).state == "complete" and done.result() == {}


@pytest.mark.parametrize("written", ["{\"half\": ", "[1, 2]", "null"], ids=["cut-off", "a-list", "null"])
def test_a_success_code_with_an_unreadable_result_is_a_failure(tmp_path, written):
    job_dir = tmp_path / "job"
    code = f"import pathlib; pathlib.Path({str(job_dir / 'result.json')!r}).write_text({written!r})"
    status = submit(job_dir, _spec(code, tmp_path)).wait(timeout_s=30)
    assert status.state == "failed" and "result.json" in status.message and "run the job again" in status.message
    assert not (job_dir / "result.json").exists()


def _copied_job(tmp_path, status: dict, *, spec_result_file: str = "result.json", result: str | None = None):
    """A job directory as it could arrive inside a shared trace: written elsewhere, trusted in nothing."""
    job_dir = tmp_path / "shared" / "job"
    job_dir.mkdir(parents=True)
    spec = {**asdict(_spec("pass", tmp_path)), "result_file": spec_result_file}
    (job_dir / "spec.json").write_text(json.dumps(spec))
    (job_dir / "status.json").write_text(json.dumps(status))
    if result is not None:
        (job_dir / "result.json").write_text(result)
    return Job(job_dir)


def test_a_copied_running_job_naming_a_process_of_ours_never_signals_it(tmp_path):
    """pid = this test process, of another machine's boot: not our supervisor, so neither alive nor cancelled."""
    me = {"pid": os.getpid(), "start": 1, "boot": "another-machine"}
    job = _copied_job(tmp_path, {"state": "running", "supervisor": me, "command": {**me, "pid": os.getpgrp()}})
    job.cancel()  # would SIGTERM this test if it trusted the file
    status = job.status()
    assert status.state == "failed" and "supervisor died" in status.message
    assert ProcessRef.of(os.getpid()).alive() and not ProcessRef(**me).alive()


@pytest.mark.parametrize("status, needle", [
    ({"state": "complete", "exit_code": "zero"}, "exit_code"),
    ({"state": "exploded"}, "state"),
    ({"state": "running", "supervisor": {"pid": "1; rm -rf /"}}, "supervisor"),
], ids=["wrong-type", "unknown-state", "hostile-pid"])
def test_a_malformed_status_is_a_failed_job_that_names_its_file(tmp_path, status, needle):
    job = _copied_job(tmp_path, status)
    found = job.status()
    assert found.state == "failed" and f"{job.directory / 'status.json'}: not a valid job status" in found.message
    assert needle in found.message and "\n" not in found.message and job.result() is None


def test_a_result_file_outside_the_job_directory_is_refused(tmp_path):
    job = _copied_job(tmp_path, {"state": "complete", "exit_code": 0}, spec_result_file="../../../etc/passwd")
    with pytest.raises(JobFileError, match=r"spec.json: not a valid job spec .*must be a plain file name"):
        job.result()


def test_a_complete_copied_job_whose_result_is_not_an_object_is_a_one_line_error(tmp_path):
    job = _copied_job(tmp_path, {"state": "complete", "exit_code": 0}, result="[\"not\", \"a\", \"localization\"]")
    with pytest.raises(JobFileError, match="result.json: a job result must be a JSON object; run the job again"):
        job.result()


def test_a_lock_left_by_a_submitter_that_died_does_not_block_the_job_forever(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "spec.json").write_text(json.dumps(asdict(_spec("pass", tmp_path))))
    (job_dir / "lock").write_text("")  # killed between creating the lock and naming itself in it
    os.utime(job_dir / "lock", (time.time() - 3600, time.time() - 3600))
    assert Job(job_dir).status().state == "failed"
    reused = ProcessRef.of(os.getpid())
    reused.start += 1  # a live pid, but another process than the one that took the lock
    code = f"import pathlib; pathlib.Path({str(job_dir / 'result.json')!r}).write_text('{{}}')"
    assert submit(job_dir, _spec(code, tmp_path)).wait(timeout_s=30).state == "complete"
    (job_dir / "lock").write_text(reused.encode())
    assert submit(job_dir, _spec(code, tmp_path), rerun=True).wait(timeout_s=30).state == "complete"


def test_a_dead_job_in_a_read_only_directory_is_reported_not_raised(tmp_path, monkeypatch):
    from ttrace_core.service import jobs
    job = _copied_job(tmp_path, {"state": "running", "supervisor": {"pid": 1, "start": 0, "boot": "elsewhere"}})

    def read_only(path, data):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(jobs, "_write_json", read_only)  # as on read-only storage (root ignores file modes)
    status = job.status()
    assert status.state == "failed" and "supervisor died" in status.message

