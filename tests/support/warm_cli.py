"""`python -m ttrace_core ARGS` for the tests, forked from a warm worker instead of a new Python.

Every CLI run of the suite used to start a new interpreter and import torch, h5py, pandas and the core again:
about 3 s of CPU a run, several hundred runs. The tests now ask the dashboard's own warm worker
(service/warm_worker.py: fork from a process that has imported them, the command in its own session, its
own directory and environment) to run the command, and read its standard output and error from files of
their own. It is the path every dashboard job takes, so the suite exercises it; tests/core/service/
test_warm_worker.py checks it gives what a new process gives.

A run goes to a new process as before when the interpreter itself would start differently (a `PYTHON*`
variable other than the worker's), when `TTRACE_TESTS_COLD=1` asks for it, outside pytest (the benchmarks
that share these helpers time new processes), or when no worker answers.
Tests of what only a new process shows (its start, signals from a shell) call subprocess themselves.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.paths import REPO
from ttrace_core.record import warm_client
from ttrace_core.service import warm_worker

COLD_ENV = "TTRACE_TESTS_COLD"
START_DEADLINE_S = 120.0
"""How long the first run waits for the worker's socket (it imports torch first): a bound, not a measure."""

WARM_PRELOAD = "torch._dynamo,ttrace_examples.megatron_gpt.train"
"""What the worker imports besides the core: the megatron example with megatron-core (its RANK_IMPORTS), which
the suite's many `ttrace example megatron-gpt` runs would each import (about 4 s of CPU a run)."""
_worker: dict[str, object] = {}
"""This test process's worker: its socket path and the environment it started with (started on first use)."""


def cli_environment() -> dict[str, str]:
    """The environment of a test's CLI run: this repository importable, one thread per process."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        dict.fromkeys(filter(None, [str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))}


def _interpreter_settings(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith("PYTHON")}


def _socket() -> str | None:
    """The worker's socket, started for this process on first use; None when runs go to new processes."""
    if os.environ.get(COLD_ENV) == "1" or "PYTEST_CURRENT_TEST" not in os.environ:  # benchmarks time new processes
        return None
    if _worker.get("pid") != os.getpid():  # none yet, or one a parent of this forked process started
        env = cli_environment()
        path, _ = warm_worker.start({**env, warm_worker.PRELOAD_ENV: WARM_PRELOAD})
        _worker.update(pid=os.getpid(), path=path, settings=_interpreter_settings(env), ready=False)
    if not _worker["ready"]:
        deadline = time.monotonic() + START_DEADLINE_S
        while not os.path.exists(_worker["path"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tests' warm worker made no socket at {_worker['path']} in "
                                   f"{START_DEADLINE_S:.0f} s")
            time.sleep(0.05)
        _worker["ready"] = True
    return _worker["path"]


def run(*args: str, cwd: str | os.PathLike, env: dict[str, str] | None = None,
        timeout: float) -> subprocess.CompletedProcess:
    """`python -m ttrace_core ARGS` in `cwd` with `env` (default: cli_environment()), output captured as text,
    as subprocess.run(..., capture_output=True, text=True, timeout=timeout) gives it; TimeoutExpired after
    killing its process group when it takes longer."""
    env = cli_environment() if env is None else env
    command = [sys.executable, "-m", "ttrace_core", *args]
    path = _socket()
    _worker["last_warm"] = False
    if path is None or _interpreter_settings(env) != _worker["settings"]:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="ttrace-cli-") as directory:
        out, err = Path(directory) / "stdout", Path(directory) / "stderr"
        # the command's own relaunches of a bundled example (estimate, localize) are forked by the worker too
        started = warm_client.run(path, {"argv": list(args), "cwd": str(cwd), "env": {**env, warm_client.WARM_ENV: path},
                                         "log": str(out), "error_log": str(err)})
        if started is None:
            return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        pid, connection = started
        _worker["last_warm"] = True
        try:
            code = warm_client.exit_code(connection, timeout)
        except socket.timeout:
            os.killpg(pid, signal.SIGKILL)
            warm_client.exit_code(connection, 30.0)  # its end, reaped by the worker
            raise subprocess.TimeoutExpired(command, timeout, output=_text(out), stderr=_text(err)) from None
        finally:
            connection.close()
        if code is None:
            raise RuntimeError(f"the tests' warm worker went away while running ttrace {' '.join(args)}")
        return subprocess.CompletedProcess(command, code, _text(out), _text(err))


def last_run_was_warm() -> bool:
    """Whether this process's last run was forked by its worker (not a new process)."""
    return _worker.get("last_warm") is True and _worker.get("pid") == os.getpid()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
