"""Starting and waiting for a dashboard server in tests."""

import subprocess
import time
import urllib.request

from ttrace_core.record.launch import free_port  # noqa: F401  (the tests' one way to a free port)


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the dashboard exited with {server.returncode}: {server.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read() == b"ok":
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the dashboard was not healthy after {timeout_s} s")
