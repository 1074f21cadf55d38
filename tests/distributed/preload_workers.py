"""A launch target whose ranks import a module after they start, and declare it (record/launch.py RANK_IMPORTS)."""

import os
import sys
from pathlib import Path

RANK_IMPORTS = ("tests.distributed.preload_probe", "tests.distributed.no_such_module")


def report(config: dict) -> None:
    """Each rank writes: whether the probe was imported before this rank ran, by whom, and the rank's pids."""
    already = "tests.distributed.preload_probe" in sys.modules
    from tests.distributed import preload_probe

    rank = os.environ["RANK"]
    Path(config["out"], f"rank{rank}").write_text(f"{already} {preload_probe.IMPORTED_BY} {os.getpid()} {os.getppid()}")
