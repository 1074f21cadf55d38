"""Launch a recorded run: `ttrace record -- COMMAND` and the relaunches of `ttrace estimate` / `ttrace localize`.

Input: a command (typically `torchrun --standalone --nproc-per-node N train.py ...`) whose script
calls `ttrace_core.attach`, or a run directory whose manifest names how it was launched. Output:
the run directory the command's ranks record into (stage 1). The command gets its session through
one variable, TTRACE_SESSION, naming a spec file that lives only as long as this launcher; the
caller's own environment is never changed.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from ttrace_core.errors import LaunchError, TtraceError
from ttrace_core.format.schema import RunManifest
from ttrace_core.record import warm_client
from ttrace_core.record.session import SESSION_ENV, SessionSpec


RANK_KILLED_EXIT = 128 + signal.SIGKILL
"""The exit code of a command one of whose ranks was killed from outside (the shell's 128 + SIGKILL)."""


@contextmanager
def session_environment(spec: SessionSpec) -> Iterator[dict[str, str]]:
    """The environment of a command run in `spec`'s session: this process's plus TTRACE_SESSION, naming
    a spec file that is deleted when the block ends."""
    with tempfile.TemporaryDirectory(prefix="ttrace-session-") as folder:
        path = Path(folder) / "session.json"
        spec.write(path)
        env = {**os.environ, SESSION_ENV: str(path)}
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on few cores otherwise oversubscribe threads
        yield env


def run_session(spec: SessionSpec, *, timeout_s: float, output: IO | None = None) -> None:
    """Run spec.command in spec.cwd with the session switched on for it; raise LaunchError if it fails.
    `output`: a file that gets the command's stdout and stderr (default: this process's). The command is one of
    ttrace's own (`python -m ttrace_examples ...`, a bundled example's) and this process's environment names a warm
    worker (the dashboard's jobs, the test suite): the worker forks it (record/warm_client.py), in its own session
    as a new process would be, writing where this process's child would."""
    with session_environment(spec) as env:
        command = _warm_session(spec, env, output) or _cold_session(spec, env, output)
        try:
            code = command.wait(timeout_s)
        except subprocess.TimeoutExpired:
            command.kill_group()
            raise LaunchError(f"{shlex.join(spec.command)} ran longer than {timeout_s:.0f} s and was killed; "
                              "raise --timeout or look for a hang") from None
        except BaseException:
            command.kill_group()  # Ctrl-C: never leave the ranks running
            raise
    if code != 0:
        shown = "its output is above" if output is None else f"its output is in {getattr(output, 'name', 'the log')}"
        # Killed by a signal: the command itself (a negative code), or one of its processes, said the shell's way
        # (128 + the signal; the bundled examples' RANK_KILLED_EXIT): a fault from outside, not the run's code.
        raise LaunchError(f"{shlex.join(spec.command)} exited with code {code} ({shown})",
                          killed_by_signal=code < 0 or code > 128)


def _cold_session(spec: SessionSpec, env: dict[str, str], output: IO | None) -> warm_client.RunningCommand:
    """The command as a new process, in a session of its own."""
    try:
        process = subprocess.Popen(spec.command, cwd=spec.cwd or None, env=env, start_new_session=True, stdout=output,
                                   stderr=None if output is None else subprocess.STDOUT)
    except OSError as error:
        raise TtraceError(f"cannot start {shlex.join(spec.command)!r} in {spec.cwd or os.getcwd()} ({error}); "
                          "check the command and the directory it was recorded in") from error
    return warm_client.RunningCommand(pid=process.pid, warm=False, process=process)


def _warm_session(spec: SessionSpec, env: dict[str, str], output: IO | None) -> warm_client.RunningCommand | None:
    """The command forked by the worker `env` names, when it is one the worker runs and it takes it; else None."""
    worker, found = env.get(warm_client.WARM_ENV), warm_client.warm_command(spec.command)
    if not worker or found is None:  # (TTRACE_WARM_WORKER=off names no socket: `run` finds no worker there)
        return None
    module, argv = found
    stdio = (1, 2) if output is None else (output.fileno(), output.fileno())
    if output is not None:
        output.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        started = warm_client.run(worker, {"module": module, "argv": argv, "cwd": spec.cwd or os.getcwd(), "env": env,
                                           "log": ""}, stdio=stdio)
    except warm_client.WorkerSilent:
        raise LaunchError(f"{shlex.join(spec.command)}: the warm worker took it and did not answer") from None
    return None if started is None else warm_client.RunningCommand.forked(started)


def record(out: str | os.PathLike, command: list[str], *, seed: int = 0, stats_only: bool = False,
           role: str | None = None, timeout_s: float = 3600.0, cwd: str | os.PathLike | None = None,
           output: IO | None = None) -> Path:
    """`ttrace record --out OUT -- COMMAND`: run the command with tracing on (in `cwd`, default this process's;
    its output to `output`, default this process's); returns the run directory."""
    from ttrace_core.format.writer import refuse_existing_trace

    if not command:
        raise TtraceError("ttrace record: no command; write it after --, e.g. "
                          "ttrace record --out runs/ref -- torchrun --standalone --nproc-per-node 1 train.py")
    out = Path(out).resolve()
    refuse_existing_trace(out)
    spec = SessionSpec(out=str(out), launcher_pid=os.getpid(), command=list(command), cwd=str(cwd or os.getcwd()),
                       seed=seed, role=role, stats_only=stats_only)
    run_session(spec, timeout_s=timeout_s, output=output)
    if not (out / "manifest.json").is_file():
        raise TtraceError(f"{shlex.join(command)} finished but recorded nothing into {out}: its script must call "
                          "ttrace_core.attach(model, optimizer) and run its steps inside `with session.step(i):`")
    return out


def relaunch(run_dir: Path, manifest: RunManifest, out: Path, *, perturbation: dict | None = None,
             rewrite: dict | None = None, precision: str | None = None, value_steps: list[int] | None = None,
             timeout_s: float) -> None:
    """Run a recorded run again into `out`, its weights perturbed (estimate), its modules' inputs
    rewritten (localize) or its values recorded for `value_steps` only (adaptive capture), in a session
    of the given mode: the recorded command, or for a run recorded by an older ttrace, the example
    factory its manifest names."""
    entrypoint = manifest.entrypoint
    command, factory = [current_name(part) for part in entrypoint.get("command") or []], entrypoint.get("factory")
    if not command and not (factory and entrypoint.get("config") is not None):
        raise TtraceError(f"{run_dir}/manifest.json: no entrypoint recorded, so the run cannot be relaunched; "
                          "record it with `ttrace record -- COMMAND` (or `ttrace example`)")
    mode = "perturb" if perturbation is not None else "rewrite" if rewrite else "record"
    spec = SessionSpec(out=str(out), mode=mode, launcher_pid=os.getpid(), command=list(command or []),
                       cwd=entrypoint.get("cwd", ""), seed=int(entrypoint.get("seed", manifest.seed)),
                       role=manifest.role, perturbation=perturbation, rewrite=rewrite, precision=precision,
                       value_steps=value_steps)
    if command:
        if spec.cwd and not Path(spec.cwd).is_dir():
            raise TtraceError(f"{run_dir}/manifest.json: the command ran in {spec.cwd}, which does not exist here; "
                              "relaunch where the run was recorded")
        run_session(spec, timeout_s=timeout_s)
        return
    from ttrace_core.record.launch import resolve, run_ranks

    factory = current_name(factory)
    try:
        resolve(factory)
    except (ImportError, AttributeError, ValueError) as error:
        raise TtraceError(f"{run_dir}/manifest.json: entrypoint {factory!r} cannot be imported here ({error}); "
                          "install the package that defines it, or run from the directory it was recorded in") from error
    with session_environment(spec) as env:
        run_ranks(factory, {**entrypoint["config"], **({"precision": precision} if precision else {})},
                  manifest.world_size, timeout_s=timeout_s,
                  env={SESSION_ENV: env[SESSION_ENV]})


MOVED_MODULES = {"ttrace_core.examples": "ttrace_examples"}
"""Packages renamed since a trace was recorded: old manifests name the old module in their entrypoint."""


def current_name(name: str) -> str:
    """An entrypoint's module ("ttrace_core.examples.megatron_gpt.train:run" recorded before the examples
    left the core package) under its current name; anything else unchanged."""
    for old, new in MOVED_MODULES.items():
        if name == old or name.startswith((old + ".", old + ":")):
            return new + name[len(old):]
    return name
