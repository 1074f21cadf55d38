"""Run a function on N CPU ranks with the gloo backend: spawned locally, or as-is under torchrun.

Every spawn has a timeout, a free port picked by binding port 0, and OMP_NUM_THREADS=1 unless
set: 2 ranks on 2 cores otherwise oversubscribe threads.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing
import os
from multiprocessing import reduction
from multiprocessing.connection import wait as wait_for
import signal
import socket
import sys
import threading
import time
import traceback

from ttrace_core.errors import LaunchError

STOP_GRACE_S = 10.0
"""How long ranks still running after another failed get to close their step files before SIGKILL."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ONE_RANK_PORT = "0"
"""MASTER_PORT of a process group of one rank run in the launching process: its store's server binds a port
the system picks as it listens, so no other process can take it between being found and being listened on (a
port `free_port` found is free only when it looks; other ranks would need to know it, one rank does not)."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def resolve(target: str):
    module_name, _, function_name = target.partition(":")
    return getattr(importlib.import_module(module_name), function_name)


class _Stream:
    """One of the launcher's standard streams as it is now, handed to a rank as a descriptor of its own: a rank
    forked by the server would otherwise write where the launcher's stream went when the server started."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _stream_in_rank, (reduction.DupFd(self.fd),)  # (sent along with the rank, as its pipe is)


def _stream_in_rank(duplicate) -> _Stream:
    return _Stream(duplicate.detach())


def _child(rank: int, world_size: int, port: int, target: str, config: dict, env: dict[str, str],
           launcher: tuple[dict[str, str], list[tuple[int, _Stream]]]) -> None:
    environment, streams = launcher
    for fd, stream in streams:  # the launcher's environment and streams as they are now, as a spawned rank has them
        os.dup2(stream.fd, fd)
        os.close(stream.fd)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # On a timeout the launcher sends SIGUSR1 first: every rank prints where it is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # After another rank failed the launcher sends SIGTERM: unwinding (not dying) lets this rank's
    # tracer write why its step stopped into the partial step file.
    signal.signal(signal.SIGTERM, _stop_after_another_rank_failed)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a forked rank would keep its launcher's
    try:
        resolve(target)(config)
    except StoppedByLauncher as stop:
        print(f"rank {rank}: {stop}", flush=True)
        raise SystemExit(1)
    except BaseException as error:
        if rank == 0 and _port_taken(error):
            print(f"rank 0: port {port} was taken by another process before the rendezvous could listen on it",
                  flush=True)
            raise SystemExit(PORT_TAKEN_EXIT)
        traceback.print_exc()
        raise SystemExit(1)


PORT_TAKEN_EXIT = 75
"""Rank 0's exit code when the rendezvous port `free_port` found was taken before rank 0 could listen on
it: another process bound it in between (the launcher then starts all ranks again on a new port)."""
LAUNCH_ATTEMPTS = 3


def _port_taken(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) is torch's rendezvous failing to listen: EADDRINUSE."""
    while error is not None:
        if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


class StoppedByLauncher(Exception):
    pass


def _stop_after_another_rank_failed(signum: int, frame: object) -> None:
    raise StoppedByLauncher("stopped by the launcher (SIGTERM) after another rank failed")


def _rank_context(target: str) -> multiprocessing.context.BaseContext:
    """How ranks start: never each rank importing torch and the model's framework again ("spawn": megatron-core
    alone takes about 3 s of CPU per rank). A launcher running one thread (the CLI, a worker's job) forks its ranks
    from itself ("fork"), after importing once what every rank would import (`_rank_imports`): a fork of a
    single-threaded process is safe, and nothing is imported twice. A launcher running threads forks them from a
    fresh single-threaded server process that imported the same modules once ("forkserver"); that server is started
    once per launching process, so a launcher that runs its ranks again (estimate's samples, localize's replays)
    forks them from it without importing anything. A module that fails to import fails in the rank, with its
    traceback, as under spawn."""
    imports = _rank_imports(target)
    if _one_thread():
        for name in imports:
            try:
                importlib.import_module(name)
            except Exception:  # the rank imports it again and fails with its traceback
                pass
        if _one_thread():  # no import started a thread
            return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    if not set(imports) <= _SERVER_PRELOAD:
        _SERVER_PRELOAD.update(imports)
        context.set_forkserver_preload(sorted(_SERVER_PRELOAD))
    return context


RANK_IMPORTS = "RANK_IMPORTS"
"""The name of a target module's tuple of the modules every rank imports while it runs (megatron-core for the
megatron example: `megatron_cpu.enable()` imports it in the rank), imported once before the ranks start."""


