"""The dashboard's warm worker process: service/warm_worker.serve with this CLI's main as the command to fork
(the protocol, when it is used and why: service/warm_worker.py, which starts this module by name).

    python -m ttrace_core.cli.worker SOCKET PARENT_PID
"""

from __future__ import annotations

import sys

from ttrace_core.api import serve_warm_worker
from ttrace_core.cli.main import main

if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        raise SystemExit("usage: python -m ttrace_core.cli.worker SOCKET PARENT_PID")
    serve_warm_worker(sys.argv[1], int(sys.argv[2]), main)
