"""service/warm_worker.py and the worker's loop, ttrace_core/cli/worker.py: the dashboard's jobs forked from a
process that has imported torch and the core.

A job runs the same way warm or cold: the same table, in its own process group (timeout and cancel kill
it), with its own environment and log; when no worker answers it starts a new process as before. The
command is held at a known point by giving it a FIFO as its log: it blocks opening it until a reader
comes, so no test here waits on the clock to catch a command still running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.support.paths import REPO
from ttrace_core.record.processes import process_alive
from ttrace_core.record import warm_client
from ttrace_core.service import warm_worker
from ttrace_core.service.comparison_jobs import submit_comparison
from ttrace_core.service.comparisons import comparison_table
from ttrace_core.service.jobs import JobSpec, _start_command

SAMPLES = REPO / "sample_traces" / "fp32"
DEADLINE_S = 60.0
"""How long a test waits for the worker's socket or a process's end: a bound, not a measure."""


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S:.0f} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def worker() -> str:
    path, pid = warm_worker.start(dict(os.environ))
    _until(lambda: os.path.exists(path), "worker socket")
    yield path
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    for name in ("reference", "tp2_row_parallel_bias"):
        shutil.copytree(SAMPLES / name, tmp_path / name, ignore=shutil.ignore_patterns(".ttrace"))
    return tmp_path / "reference", tmp_path / "tp2_row_parallel_bias"


def _ttrace_spec(argv: list[str], tmp_path: Path, worker_path: str, *, timeout_s: float = 120) -> JobSpec:
    env = {**os.environ, "OMP_NUM_THREADS": "1", warm_client.WARM_ENV: worker_path}
    return JobSpec(command=[sys.executable, "-m", "ttrace_core", *argv], env=env, cwd=str(tmp_path), timeout_s=timeout_s,
                   success_codes=(0, 1))


def test_a_comparison_job_forked_by_the_worker_writes_the_table_a_new_process_writes(worker, pair, monkeypatch):
    reference, candidate = pair
    monkeypatch.setenv(warm_client.WARM_ENV, worker)
    warm = submit_comparison(reference, candidate)
    status = warm.wait(timeout_s=300)
    assert status.state == "complete" and status.warm and status.exit_code == 1, (status, warm.log_tail())
    assert "FAILED (not equivalent)" in "\n".join(warm.log_tail())  # its output went to the job's log
    warm_table = comparison_table(reference, candidate).frame

    shutil.rmtree(reference.parent / "reference" / ".ttrace", ignore_errors=True)
    shutil.rmtree(candidate / ".ttrace", ignore_errors=True)
    monkeypatch.setenv(warm_client.WARM_ENV, str(Path(worker).with_name("no-worker.sock")))  # none answers there
    cold = submit_comparison(reference, candidate)
    status = cold.wait(timeout_s=300)
    assert status.state == "complete" and not status.warm and status.exit_code == 1, (status, cold.log_tail())
    pd.testing.assert_frame_equal(comparison_table(reference, candidate).frame, warm_table)


def test_a_warm_command_is_its_own_process_group_and_its_timeout_kills_it(worker, tmp_path):
    """The supervisor's side (jobs._start_command): the command's log is a FIFO no one reads, so it blocks opening
    it, in a session of its own, until the timeout; killing its group ends it and the worker reports -9."""
    log = tmp_path / "log.txt"
    os.mkfifo(log)
    command = _start_command(_ttrace_spec(["inspect", str(SAMPLES / "reference")], tmp_path, worker), log)
    assert command.warm and os.getpgid(command.pid) == command.pid and os.getsid(command.pid) == command.pid
    with pytest.raises(subprocess.TimeoutExpired):
        command.wait(0.5)
    connection, command.connection = command.connection, None
    command.kill_group()
    assert warm_client.exit_code(connection, DEADLINE_S) == -signal.SIGKILL
    connection.close()
    _until(lambda: not process_alive(command.pid), "end of the killed command")


def test_the_worker_reports_the_exit_code_and_runs_with_the_jobs_directory_and_environment(worker, tmp_path):
    log = tmp_path / "log.txt"
    started = warm_client.run(worker, {"argv": ["inspect", str(tmp_path / "absent")], "cwd": str(tmp_path),
                                       "env": {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "")},
                                       "log": str(log)})
    assert started is not None
    pid, connection = started
    assert warm_client.exit_code(connection, DEADLINE_S) == 2  # bad input: one line, exit 2
    connection.close()
    assert log.read_text().startswith("ttrace: error: ") and str(tmp_path / "absent") in log.read_text()


@pytest.mark.parametrize("request_", [{"argv": ["dashboard", "."], "cwd": "/", "env": {}, "log": "/dev/null"},
                                      {"argv": "inspect", "cwd": "/", "env": {}, "log": "/dev/null"}, {"argv": []}],
                         ids=["dashboard", "argv-not-a-list", "incomplete"])
def test_a_request_that_is_not_a_jobs_command_starts_nothing(worker, request_):
    assert warm_client.run(worker, request_) is None


def test_only_ttraces_own_commands_with_this_python_go_to_the_worker():
    assert warm_client.warm_argv([sys.executable, "-m", "ttrace_core", "compare", "a", "b"]) == ["compare", "a", "b"]
    assert warm_client.warm_argv([sys.executable, "-c", "pass"]) is None
    assert warm_client.warm_argv(["/usr/bin/python3-other", "-m", "ttrace_core", "compare"]) is None


def test_only_ttraces_own_modules_with_this_python_are_warm_commands():
    assert warm_client.warm_command([sys.executable, "-m", "ttrace_examples", "megatron-gpt"]) == \
        ("ttrace_examples", ["megatron-gpt"])
    assert warm_client.warm_command([sys.executable, "-m", "ttrace_core", "inspect"]) == ("ttrace_core", ["inspect"])
    assert warm_client.warm_command([sys.executable, "-m", "torch.distributed.run", "train.py"]) is None
    assert warm_client.warm_command(["/usr/bin/python3-other", "-m", "ttrace_examples"]) is None
    assert warm_client.warm_argv([sys.executable, "-m", "ttrace_examples", "megatron-gpt"]) is None


def _relaunch_spec(tmp_path: Path, *argv: str):
    from ttrace_core.record.session import SessionSpec

    return SessionSpec(out=str(tmp_path / "run"), launcher_pid=os.getpid(), cwd=str(tmp_path),
                       command=[sys.executable, "-m", "ttrace_examples", *argv])


def test_a_relaunched_bundled_example_is_forked_by_the_worker_and_writes_where_a_child_would(worker, tmp_path,
                                                                                              monkeypatch):
    """record/command.run_session (estimate's samples, localize's replays): `python -m ttrace_examples ...` goes to
    the worker its environment names, its output into the caller's own file at the caller's offset (the
    descriptor itself is sent: a line written before and one after keep their places), its exit code a failure
    when it fails."""
    from ttrace_core.errors import LaunchError
    from ttrace_core.record import command as relaunch

    monkeypatch.setenv(warm_client.WARM_ENV, worker)
    asked = []
    real_run = warm_client.run
    monkeypatch.setattr(warm_client, "run", lambda *args, **kwargs: asked.append(real_run(*args, **kwargs)) or asked[-1])
    with open(tmp_path / "log.txt", "w") as log:
        log.write("before\n")
        relaunch.run_session(_relaunch_spec(tmp_path, "--help"), timeout_s=DEADLINE_S, output=log)
        log.write("after\n")
    text = (tmp_path / "log.txt").read_text()
    assert len(asked) == 1 and asked[0] is not None  # the worker took it
    assert text.startswith("before\nusage: python -m ttrace_examples") and text.endswith("after\n"), text
    with open(tmp_path / "failing.txt", "w") as log, pytest.raises(LaunchError, match="exited with code 2"):
        relaunch.run_session(_relaunch_spec(tmp_path, "no-such-workload"), timeout_s=DEADLINE_S, output=log)
    assert len(asked) == 2 and asked[1] is not None and "invalid choice" in (tmp_path / "failing.txt").read_text()


@pytest.mark.parametrize("request_", [{"module": "os", "argv": ["x"]}, {"module": "ttrace_examples", "argv": ["x"],
                                                                      "stdio": "passed"}],
                         ids=["another module", "stdio claimed, none sent"])
def test_a_request_for_another_module_or_without_its_descriptors_starts_nothing(worker, tmp_path, request_):
    assert warm_client.run(worker, {"cwd": str(tmp_path), "env": {}, "log": str(tmp_path / "log"), **request_}) is None


def test_the_worker_exits_with_the_process_that_started_it(tmp_path):
    started = subprocess.run([sys.executable, "-c", "import os; from ttrace_core.service import warm_worker; "
                              "print(*warm_worker.start(dict(os.environ)))"], capture_output=True, text=True, check=True,
                             timeout=DEADLINE_S, cwd=REPO)
    path, pid = started.stdout.split()
    _until(lambda: not process_alive(int(pid)), "end of the orphaned worker")
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


def test_a_worker_that_takes_a_request_and_stays_silent_is_not_taken_for_no_worker(tmp_path):
    """Starting the command again in a new process could run it twice: the job fails instead (jobs.supervise)."""
    import socket

    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(path)
        silent.listen(1)  # the kernel takes the connection and the request; no one ever answers
        with pytest.raises(warm_client.WorkerSilent, match="took the job and did not answer"):
            warm_client.run(path, {"argv": ["inspect", "."], "cwd": "/", "env": {}, "log": "/dev/null"}, timeout_s=0.5)
    assert warm_client.run(path, {"argv": ["inspect", "."], "cwd": "/", "env": {}, "log": "/dev/null"}) is None


@pytest.mark.parametrize("argv", [["inspect", "absent"], ["inspect", str(SAMPLES / "reference"), "--tensors"]],
                         ids=["bad-input", "listing"])
def test_a_warm_run_with_its_own_error_log_gives_what_a_new_process_gives(tmp_path, argv):
    """The tests' CLI runs (tests/support/warm_cli.py) go to a worker with standard error in a file of its own: exit
    code, output and error equal a new `python -m ttrace_core` in the same directory."""
    from tests.support import warm_cli

    env = warm_cli.cli_environment()
    warm = warm_cli.run(*argv, cwd=tmp_path, env=env, timeout=120)
    assert warm_cli.last_run_was_warm(), "the run did not go to the warm worker"
    cold = subprocess.run([sys.executable, "-m", "ttrace_core", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert (cold.stderr if argv[1] == "absent" else cold.stdout).strip()


PROBE_WORKER = """
import atexit, os, signal, sys
from ttrace_core.service.warm_worker import serve
def probe(argv):
    if argv == ["preloaded"]:
        print(*(name in sys.modules for name in ("tests.distributed.workers", "colorsys")))
        return 0
    atexit.register(lambda: print("exit functions ran", flush=True))
    print(sys.path[0], os.getcwd(), signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    print("to stderr", file=sys.stderr)
    if argv == ["interrupt"]:
        raise KeyboardInterrupt
    if argv == ["exit-with-message"]:
        raise SystemExit("a message")
    return 0
serve(sys.argv[1], int(sys.argv[2]), probe)
"""
"""A worker whose command is a probe of how it starts and ends (serve takes the command's main)."""


@pytest.fixture(scope="module")
def probe_worker(tmp_path_factory) -> str:
    started_in = tmp_path_factory.mktemp("start")
    (started_in / "probe_worker.py").write_text(PROBE_WORKER)
    path = str(started_in / "w.sock")
    server = subprocess.Popen([sys.executable, "-m", "probe_worker", path, str(os.getpid())], cwd=started_in,
                              env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                   warm_worker.PRELOAD_ENV: "no_such_module_for_ttrace,tests.distributed.workers"})
    _until(lambda: os.path.exists(path), "worker socket")
    yield path
    server.kill()
    server.wait()


def test_the_worker_preloads_the_modules_it_is_told_with_their_rank_imports(probe_worker, tmp_path):
    """TTRACE_WARM_PRELOAD: each module with its RANK_IMPORTS (tests.distributed.workers declares colorsys),
    imported before the worker serves; a module that cannot be imported is passed over."""
    log = tmp_path / "out.txt"
    started = warm_client.run(probe_worker, {"argv": ["preloaded"], "cwd": str(tmp_path), "log": str(log),
                                             "env": {"OMP_NUM_THREADS": "1"}})
    assert started is not None
    _, connection = started
    assert warm_client.exit_code(connection, DEADLINE_S) == 0
    connection.close()
    assert log.read_text() == "True True\n"


@pytest.mark.parametrize("argv, code, error", [(["probe"], 0, "to stderr\n"),
                                               (["interrupt"], -signal.SIGINT, "KeyboardInterrupt\n"),
                                               (["exit-with-message"], 1, "to stderr\na message\n")],
                         ids=["ends", "ctrl-c", "exit-message"])
def test_a_warm_command_starts_and_ends_as_python_m_would(probe_worker, tmp_path, argv, code, error):
    """In its own directory, which is first on sys.path; Ctrl-C a KeyboardInterrupt, which ends it by SIGINT;
    SystemExit's message on standard error; its exit functions run at its end."""
    log, errors = tmp_path / "out.txt", tmp_path / "err.txt"
    started = warm_client.run(probe_worker, {"argv": argv, "cwd": str(tmp_path), "log": str(log),
                                             "error_log": str(errors), "env": {"OMP_NUM_THREADS": "1"}})
    assert started is not None
    _, connection = started
    assert warm_client.exit_code(connection, DEADLINE_S) == code
    connection.close()
    assert log.read_text().splitlines() == [f"{tmp_path} {tmp_path} True", "exit functions ran"]
    assert errors.read_text().endswith(error) and errors.read_text().startswith("to stderr\n")
