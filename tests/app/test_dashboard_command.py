import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.app.server import free_port, wait_healthy
from ttrace_core.cli.main import main
from ttrace_core.service.dashboard import streamlit_command


def test_the_server_binds_this_machine_only_unless_told(tmp_path):
    command = streamlit_command(tmp_path, port=8600, host="127.0.0.1")
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert command[command.index("--server.port") + 1] == "8600"


def test_the_accent_colour_is_not_the_failure_red():
    # Streamlit's default red accent made every chosen layout chip on the matrix look like a failure (issue 41).
    command = streamlit_command(Path("main.py"), port=8600, host="127.0.0.1")
    for option in ("--theme.light.primaryColor", "--theme.dark.primaryColor"):  # never --theme.primaryColor, which
        red, green, blue = (int(command[command.index(option) + 1][i:i + 2], 16) for i in (1, 3, 5))  # ends dark mode
        assert blue > red
    assert "--theme.primaryColor" not in command and "--theme.base" not in command


def test_a_missing_root_is_one_line(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: not a directory" in capsys.readouterr().err


def test_stopping_the_command_stops_the_server(tmp_path):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "ttrace_core", "dashboard", str(tmp_path), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
    finally:
        server.terminate()
        server.wait(timeout=30)
    time.sleep(0.5)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/_stcore/health", timeout=2)


def test_a_busy_port_is_never_announced(tmp_path, capsys, monkeypatch):
    """Issue 41: a second `ttrace dashboard` printed the URL of the port the first one held, then died on it."""
    import socket

    from ttrace_core.service import dashboard

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        assert main(["dashboard", str(tmp_path), "--port", str(busy)]) == 2  # asked for it: one line, exit 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert f"port {busy} on 127.0.0.1 is in use" in captured.err
        monkeypatch.setattr(dashboard, "DEFAULT_PORT", busy)  # not asked for: the next free one
        chosen = dashboard.serving_port("127.0.0.1", None)
        assert chosen != busy and dashboard.port_is_free("127.0.0.1", chosen)
