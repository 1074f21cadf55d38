"""Only regular files are opened: a FIFO where a file belongs blocks its reader until someone writes
to it, a device reads without end, a socket or a directory cannot be read as a file.

Part of stage 0 (the trace format); standard library only, so the job supervisor (service/jobs.py,
which imports no torch or h5py) reads its files through here too. `containment.contained` checks
the kind of every trace file with `os.stat` before it is opened; `regular_file_bytes` reads a small
file (JSON) without ever blocking, checking the kind of what it opened before reading a byte.
"""

from __future__ import annotations

import errno
import os
import stat

NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str | None:
    """What a file that is not a regular file is ("a FIFO (named pipe)"); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in NOT_REGULAR if is_kind(mode)), "a special file")


def regular_file_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of `path`; an OSError naming it unless it is a regular file. Opened with O_NONBLOCK
    (a FIFO opens at once instead of waiting for a writer) and refused before a byte is read."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if (kind := kind_of(os.fstat(descriptor).st_mode)) is not None:
            raise OSError(errno.EINVAL, f"{kind}, not a regular file", os.fspath(path))
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(descriptor)
