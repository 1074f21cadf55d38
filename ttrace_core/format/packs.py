"""Format 5: a step's tensors packed into a few large contiguous byte datasets, each tensor a span of one.

Part of stage 0, the trace format: writer.py fills the packs, and step_file.py's wall checks them once
when it opens a file (`checked_spans`); after that a tensor is read with one `pread` at an offset
checked at open (`read_span`), with no HDF5 object opened and no metadata checked per tensor. Up to
format 4 every tensor was its own dataset, and reading one cost an HDF5 open and a storage check:
more than reading the bytes of a typical activation (benchmarks/results/compare_throughput.md).

Layout. The group PACKS holds the datasets "0", "1", ...: one-dimensional uint8, contiguous,
unfiltered, each a run of tensors' raw bytes (the bits format 4 stored: bf16 as int16, fp8 as uint8),
each tensor starting at a multiple of ALIGN bytes within its pack. The tensor index row of a tensor
with values names its `pack` and its `offset` in it; its size follows from its metadata (local shape
times the stored dtype's size). A tensor recorded again with the same bytes (same_storage.py) is a
second row naming the same span, so no hard link is needed. h5py still reads any tensor:
`file["packs/3"][offset:offset + nbytes].view(dtype).reshape(local_shape)`.

Checked at open, before any value is read: every object of the file is one ttrace writes (the index,
the findings, the packs), no link leads out of it; every pack a row names is a contiguous, unfiltered,
allocated uint8 dataset whose bytes lie inside the file; every row's span lies inside its pack (so a
shape claiming 2**40 elements is refused by its size alone); two rows name the same span or none of it.
A pack's bytes that no row names are lost tensors, reported as an inventory gap.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

import h5py
import numpy as np

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.containment import link_refusal, refuse_external_storage
from ttrace_core.format.datasets import check_storage, damaged_file_errors, stored_dtype
from ttrace_core.format.tensor_index import IndexRow

PACKS = "packs"
"""Step-file group (format 5): the packs, datasets named by their number."""
PACK_BYTES = 16 * 2**20
"""Tensors smaller than OWN_PACK_BYTES are gathered in memory up to this many bytes, then written as one pack."""
OWN_PACK_BYTES = 2**20
"""A tensor of at least this many bytes is a pack of its own, written as it is recorded (gathering it
would copy it once more: an HDF5 dataset costs less than copying a megabyte)."""
ALIGN = 64
"""Each tensor starts at a multiple of this many bytes of its pack (a cache line; any dtype's size divides it)."""


def pack_path(number: int) -> str:
    return f"{PACKS}/{number}"


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


Span = tuple[int, int]
"""Where one tensor's bytes lie in its step file: (byte offset in the file, bytes); a plain tuple, as a
48-layer step makes 15,840 of them when it is opened."""


@dataclass(slots=True)
class CheckedSpans:
    """The spans of a format-5 step file's rows, checked against its packs."""

    spans: dict[str, Span]
    """Row name (`IndexRow.dataset`) -> its span in the file."""
    missing: list[str]
    """Rows whose pack the file does not hold (their tensors are lost)."""
    unnamed: list[str]
    """Packs holding bytes no row names (tensors whose rows were lost)."""
    image: int | None = None
    """A descriptor of the packs copied out (`unpacked`), which `spans` then point into; None: they point into the file."""


def refuse_foreign_objects(handle: h5py.File, where: str, own: tuple[str, ...]) -> None:
    """Every link of the file is a hard link to one of the objects a format-5 step file holds (`own`, the
    group PACKS and its numbered packs); a soft or external link, or any other object, is refused."""
    found: list[tuple[bytes, int]] = []

    def visit(name: bytes, info) -> bool | None:  # raising inside an HDF5 callback corrupts h5py's lock
        found.append((name, info.type))
        return True if info.type != h5py.h5l.TYPE_HARD else None

    handle.id.links.visit(visit, info=True)
    allowed = {name.encode() for name in (*own, PACKS)}
    for name, kind in found:
        if kind != h5py.h5l.TYPE_HARD:
            raise link_refusal(where, name, kind)
        if name not in allowed and not (name.startswith(b"packs/") and name[6:].isdigit()):
            raise TraceFormatError(f"{where}: {name.decode('utf-8', 'backslashreplace')} is not an object a format-5 step "
                                   "file holds (its tensors live in packs); the file was not written by ttrace or is "
                                   "damaged, re-record this rank")


def _pack_extent(handle: h5py.File, number: int, file_size: int, where: str, remedy: str) -> tuple[int | None, int] | None:
    """(file offset, bytes) of pack `number`, checked; None when the file has no such pack. The offset is None
    when the pack's bytes have no place of their own in the file: another tool rewrote it chunked, compressed
    through a lossless filter (datasets.LOSSLESS_FILTERS) or compact (`unpacked` copies those out)."""
    name = pack_path(number)
    where = f"{where}:{name}"
    try:
        dataset = h5py.h5o.open(handle.id, name.encode())
    except (KeyError, ValueError, TypeError):
        return None
    refuse_external_storage(dataset, where)
    if len(dataset.shape) != 1:
        raise TraceFormatError(f"{where}: stored shape {dataset.shape}, ttrace writes a pack as one row of bytes; {remedy}")
    check_storage(dataset, np.dtype("uint8"), dataset.shape, where, remedy)
    size = dataset.shape[0]
    if dataset.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS:
        return None, size
    offset = dataset.get_offset()
    if size and offset is None:
        raise TraceFormatError(f"{where}: declares {size} bytes but the file holds no storage for them; {remedy}")
    if size and offset + size > file_size:
        raise TraceFormatError(f"{where}: its {size} bytes at byte {offset} run past the end of the file ({file_size} "
                               f"bytes): the file is truncated; {remedy}")
    return offset or 0, size


UNPACK_BYTES = 64 * 2**20
"""`unpacked` copies a pack out this many bytes at a time (the memory it takes)."""


def unpacked(handle: h5py.File, sizes: dict[int, int], where: str, remedy: str) -> tuple[int, dict[int, int]]:
    """The packs' bytes (pack number -> bytes) copied into an unnamed temporary file, each at a multiple of ALIGN:
    its descriptor and where each pack starts in it. A step file whose packs another tool rewrote chunked,
    compressed or compact is then read by `pread` as one written by ttrace is; HDF5 decompresses each pack once,
    UNPACK_BYTES at a time. The copy takes the packs' bytes on the temporary directory's disk until the step
    file is closed (it has no name, so nothing is left behind)."""
    try:
        with tempfile.TemporaryFile(prefix="ttrace-unpacked-") as image:
            descriptor = os.dup(image.fileno())
    except OSError as error:
        raise _unpack_refusal(where, sum(sizes.values()), error) from error
    try:
        bases, end = {}, 0
        for number in sorted(sizes):
            bases[number] = base = aligned(end)
            with damaged_file_errors(f"{where}:{pack_path(number)}", remedy):
                dataset = h5py.Dataset(h5py.h5d.open(handle.id, pack_path(number).encode()))
            for start in range(0, sizes[number], UNPACK_BYTES):
                with damaged_file_errors(f"{where}:{pack_path(number)}", remedy):
                    block = dataset[start:min(sizes[number], start + UNPACK_BYTES)]
                try:
                    _write_all(descriptor, block, base + start)
                except OSError as error:
                    raise _unpack_refusal(where, sum(sizes.values()), error) from error
            end = base + sizes[number]
        return descriptor, bases
    except BaseException:
        os.close(descriptor)
        raise


def _write_all(descriptor: int, block: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(block)).cast("B")
    while view:
        written = os.pwrite(descriptor, view, offset)
        view, offset = view[written:], offset + written


def _unpack_refusal(where: str, total: int, error: OSError) -> TraceFormatError:
    return TraceFormatError(f"{where}: its packs are stored compressed or chunked, and copying their {total} bytes out "
                            f"into a temporary file in {tempfile.gettempdir()} failed ({error.strerror}); free that much "
                            "space there, or set TMPDIR to a directory on a disk that has it")


def checked_spans(handle: h5py.File, rows: list[IndexRow], where: str, remedy: str) -> CheckedSpans:
    """Each row's span in the file, every pack a row names checked once (`_pack_extent`), every span
    inside its pack; rows that name a span partly taken by another are refused."""
    file_size = os.fstat(handle.id.get_vfd_handle()).st_size
    extents: dict[int, tuple[int | None, int] | None] = {}
    for pack in sorted({row.pack for row in rows if row.dataset is not None and row.pack is not None}):
        with damaged_file_errors(f"{where}:{pack_path(pack)}", remedy):
            extents[pack] = _pack_extent(handle, pack, file_size, where, remedy)
    bases = {pack: extent[0] for pack, extent in extents.items() if extent is not None}
    checked = CheckedSpans(spans={}, missing=[], unnamed=[])
    if any(base is None for base in bases.values()):  # packs another tool rewrote: read from a copy of them all
        checked.image, bases = unpacked(handle, {pack: extent[1] for pack, extent in extents.items() if extent is not None},
                                        where, remedy)
    try:
        _place_spans(checked, rows, extents, bases, where, remedy)
        checked.unnamed += [f"{pack_path(number)} holds {extent[1]} bytes no index row names"
                            for number, extent in _packs_without_rows(handle, extents, file_size, where, remedy)]
    except BaseException:
        if checked.image is not None:
            os.close(checked.image)
        raise
    return checked


def _place_spans(checked: CheckedSpans, rows: list[IndexRow], extents: dict[int, tuple[int | None, int] | None],
                 bases: dict[int, int], where: str, remedy: str) -> None:
    """Each row's span (its pack's base + its offset), inside its pack; packs with bytes no row names."""
    spans, by_pack = checked.spans, {}
    for row in rows:  # as little as possible per row: a 48-layer step has 15,840
        name, pack, offset = row.dataset, row.pack, row.offset
        if name is None:
            continue
        if pack is None or offset is None:
            raise TraceFormatError(f"{where}: the index row of {name} names no pack and offset, which every "
                                   f"tensor with values has in format 5: the index is damaged; {remedy}")
        if (extent := extents[pack]) is None:
            checked.missing.append(name)
            continue
        meta = row.meta
        nbytes = math.prod(meta.local_shape) * stored_dtype(meta.dtype).itemsize
        if offset + nbytes > extent[1]:
            raise TraceFormatError(f"{where}:{name}: its index row places {nbytes} bytes (shape {meta.local_shape} of "
                                   f"{meta.dtype}) at byte {offset} of {pack_path(pack)}, which holds {extent[1]}: the "
                                   f"index or the pack is damaged; {remedy}")
        spans[name] = (bases[pack] + offset, nbytes)
        if (taken := by_pack.get(pack)) is None:
            taken = by_pack[pack] = set()
        taken.add((offset, nbytes))
    for number, taken in by_pack.items():
        if (unnamed := _unnamed_bytes(number, sorted(taken), extents[number][1], where, remedy)) is not None:
            checked.unnamed.append(unnamed)


def _unnamed_bytes(number: int, taken: list[tuple[int, int]], size: int, where: str, remedy: str) -> str | None:
    """Bytes of a pack no row names (past the alignment padding), or one line refusing overlapping rows."""
    end, lost = 0, 0
    for offset, nbytes in taken:
        if offset < end:
            raise TraceFormatError(f"{where}: two rows of its tensor index name overlapping bytes of {pack_path(number)} "
                                   f"(at {offset}, before {end}): the index is damaged; {remedy}")
        lost += offset - end if offset - end >= ALIGN else 0
        end = offset + nbytes
    lost += size - end if size - end >= ALIGN else 0
    return f"{pack_path(number)} holds {lost} bytes no index row names" if lost else None


def _packs_without_rows(handle: h5py.File, extents: dict, file_size: int, where: str,
                        remedy: str) -> list[tuple[int, tuple[int | None, int]]]:
    """Packs the file holds that no row names (every row of theirs was lost)."""
    group = handle.get(PACKS)
    names = [name for name in group] if isinstance(group, h5py.Group) else []
    found = []
    for name in names:
        if name.isdigit() and int(name) not in extents:
            with damaged_file_errors(f"{where}:{pack_path(int(name))}", remedy):
                extent = _pack_extent(handle, int(name), file_size, where, remedy)
            if extent is not None and extent[1]:
                found.append((int(name), extent))
    return found


def read_span(descriptor: int, span: Span, dtype: np.dtype, shape: tuple[int, ...], where: str, remedy: str,
              region: tuple[slice, ...] | None = None) -> np.ndarray:
    """A tensor's values from its span (checked at open), in one `pread`; `region` (a slice per leading
    dim, step 1): only that part, its runs read by few `preadv`s (`_read_region`)."""
    if region is not None:
        return _read_region(descriptor, span, dtype, shape, where, remedy, region)
    values = np.empty(shape, dtype=dtype)
    _read_into(descriptor, values, span[0], where, remedy)
    return values


def read_span_quietly(descriptor: int, span: Span, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
    """`read_span` of a whole tensor without the words of an error (building them per tensor costs more than
    reading a small one): None when anything goes wrong, and the caller reads it again by `read_span`, which says what."""
    try:
        values = np.empty(shape, dtype=dtype)
        if not values.nbytes or os.preadv(descriptor, [values.reshape(-1).view(np.uint8)], span[0]) == values.nbytes:
            return values
    except (OSError, TypeError, ValueError):
        pass
    return None


RUN_GAP = 16 * 2**10
"""`coalesced_runs` reads two spans in one `pread` when at most this many bytes lie between them (a
`pread` costs about as much as copying 16 KB from the page cache)."""
RUN_BYTES = 4 * 2**20
"""... and while the run stays below this many bytes."""


def coalesced_runs(spans: list[Span]) -> list[tuple[int, int, list[int]]]:
    """The spans grouped into runs read with one `pread` each: (file offset, bytes, the indices of its spans). A
    span joins the run before it when at most RUN_GAP bytes lie between them, the run stays below RUN_BYTES, and
    it starts a multiple of 8 bytes into the run (so any stored dtype views it aligned); two spans naming the same
    bytes are read apart."""
    runs: list[tuple[int, int, list[int]]] = []
    order = sorted(range(len(spans)), key=lambda index: spans[index][0])
    start = 0
    while start < len(order):
        first = spans[order[start]][0]
        end, stop = first + spans[order[start]][1], start + 1
        while stop < len(order):
            offset, nbytes = spans[order[stop]]
            if offset - end > RUN_GAP or offset < end or offset + nbytes - first > RUN_BYTES or (offset - first) % 8:
                break
            end, stop = offset + nbytes, stop + 1
        runs.append((first, end - first, order[start:stop]))
        start = stop
    return runs


def read_run(descriptor: int, into: np.ndarray, offset: int) -> bool:
    """One run's bytes into `into` (uint8); False when the file could not give them all."""
    try:
        return not into.nbytes or os.preadv(descriptor, [into], offset) == into.nbytes
    except (OSError, ValueError):
        return False


def _read_into(descriptor: int, values: np.ndarray, start: int, where: str, remedy: str) -> None:
    if not values.nbytes:
        return
    try:
        got = os.preadv(descriptor, [values.reshape(-1).view(np.uint8)], start)
    except OSError as error:
        raise TraceFormatError(f"{where}: cannot be read ({error.strerror}); {remedy}") from error
    if got != values.nbytes:
        raise TraceFormatError(f"{where}: the file ends {values.nbytes - got} bytes before this tensor's last byte: it "
                               f"was truncated after it was opened; {remedy}")


def _read_region(descriptor: int, span: Span, dtype: np.dtype, shape: tuple[int, ...], where: str, remedy: str,
                 region: tuple[slice, ...]) -> np.ndarray:
    """The region's bytes: a contiguous run per index of its outer dims (a row of a slab of columns). Runs at most
    RUN_GAP apart are read together, up to RUN_BYTES at a time, with the bytes between them, and numpy copies the
    runs out: a slab of columns costs a `pread` per few MiB, and no Python per row."""
    bounds = [part.indices(shape[dim]) for dim, part in enumerate(region)]
    assert all(step == 1 for _, _, step in bounds), "regions are slices of step 1 (bounded.py)"
    lengths = [max(0, stop - start) for start, stop, _ in bounds]
    values = np.empty((*lengths, *shape[len(region):]), dtype=dtype)
    if not values.size:
        return values
    strides = [math.prod(shape[dim + 1:]) * dtype.itemsize for dim in range(len(shape))]
    last = len(region) - 1
    if not last:
        _read_into(descriptor, values, span[0] + bounds[0][0] * strides[0], where, remedy)
        return values
    runs = values.reshape(-1).view(np.uint8).reshape(math.prod(lengths[:last]), -1)  # a run per outer index
    run_bytes, stride = runs.shape[1], strides[last - 1]  # consecutive runs along dim last - 1 lie `stride` apart
    together = max(1, RUN_BYTES // stride) if stride - run_bytes <= RUN_GAP else 1
    block = np.empty(together * stride if together > 1 else 0, dtype=np.uint8)  # reused by every read of runs together
    for outer, first in enumerate(range(0, len(runs), lengths[last - 1])):  # the outer dims above last - 1
        index = np.unravel_index(outer, lengths[:last - 1]) if last > 1 else ()
        offset = span[0] + sum((bounds[dim][0] + int(i)) * strides[dim] for dim, i in enumerate(index)) \
            + bounds[last - 1][0] * strides[last - 1] + bounds[last][0] * strides[last]
        for row in range(0, lengths[last - 1], together):
            count = min(together, lengths[last - 1] - row)
            into = runs[first + row:first + row + count]
            if count == 1:
                _read_into(descriptor, into, offset + row * stride, where, remedy)
                continue
            _read_into(descriptor, block[:(count - 1) * stride + run_bytes], offset + row * stride, where, remedy)
            np.copyto(into, block[:count * stride].reshape(count, stride)[:, :run_bytes])
    return values
