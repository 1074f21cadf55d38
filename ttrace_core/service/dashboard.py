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
import sys
from pathlib import Path

from ttrace_core.errors import TtraceError

ROOT_ENV = "TTRACE_ROOT"
DASHBOARD_PACKAGE = "ttrace_dashboard"


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
            "--runner.magicEnabled", "false"]  # a bare string in a page must never print itself


def serve(root: str | os.PathLike, *, port: int = 8501, host: str = "127.0.0.1") -> int:
    root = Path(root).resolve()
    if not root.is_dir():
        raise TtraceError(f"{root}: not a directory; pass the folder that holds your run directories")
    entrypoint = app_entrypoint()
    if entrypoint is None:
        raise TtraceError(f"the dashboard ({DASHBOARD_PACKAGE}) is missing from this installation in {sys.prefix}; "
                          "reinstall ttrace: pip install 'ttrace[dashboard]' -c requirements.txt")
    absent = [name for name in ("streamlit", "plotly") if importlib.util.find_spec(name) is None]
    if absent:  # found before exec'ing `python -m streamlit`, which would die with a bare ModuleNotFoundError
        raise TtraceError(f"the dashboard needs {' and '.join(absent)}, not installed in {sys.prefix}; "
                          "pip install 'ttrace[dashboard]' -c requirements.txt")
    print(f"ttrace dashboard: serving the runs under {root} at http://{host}:{port}/runs", flush=True)
    command = streamlit_command(entrypoint, port=port, host=host)
    # Replace this process rather than start a child: a signal sent to `ttrace dashboard` (Ctrl-C, a
    # test's terminate()) then reaches the server itself, which never outlives its command.
    os.execve(command[0], command, {**os.environ, ROOT_ENV: str(root)})
