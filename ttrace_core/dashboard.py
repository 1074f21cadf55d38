"""`ttrace dashboard ROOT`: serve the Streamlit app (app/main.py) on the runs under ROOT.

The app runs as `python -m streamlit run`, exec'd in place of this command, so this module never
imports streamlit. The root reaches the app through the `TTRACE_ROOT` variable, set in the
server's own environment only.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ttrace_core.errors import TtraceError

ROOT_ENV = "TTRACE_ROOT"
APP_ENTRYPOINT = Path(__file__).resolve().parents[1] / "app" / "main.py"
PAGES_DIR = APP_ENTRYPOINT.parents[1] / "pages"
"""The page scripts (app/ui.py registers them); packaged beside `app` (pyproject.toml)."""


def streamlit_command(root: Path, *, port: int, host: str) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(APP_ENTRYPOINT), "--server.address", host,
            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--client.toolbarMode", "minimal",
            "--runner.magicEnabled", "false"]  # a bare string in a page must never print itself


def serve(root: str | os.PathLike, *, port: int = 8501, host: str = "127.0.0.1") -> int:
    root = Path(root).resolve()
    if not root.is_dir():
        raise TtraceError(f"{root}: not a directory; pass the folder that holds your run directories")
    if not APP_ENTRYPOINT.is_file() or not PAGES_DIR.is_dir():
        missing = APP_ENTRYPOINT if not APP_ENTRYPOINT.is_file() else PAGES_DIR
        raise TtraceError(f"{missing}: the dashboard app is missing from this installation; reinstall ttrace "
                          "(pip install 'ttrace[dashboard]') or run it from a source checkout")
    absent = [name for name in ("streamlit", "plotly") if importlib.util.find_spec(name) is None]
    if absent:  # found before exec'ing `python -m streamlit`, which would die with a bare ModuleNotFoundError
        raise TtraceError(f"the dashboard needs {' and '.join(absent)}, not installed in {sys.prefix}; "
                          "pip install 'ttrace[dashboard]' -c requirements.txt")
    print(f"ttrace dashboard: serving the runs under {root} at http://{host}:{port}/runs", flush=True)
    command = streamlit_command(root, port=port, host=host)
    # Replace this process rather than start a child: a signal sent to `ttrace dashboard` (Ctrl-C, a
    # test's terminate()) then reaches the server itself, which never outlives its command.
    os.execve(command[0], command, {**os.environ, ROOT_ENV: str(root)})
