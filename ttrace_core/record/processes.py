"""Which process is which: a pid told apart from a later process that reuses it, and whether it runs.

Used by the recording session (is the `ttrace record` that launched this rank still there?) and by
the service's jobs (is a job's supervisor alive, may we signal it?). psutil answers on every platform
it supports (Linux, macOS, Windows), so a running job is never taken for a dead one off Linux.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


def boot_id() -> str:
    """This machine's boot, as the boot time in whole seconds: a process of another boot is not ours."""
    return str(int(psutil.boot_time()))


def start_time_ms(pid: int) -> int | None:
    """When process `pid` started, in milliseconds since the epoch (with the boot, a pid's identity)."""
    try:
        return round(psutil.Process(pid).create_time() * 1000)
    except (psutil.Error, OSError, ValueError):
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
        return ProcessRef(pid=pid, start=start_time_ms(pid), boot=boot_id())

    def alive(self) -> bool:
        return (self.pid > 1 and self.boot == boot_id() and process_alive(self.pid)
                and self.start is not None and start_time_ms(self.pid) == self.start)

    def encode(self) -> str:
        return f"{self.pid} {self.start} {self.boot}"

    @staticmethod
    def decode(text: str) -> ProcessRef | None:
        parts = text.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return ProcessRef(pid=int(parts[0]), start=int(parts[1]), boot=parts[2])


def process_alive(pid: int | None) -> bool:
    """Whether process `pid` is running (a zombie, exited but not yet reaped by its parent, is not)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
