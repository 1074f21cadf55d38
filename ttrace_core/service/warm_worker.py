"""A warm worker beside the dashboard: ttrace's commands started by fork from a process that has already
imported torch and the core, instead of a new Python that imports them again (about 2 s a job).

`ttrace dashboard` starts one (`start`) before it becomes the Streamlit server, and names its socket in
the server's environment (WARM_ENV). Every job the server submits carries that environment
(replays.job_environment), so its supervisor (jobs.py) asks the worker to run the job's command when the
command is `python -m ttrace_core ...` with this Python (`warm_argv` in record/warm_client.py, the protocol's
client side); otherwise, or when the worker does not answer, it starts a new process as before. A job runs the same way either way: in a new session
(its own process group, which cancel and timeout kill), in the job's directory, with the job's whole
environment, its output in the job's log.

The worker (`serve`, run by cli/worker.py with the CLI's main) is one thread: it accepts a request (a JSON
line: argv, cwd, env, log, and optionally error_log: standard error to a file of its own), forks, answers
with the child's pid, and when the child exits sends its exit code on the same connection. It never runs torch
itself, so the child starts with no OpenMP pool to inherit (tests/faults/damage_runner.py met that
deadlock), and sets its own thread count from the job's OMP_NUM_THREADS. The socket lives in a directory
only this user can enter. The worker exits when the process that started it (the server) is gone.
`TTRACE_WARM_WORKER=off ttrace dashboard` starts none: every job a new process (benchmarks/job_start.py
measures both).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ttrace_core.record.warm_client import CONNECT_TIMEOUT_S, WARM_MODULES, read_line

SOCKET_NAME = "worker.sock"
WORKER_MODULE = "ttrace_core.cli.worker"
"""The worker's process: the CLI's main handed to `serve` (started by module name here)."""
POLL_S = 0.5
"""How often the idle worker checks that its server is still there."""
_START_DIRECTORY = ""
"""The worker's directory when it started: first on its sys.path, as `python -m` puts it."""


def start(env: dict[str, str]) -> tuple[str, int]:
    """Start a worker for this process (it exits when this process does); (its socket path, its pid). The
    caller puts the path in WARM_ENV of the environment it gives its jobs."""
    import subprocess

    directory = tempfile.mkdtemp(prefix="ttrace-warm-")  # mode 0700: only this user reaches the socket
    path = os.path.join(directory, SOCKET_NAME)
    worker = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, path, str(os.getpid())],
                              env={**env, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    return path, worker.pid


def preload() -> None:
    """What the dashboard's jobs import: torch, h5py, pandas and Parquet, and the stages below this one behind
    the commands they run (the CLI and the facade come with cli/worker.py; the service's own modules are
    light)."""
    import h5py  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import torch  # noqa: F401

    import ttrace_core.compare.engine  # noqa: F401
    import ttrace_core.workflows.localize  # noqa: F401

    from ttrace_core.record.launch import RANK_IMPORTS

    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        try:
            module = importlib.import_module(name)
            for rank_import in getattr(module, RANK_IMPORTS, ()):
                importlib.import_module(rank_import)
        except Exception:  # a job that needs it imports it again and fails with its traceback
            pass


PRELOAD_ENV = "TTRACE_WARM_PRELOAD"
"""More modules the worker imports before it serves, comma-separated, each with the modules its ranks import
(record/launch.py's RANK_IMPORTS): the test suite names the megatron example (tests/support/warm_cli.py), which
many of its commands would each import with megatron-core."""


def serve(path: str, parent: int, command_main: Callable[[list[str]], int]) -> None:
    """The worker's loop: accept, fork, report exits; until `parent` is gone. `command_main` runs one
    command's arguments in the forked child (the CLI's main, which cli/worker.py passes: no upward import)."""
    global _START_DIRECTORY
    _START_DIRECTORY = os.getcwd()
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    waiting: dict[int, socket.socket | None] = {}
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener], [], [], POLL_S)
            if readable:
                _accept(listener, waiting, command_main)
            _reap(waiting)
    finally:
        listener.close()
        Path(path).unlink(missing_ok=True)
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass


def _accept(listener: socket.socket, waiting: dict[int, socket.socket | None],
            command_main: Callable[[list[str]], int]) -> None:
    connection, _ = listener.accept()
    stdio: list[int] = []
    try:
        connection.settimeout(CONNECT_TIMEOUT_S)
        line, stdio = _request_line(connection)
        request = json.loads(line)
        argv, cwd, env, log = request["argv"], request["cwd"], request["env"], request["log"]
        error_log, module = request.get("error_log", log), request.get("module", "ttrace_core")
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv) and isinstance(cwd, str)
                and isinstance(env, dict) and isinstance(log, str) and isinstance(error_log, str) and argv
                and module in WARM_MODULES and not (module == "ttrace_core" and argv[0] == "dashboard")
                and len(stdio) == (2 if request.get("stdio") == "passed" else 0)):
            raise ValueError("not a request of ours")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        connection.close()
        for fd in stdio:
            os.close(fd)
        return
    try:
        ready, ready_write = os.pipe()
        pid = os.fork()
    except OSError:  # nothing started: the supervisor starts a new process instead
        connection.close()
        for fd in stdio:
            os.close(fd)
        return
    if pid == 0:  # the command; never returns
        listener.close()
        os.close(ready)
        main = command_main if module == "ttrace_core" else functools.partial(_module_main, module)
        _run_command(main, argv, cwd, {str(k): str(v) for k, v in env.items()}, stdio or (log, error_log), connection,
                     ready_write)
    os.close(ready_write)
    for fd in stdio:
        os.close(fd)
    select.select([ready], [], [], CONNECT_TIMEOUT_S)  # answered once the command leads its own session:
    os.close(ready)  # a kill of its group right after the answer must reach it
    try:
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        waiting[pid] = connection
    except OSError:  # the supervisor went away: the command still runs to its end, and is reaped
        connection.close()
        waiting[pid] = None


def _reap(waiting: dict[int, socket.socket | None]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(json.dumps({"exit_code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            connection.close()


def _request_line(connection: socket.socket) -> tuple[bytes, list[int]]:
    """A request's line and the descriptors sent with its first bytes."""
    data, fds, _, _ = socket.recv_fds(connection, 65536, 2)
    try:
        return read_line(connection, data), list(fds)
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise


def _module_main(module: str, argv: list[str]) -> int:
    """`python -m MODULE ARGV`'s run, in the forked child (a module of WARM_MODULES other than the CLI)."""
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _run_command(command_main: Callable[[list[str]], int], argv: list[str], cwd: str, env: dict[str, str],
                 logs: tuple[str, str] | list[int], connection: socket.socket, ready: int) -> None:
    """In the forked child: become the job's command, as a new process of its own would be (`python -m
    ttrace_core ARGV` in `cwd`, standard output and error to `logs`: two paths, or two descriptors sent with the
    request); `ready` is written once it leads its own session."""
    code = 3
    try:
        connection.close()
        os.setsid()  # its own process group: cancel and timeout kill the group
        os.write(ready, b"!")
        os.close(ready)
        for signum in (signal.SIGTERM, signal.SIGCHLD):  # SIGPIPE stays ignored, as Python starts
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt, as Python starts
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, log in ((1, logs[0]), (2, logs[1])):
            if isinstance(log, int):  # sent with the request (never 0, 1 or 2: the worker's own are open)
                os.dup2(log, fd)
                continue
            output = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(output, fd)
            os.close(output)
        for log in set(logs):
            if isinstance(log, int):
                os.close(log)
        os.chdir(cwd)
        if sys.path and sys.path[0] == _START_DIRECTORY:  # `python -m` puts its directory first: the job's here
            sys.path[0] = os.getcwd()
        os.environ.clear()
        os.environ.update(env)
        import torch

        torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1") or 1)))
        sys.argv = ["ttrace", *argv]
        code = command_main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)  # as Python does with SystemExit("message")
    except BaseException as error:  # noqa: BLE001 - the child must never return into the worker's loop
        import traceback

        traceback.print_exc()
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 3
    finally:
        try:
            atexit._run_exitfuncs()  # what a new process runs at its end (multiprocessing's, logging's)
            sys.stdout.flush()
            sys.stderr.flush()
            if code == -signal.SIGINT:  # Python ends by SIGINT after a KeyboardInterrupt: so does the job
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            os._exit(code if code >= 0 else 128 - code)
