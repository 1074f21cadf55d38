"""The client side of the warm worker's protocol (service/warm_worker.py runs the worker): ask it to run one of
ttrace's own commands (`python -m ttrace_core ARGS`, `python -m ttrace_examples ARGS`) by fork from a process that
has already imported torch and the core, then learn its exit code on the same connection.

It lives here, below the service, because a relaunch (record/command.py: `ttrace estimate`'s samples and `ttrace
localize`'s replays of a bundled example) takes the same path as the dashboard's jobs when its environment names a
worker (WARM_ENV). A request is one JSON line: argv, cwd, env, log (and optionally module, error_log, and
"stdio": "passed" when the command's standard output and error are descriptors sent with the request).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

WARM_ENV = "TTRACE_WARM_WORKER"
"""The worker's socket path, in the dashboard server's environment and so in every job's."""
REQUEST_LIMIT = 1 << 20
"""Bytes of one request (argv, cwd and a whole environment): more is not a request of ours."""
CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 60.0
"""A worker takes milliseconds to fork and answer; one silent this long is stuck (and the job fails)."""
WARM_MODULES = ("ttrace_core", "ttrace_examples")
"""The modules whose `python -m` command the worker runs: ttrace's CLI, and the bundled examples' own command
(the one `ttrace example` records, which estimate and localize relaunch)."""


def warm_argv(command: list[str]) -> list[str] | None:
    """The ttrace arguments of a job's command the worker can run (`python -m ttrace_core ARGS` with the
    worker's own Python), None for any other command."""
    found = warm_command(command)
    return found[1] if found is not None and found[0] == "ttrace_core" else None


def warm_command(command: list[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) of `python -m MODULE ARGS` with this Python when MODULE is one of WARM_MODULES; None for
    any other command."""
    if len(command) >= 3 and command[1] == "-m" and command[2] in WARM_MODULES and \
            os.path.realpath(command[0]) == os.path.realpath(sys.executable):
        return command[2], command[3:]
    return None


class WorkerSilent(RuntimeError):
    """The worker took a request and did not say whether it started it: starting it again elsewhere could run
    the command twice."""


def run(path: str, request: dict, timeout_s: float = ANSWER_TIMEOUT_S, stdio: tuple[int, int] | None = None
        ) -> tuple[int, socket.socket] | None:
    """Ask the worker at `path` to run `request` ({"argv", "cwd", "env", "log"}); (the command's pid, the
    connection its exit code will come on), or None when no worker took it (none listens there, or it
    refused the request: nothing was started). WorkerSilent when it took it and gave no answer. `stdio`: the
    descriptors the command writes its standard output and error to, sent with the request (in place of its logs:
    the command writes where a child of this process would)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(CONNECT_TIMEOUT_S)
        connection.connect(path)
        data = json.dumps({**request, **({"stdio": "passed"} if stdio else {})}).encode() + b"\n"
        sent = socket.send_fds(connection, [data], list(stdio)) if stdio else 0
        connection.sendall(data[sent:])
    except OSError:
        connection.close()
        return None
    try:
        connection.settimeout(timeout_s)
        answer = read_line(connection)
    except (OSError, ValueError) as error:
        connection.close()
        raise WorkerSilent(f"the warm worker at {path} took the job and did not answer ({error})") from error
    try:
        pid = json.loads(answer).get("pid") if answer else None
    except (ValueError, AttributeError):
        pid = None
    if not isinstance(pid, int) or pid <= 1:  # it closed without starting anything
        connection.close()
        return None
    connection.settimeout(None)
    return pid, connection


def exit_code(connection: socket.socket, timeout_s: float | None) -> int | None:
    """The exit code the worker sends when the command ends; None when the worker went away first.
    socket.timeout (an OSError) when it takes longer than `timeout_s`."""
    connection.settimeout(timeout_s)
    try:
        answer = read_line(connection)
    except socket.timeout:  # the caller's timeout, not a worker gone
        raise
    except OSError:
        return None
    try:
        code = json.loads(answer).get("exit_code") if answer else None
    except ValueError:
        return None
    return code if isinstance(code, int) else None


def read_line(connection: socket.socket, data: bytes = b"") -> bytes:
    """One line of the protocol (a request or an answer), without its newline; `data`: its first bytes, read
    already."""
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > REQUEST_LIMIT:
            raise ValueError("more than a request's bytes")
    return data.strip()


@dataclass(slots=True)
class RunningCommand:
    """A command running in its own process group: a new process (`process`), or forked by the warm worker, its exit
    code to come on `connection`."""

    pid: int
    warm: bool
    process: subprocess.Popen | None = None
    connection: socket.socket | None = None

    @staticmethod
    def forked(started: tuple[int, socket.socket]) -> RunningCommand:
        """The command `run` started."""
        return RunningCommand(pid=started[0], warm=True, connection=started[1])

    def wait(self, timeout_s: float) -> int:
        """Its exit code (WORKER_GONE_EXIT when its worker went away first); subprocess.TimeoutExpired after
        `timeout_s`."""
        if self.process is not None:
            return self.process.wait(timeout=timeout_s)
        try:
            code = exit_code(self.connection, timeout_s)
        except OSError as error:  # socket.timeout
            raise subprocess.TimeoutExpired(str(self.pid), timeout_s) from error
        self.connection.close()  # nothing more comes on it
        return WORKER_GONE_EXIT if code is None else code

    def kill_group(self) -> None:
        """The command and everything it started (its process group), even after the command itself exited."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.process is not None:
            self.process.wait()
        if self.connection is not None:
            self.connection.close()


WORKER_GONE_EXIT = -1
"""The exit code of a command whose warm worker went away before it could tell (the dashboard stopped)."""
