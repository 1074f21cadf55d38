"""How much memory this machine gives ttrace: the bound no tensor's assembly (stage 2) may exceed.

The smaller of the physical memory and the cgroup's limit (a container's `memory.max`), read once.
A tensor whose metadata claims more is refused with one line before anything is allocated, instead
of dying in the allocator (MemoryError, or the kernel's OOM killer).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""cgroup v2, then v1; "max" (v2) or a huge number (v1) means no limit."""


@functools.cache
def machine_memory_bytes() -> int:
    limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits)
