"""Which process is which: a pid told apart from a later process that reuses it, and whether it runs.

Used by the recording session (is the `ttrace record` that launched this rank still there?) and by
the service's jobs (is a job's supervisor alive, may we signal it?).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (with the boot id, a pid's identity)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(kw_only=True, slots=True)
class ProcessRef:
    """One process, told apart from a later one that reuses its pid and from any process of another
    machine or boot: a job directory copied from elsewhere never makes us signal a process of ours."""

    pid: int
    start: int | None
    boot: str

    @staticmethod
    def of(pid: int) -> ProcessRef:
        return ProcessRef(pid=pid, start=start_ticks(pid), boot=boot_id())

    def alive(self) -> bool:
        return (self.pid > 1 and self.boot == boot_id() and process_alive(self.pid)
                and self.start is not None and start_ticks(self.pid) == self.start)

    def encode(self) -> str:
        return f"{self.pid} {self.start} {self.boot}"

    @staticmethod
    def decode(text: str) -> ProcessRef | None:
        parts = text.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return ProcessRef(pid=int(parts[0]), start=int(parts[1]), boot=parts[2])


def process_alive(pid: int | None) -> bool:
    """Whether process `pid` is running (a zombie is not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True
