import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.app.server import free_port, wait_healthy
from ttrace_core.cli.main import main
from ttrace_core.service.dashboard import streamlit_command


def test_the_server_binds_this_machine_only_unless_told(tmp_path):
    command = streamlit_command(tmp_path, port=8600, host="127.0.0.1")
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert command[command.index("--server.port") + 1] == "8600"


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
