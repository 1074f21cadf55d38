"""`ttrace dashboard ROOT`: serve the Streamlit app on the runs under ROOT.

The dashboard is its own package, `ttrace_dashboard` (the repository's app/ and pages/ folders,
pyproject.toml maps them). This module finds its entry point by name without importing it, and runs
it as `python -m streamlit run`, exec'd in place of this command, so the core never imports the
dashboard, streamlit or plotly. The root reaches the app through the `TTRACE_ROOT` variable, set in
the server's own environment only.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

from ttrace_core import INSTALL_DASHBOARD
from ttrace_core.errors import TtraceError
from ttrace_core.record import warm_client
from ttrace_core.service import warm_worker

ROOT_ENV = "TTRACE_ROOT"
DASHBOARD_PACKAGE = "ttrace_dashboard"
PRIMARY_COLOUR = "#3b6fb6"


def app_entrypoint() -> Path | None:
    """The dashboard's main.py, found by package name (never imported here); None when not installed."""
    spec = importlib.util.find_spec(DASHBOARD_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    main = Path(next(iter(spec.submodule_search_locations))) / "main.py"
    return main if main.is_file() else None


def streamlit_command(entrypoint: Path, *, port: int, host: str) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(entrypoint), "--server.address", host,
            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--client.toolbarMode", "minimal",
            "--runner.magicEnabled", "false",  # a bare string in a page must never print itself
            # Streamlit's default accent is red, which painted every chosen layout chip (clean ones too) and every
            # primary button as a failure; red is kept for verdicts.
            # Set for the light and the dark theme each: a plain --theme.primaryColor makes a custom theme, which no
            # longer follows the browser's dark mode.
            "--theme.light.primaryColor", PRIMARY_COLOUR, "--theme.dark.primaryColor", PRIMARY_COLOUR]


DEFAULT_PORT = 8501
PORTS_TRIED = 20
"""Without --port, the first free port from DEFAULT_PORT on, among this many."""


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on (host, port) now (SO_REUSEADDR: a closed server's lingering sockets do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def serving_port(host: str, port: int | None) -> int:
    """The port to serve on: the one asked for, which must be free, or the first free one from DEFAULT_PORT on
    (a second dashboard beside a running one). Never a port another server holds: its URL would show that server."""
    if port is not None:
        if not port_is_free(host, port):
            raise TtraceError(f"port {port} on {host} is in use (another dashboard?); pass another --port, or omit "
                              f"--port to take the first free one from {DEFAULT_PORT}")
        return port
    free = next((p for p in range(DEFAULT_PORT, DEFAULT_PORT + PORTS_TRIED) if port_is_free(host, p)), None)
    if free is None:
        raise TtraceError(f"ports {DEFAULT_PORT}-{DEFAULT_PORT + PORTS_TRIED - 1} on {host} are all in use; pass a free "
                          "one with --port")
    return free


def serve(root: str | os.PathLike, *, port: int | None = None, host: str = "127.0.0.1") -> int:
    root = Path(root).resolve()
    if not root.is_dir():
        raise TtraceError(f"{root}: not a directory; pass the folder that holds your run directories")
    entrypoint = app_entrypoint()
    if entrypoint is None:
        raise TtraceError(f"the dashboard ({DASHBOARD_PACKAGE}) is missing from this installation in {sys.prefix}; "
                          f"reinstall it: {INSTALL_DASHBOARD}")
    absent = [name for name in ("streamlit", "plotly") if importlib.util.find_spec(name) is None]
    if absent:  # found before exec'ing `python -m streamlit`, which would die with a bare ModuleNotFoundError
        raise TtraceError(f"the dashboard needs {' and '.join(absent)}, not installed in {sys.prefix}; "
                          f"{INSTALL_DASHBOARD}")
    asked = port
    port = serving_port(host, port)
    moved = f" ({DEFAULT_PORT} is in use)" if asked is None and port != DEFAULT_PORT else ""
    print(f"ttrace dashboard: serving the runs under {root} at http://{host}:{port}/runs{moved}", flush=True)
    command = streamlit_command(entrypoint, port=port, host=host)
    env = {**os.environ, ROOT_ENV: str(root)}
    if os.environ.get(warm_client.WARM_ENV) != "off":  # the server's jobs fork from it (warm_worker.py); it exits with the server
        env[warm_client.WARM_ENV], _ = warm_worker.start(env)
    # Replace this process rather than start a child: a signal sent to `ttrace dashboard` (Ctrl-C, a
    # test's terminate()) then reaches the server itself, which never outlives its command.
    os.execve(command[0], command, env)