def _rank_imports(target: str) -> list[str]:
    """torch and the target's module when this process imported them (their import is known to work), torch's
    compiler front end with torch (every optimizer's constructor imports it: about 1 s of CPU per rank), and the
    target module's own RANK_IMPORTS."""
    module_name = target.partition(":")[0]
    imports = ["ttrace_core.record.launch", *(name for name in ("torch", module_name) if name in sys.modules)]
    if "torch" in sys.modules:
        imports.append("torch._dynamo")
    declared = getattr(sys.modules.get(module_name), RANK_IMPORTS, ())
    return imports + [name for name in declared if isinstance(name, str)]


def _one_thread() -> bool:
    """Whether this process runs one OS thread (Python's or one a native library started), not counting threads
    whose library makes a fork safe (FORK_SAFE_THREADS)."""
    try:
        tasks = os.listdir("/proc/self/task")
        others = [task for task in tasks if task != str(threading.get_native_id())]
        return all(_thread_name(task) in FORK_SAFE_THREADS for task in others)
    except OSError:
        return False


FORK_SAFE_THREADS = {"jemalloc_bg_thd"}
"""Threads a fork may leave behind: jemalloc's background purging thread (pyarrow's allocator, started when
pandas reads parquet) is stopped by jemalloc's own fork handlers and restarted in the child when it needs one."""


def _thread_name(task: str) -> str:
    with open(f"/proc/self/task/{task}/comm") as comm:
        return comm.read().strip()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


_SERVER_PRELOAD: set[str] = set()
"""What the fork server of this process preloads (taken when it starts; a server already running keeps its own)."""


def run_ranks(target: str, config: dict, world_size: int, *, timeout_s: float = 600.0,
              env: dict[str, str] | None = None) -> None:
    """Call `target(config)` ("module:function") on `world_size` ranks; raise LaunchError if one fails.
    `env` is added to the ranks' environment only (spawned ranks; under torchrun, set it yourself)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise LaunchError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but the layout needs {world_size}; "
                              f"pass --nproc-per-node {world_size}")
        resolve(target)(config)
        return
    context = _rank_context(target)
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        port = free_port()
        # a forked rank has the launcher's streams already; the server's ranks are handed them
        streams = [] if context.get_start_method() == "fork" else [(fd, _Stream(fd)) for fd in (1, 2) if _is_open(fd)]
        launcher = (dict(os.environ), streams)
        processes = [context.Process(target=_child, args=(rank, world_size, port, target, config, env or {}, launcher),
                                     daemon=False) for rank in range(world_size)]
        for process in processes:
            process.start()
        try:
            _wait_all(processes, timeout_s)
            return
        except LaunchError:
            # free_port releases the port it found: another process can bind it before rank 0 listens.
            if processes[0].exitcode != PORT_TAKEN_EXIT or attempt == LAUNCH_ATTEMPTS:
                raise
            print(f"ttrace: rendezvous port {port} was taken by another process; starting the {world_size} ranks "
                  f"again on a new port (attempt {attempt + 1} of {LAUNCH_ATTEMPTS})", flush=True)


def _dump_stacks(processes: list) -> None:
    for rank, process in enumerate(processes):
        if process.is_alive():
            print(f"--- rank {rank} (pid {process.pid}) is stuck here:", flush=True)
            os.kill(process.pid, signal.SIGUSR1)
            time.sleep(0.5)


def _wait_all(processes: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    first_failures: dict[int, int] = {}
    while (running := [p for p in processes if p.is_alive()]) and time.monotonic() < deadline:
        if first_failures := {rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode not in (None, 0)}:
            break
        # woken by the first rank to exit, so that the one that failed first is told from those that failed because of it
        wait_for([p.sentinel for p in running], timeout=min(1.0, max(0.0, deadline - time.monotonic())))
    timed_out = not first_failures and any(p.is_alive() for p in processes)
    first_failures = first_failures or {rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode not in (None, 0)}
    if timed_out:
        _dump_stacks(processes)
    else:
        _stop_survivors(processes)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    if timed_out:
        raise LaunchError(f"ranks timed out after {timeout_s:.0f} s and were killed; raise --timeout or look for a hang")
    if first_failures:
        raise LaunchError(f"{_describe_failures(first_failures)}; the other ranks were stopped (tracebacks above)",
                          killed_by_signal=any(code < 0 for code in first_failures.values()))
    if failures := {rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode != 0}:
        raise LaunchError(f"{_describe_failures(failures)} (tracebacks above)")


def _stop_survivors(processes: list) -> None:
    """SIGTERM to the ranks still running, then up to STOP_GRACE_S for them to close their step files."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _describe_failures(exit_codes: dict[int, int]) -> str:
    """`rank 1 was killed by SIGKILL, rank 0 exited with code 1`."""
    def one(rank: int, code: int) -> str:
        if code < 0:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        return f"rank {rank} exited with code {code}"
    return ", ".join(one(rank, code) for rank, code in sorted(exit_codes.items()))
