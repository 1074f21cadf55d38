"""A check of a step file's global heap before HDF5 reads a string from it, which it could loop on forever.

Part of stage 0, the trace format (step_file.py's wall opens every step file through it). Each dataset's `meta`
and the file's `blind_spots` are variable-length strings, which HDF5 keeps in global heap collections
("GCOL"). To read one, HDF5 walks its collection object by object (H5HG__cache_heap_deserialize), and
an object whose size reads 0 (a zeroed range of the file) never moves that walk on: the reader hangs
inside HDF5's C code, where no Python signal handler or timeout reaches it. `refuse_looping_heaps`
walks every collection of the file the same way first, in Python, and refuses the file with one line.

Collections are found by their signature in the bytes that hold no dataset's values (HDF5 says where
each dataset's storage lies): the metadata of a step file, a few percent of it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import h5py

from ttrace_core.errors import TraceFormatError

SIGNATURE = b"GCOL"
COLLECTION_HEADER_BYTES = 16
"""Signature, version 1, three reserved bytes, the collection's size (8 bytes, the header included)."""
OBJECT_HEADER_BYTES = 16
"""Object index (2 bytes, 0 for the free space), reference count (2), reserved (4), size (8)."""

Span = tuple[int, int]


_HEALTHY: set[tuple[str, int, int, int]] = set()
"""Files already walked, by (path, inode, size, mtime): a reader opens a step file once per tensor view."""


def refuse_looping_heaps(handle: h5py.File, path: Path, remedy: str) -> None:
    """Refuses `path` when one of its global heap collections would make HDF5 loop or read past the file."""
    info = os.stat(path)
    version = (str(path), info.st_ino, info.st_size, info.st_mtime_ns)
    if version in _HEALTHY:
        return
    if (why := _heap_damage(path, _value_spans(handle))) is not None:
        raise TraceFormatError(f"{path}: {why}; HDF5 would never finish reading it, so the file is refused: {remedy}")
    _HEALTHY.add(version)


def _heap_damage(path: Path, value_spans: tuple[Span, ...]) -> str | None:
    """What is wrong with the file's global heap, or None."""
    if os.path.getsize(path) == 0:
        return None
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for start, end in _gaps(value_spans, len(data)):
            offset = data.find(SIGNATURE, start, end)
            while offset != -1:
                if (why := _collection_damage(data, offset)) is not None:
                    return why
                offset = data.find(SIGNATURE, offset + 1, end)
    return None


def _value_spans(handle: h5py.File) -> tuple[Span, ...]:
    """(start, end) of every contiguous dataset's values, from the datasets' headers."""
    spans: list[Span] = []
    failed: list[Exception] = []  # raising inside an HDF5 callback corrupts h5py's lock: stop, then raise

    def visit(name: bytes, info) -> bool | None:
        if info.type != h5py.h5o.TYPE_DATASET:
            return None
        try:
            dataset = h5py.h5d.open(handle.id, name)
            if (offset := dataset.get_offset()) is not None:
                spans.append((offset, offset + dataset.get_storage_size()))
        except Exception as error:  # noqa: BLE001 - re-raised below, outside the callback
            failed.append(error)
            return True
        return None

    h5py.h5o.visit(handle.id, visit, info=True)
    if failed:
        raise failed[0]
    return tuple(sorted(spans))


def _gaps(spans: tuple[Span, ...], size: int) -> list[Span]:
    gaps, position = [], 0
    for start, end in spans:
        if start > position:
            gaps.append((position, min(start, size)))
        position = max(position, end)
    return gaps + ([(position, size)] if position < size else [])


def _collection_damage(data: mmap.mmap, offset: int) -> str | None:
    """Walks the collection at `offset` as HDF5 does; None when it ends, or when the bytes are no
    collection header (HDF5's own signature check answers for those)."""
    if data[offset + 4:offset + 8] != b"\x01\x00\x00\x00":
        return None
    size = int.from_bytes(data[offset + 8:offset + COLLECTION_HEADER_BYTES], "little")
    end = offset + size
    if size < COLLECTION_HEADER_BYTES or end > len(data):
        return f"the global heap collection at byte {offset} claims {size} bytes, past the end of the file"
    position = offset + COLLECTION_HEADER_BYTES
    while position + OBJECT_HEADER_BYTES <= end:
        index = int.from_bytes(data[position:position + 2], "little")
        object_size = int.from_bytes(data[position + 8:position + OBJECT_HEADER_BYTES], "little")
        step = object_size if index == 0 else OBJECT_HEADER_BYTES + (object_size + 7) // 8 * 8
        if step == 0:
            return f"the global heap collection at byte {offset} holds an object of size 0 at byte {position}"
        position += step
    return None
