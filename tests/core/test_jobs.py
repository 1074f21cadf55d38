import os
import signal
import sys
import time

import pytest

from ttrace_core.jobs import JobSpec, process_alive, submit


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
    job = submit(tmp_path / "job", _spec("import time; time.sleep(60)", tmp_path, timeout_s=1))
    status = job.wait(timeout_s=30)
    assert status.state == "timed_out" and status.seconds < 20


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


def test_two_jobs_run_side_by_side_and_one_directory_is_one_job(tmp_path):
    code = ("import time, os; start = time.time(); time.sleep(1.5); "
            "open('runs-' + os.environ['NAME'], 'a').write(f'{start} {time.time()}\\n')")
    first = submit(tmp_path / "a", _spec(code, tmp_path, extra_env={"NAME": "a"}))
    second = submit(tmp_path / "b", _spec(code, tmp_path, extra_env={"NAME": "b"}))
    submit(tmp_path / "a", _spec(code, tmp_path, extra_env={"NAME": "a"}))  # the same job, still running
    first.wait(timeout_s=60), second.wait(timeout_s=60)
    runs = {name: (tmp_path / f"runs-{name}").read_text().splitlines() for name in "ab"}
    assert len(runs["a"]) == 1 and len(runs["b"]) == 1  # asking twice for job a ran it once
    (a_start, a_end), (b_start, b_end) = ([float(x) for x in runs[name][0].split()] for name in "ab")
    assert a_start < b_end and b_start < a_end  # their runs overlap: side by side, not one after the other


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
