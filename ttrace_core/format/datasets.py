"""Reading one HDF5 object of a step file: what the file declares is checked before anything is
allocated, and whatever HDF5, numpy or torch raise on a damaged file becomes one line.

Part of stage 0, the trace format; behind the wall of step_file.py, every dataset and attribute of a
step file is read through here. This is the boundary between HDF5 and ttrace: a damaged file fails deep below h5py
(a zeroed global heap: "bad global heap collection signature"; a flipped bit in a datatype message:
a float of 128 bits numpy holds as longdouble and torch cannot take), and each failure becomes a
`TraceFormatError` that names the file and the dataset, says what is wrong and what to do.

Before a dataset's values are read, its stored dtype and shape must be the ones its metadata
declares, and the file must hold storage for all of them: a dataspace claiming 2**40 elements over
storage that was never written would otherwise be read as terabytes of fill values.
"""

from __future__ import annotations

import functools

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import h5py
import numpy as np
import torch

from ttrace_core.errors import TraceFormatError, TtraceError

# Dtypes stored as raw bits of an integer dtype of the same width.
RAW_BITS = {
    "bfloat16": torch.int16,
    "float8_e4m3fn": torch.uint8,
    "float8_e5m2": torch.uint8,
    "float8_e4m3fnuz": torch.uint8,
    "float8_e5m2fnuz": torch.uint8,
}
NATIVE_DTYPES = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}

READ_ERRORS = (OSError, KeyError, ValueError, TypeError, RuntimeError, OverflowError, IndexError, MemoryError)
"""What reading a damaged file raises below ttrace: HDF5's errors arrive through h5py as OSError,
KeyError, ValueError or RuntimeError; a datatype numpy has no type for, or one torch cannot take, as
TypeError; a size beyond memory as MemoryError (numpy's _ArrayMemoryError among them)."""


@contextmanager
def damaged_file_errors(where: str, remedy: str) -> Iterator[None]:
    """Inside: every READ_ERRORS raised while reading `where` (file:dataset) becomes one TraceFormatError line."""
    try:
        yield
    except TtraceError:
        raise
    except READ_ERRORS as error:
        raise TraceFormatError(f"{where}: {_what_is_wrong(error)}; {remedy}") from error


def _what_is_wrong(error: BaseException) -> str:
    if isinstance(error, MemoryError):
        return "reading it would take more memory than this machine has, more than the file holds: it is damaged"
    text = " ".join(str(error).split())[:240] or type(error).__name__
    return f"cannot be read, the file is damaged ({text})"


@functools.cache
def stored_dtype(name: str) -> np.dtype:
    """The numpy dtype (native byte order) a tensor of dtype `name` is stored as: bf16 and fp8 as raw bits (kept
    per name: compare asks it for every small tensor it gathers)."""
    if name in RAW_BITS:
        return np.dtype(str(RAW_BITS[name]).removeprefix("torch."))
    return np.dtype(name)


LOSSLESS_FILTERS = {h5py.h5z.FILTER_DEFLATE: "gzip", h5py.h5z.FILTER_SHUFFLE: "shuffle",
                    h5py.h5z.FILTER_FLETCHER32: "fletcher32", h5py.h5z.FILTER_SZIP: "szip", h5py.h5z.FILTER_LZF: "lzf"}
"""The HDF5 filters a step file may be stored through: those built into HDF5 and h5py that give back every bit.
ttrace writes no filter, but an archived trace may have been rewritten with one (`h5repack -f GZIP=6`). Any
other filter is refused: scale-offset and n-bit can drop bits, and a filter HDF5 does not have built in is a
plugin library it would load and run because the file names it."""


def check_filters(plist: h5py.h5p.PropDCID, where: str, remedy: str) -> None:
    """Refuses, in one line, a dataset stored through a filter that is not one of LOSSLESS_FILTERS or that this HDF5
    lacks, before a byte of it is read (nothing a filter would load is loaded)."""
    for number in range(plist.get_nfilters()):
        code, _flags, _values, name = plist.get_filter(number)
        label = name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else str(name)
        if code not in LOSSLESS_FILTERS:
            raise TraceFormatError(
                f"{where}: stored through HDF5 filter {code} ({label or 'unnamed'}), not one of the lossless filters "
                f"built into HDF5 and h5py ({', '.join(LOSSLESS_FILTERS.values())}): ttrace loads no filter plugin and "
                f"reads no lossy filter (rewrite the file without it: h5repack -f NONE); {remedy}")
        if not h5py.h5z.filter_avail(code):
            raise TraceFormatError(f"{where}: stored through the {LOSSLESS_FILTERS[code]} filter, which this HDF5 build "
                                   f"lacks; rewrite the file without it (h5repack -f NONE) on a machine that has it")


def check_storage(dataset: h5py.Dataset | h5py.h5d.DatasetID, dtype: np.dtype, shape: tuple[int, ...], where: str,
                  remedy: str) -> None:
    """Refuses a dataset whose stored dtype or shape is not the declared one, that is stored through a filter
    other than LOSSLESS_FILTERS, or whose storage in the file is smaller than its declared size (chunked, perhaps
    compressed: fewer chunks than its shape needs; a damaged compressed chunk fails when read, in one line): checked from
    the dataset's header alone (a high-level dataset or its low-level id), before any of its values is allocated."""
    dataset = dataset.id if isinstance(dataset, h5py.Dataset) else dataset
    if dataset.dtype != dtype:
        raise TraceFormatError(f"{where}: its stored datatype reads as {dataset.dtype.str} ({dataset.dtype.name}) but its "
                               f"metadata says {dtype.str} ({dtype.name}): the datatype message is damaged; {remedy}")
    if dataset.shape != shape:
        raise TraceFormatError(f"{where}: stored shape {dataset.shape} differs from its metadata {shape}; {remedy}")
    plist = dataset.get_create_plist()
    check_filters(plist, where, remedy)
    if plist.get_layout() == h5py.h5d.CHUNKED:  # (compressed, its storage is smaller than its values: count chunks)
        needed = math.prod(-(-size // chunk) for size, chunk in zip(shape, plist.get_chunk()))
        if (held_chunks := dataset.get_num_chunks()) < needed:
            raise TraceFormatError(f"{where}: declares shape {shape} of {dtype.str} in {needed} chunks but the file holds "
                                   f"{held_chunks} of them (a damaged header, or values never written); {remedy}")
        return
    declared, held = math.prod(shape) * dtype.itemsize, dataset.get_storage_size()
    if held < declared:
        raise TraceFormatError(f"{where}: declares shape {shape} of {dtype.str} ({declared} bytes) but the file holds "
                               f"{held} bytes of storage for it (a damaged header, or values never written); {remedy}")


def read_values(dataset: h5py.Dataset, dtype: np.dtype, shape: tuple[int, ...], where: str, remedy: str,
                region: tuple[slice, ...] | None = None) -> np.ndarray:
    """The dataset's values (only `region`, a slice per leading dim, when given), checked first."""
    with damaged_file_errors(where, remedy):
        check_storage(dataset, dtype, shape, where, remedy)
        return dataset[()] if region is None else dataset[region]


def read_whole_values(file: h5py.File, path: str, dtype: np.dtype, shape: tuple[int, ...], where: str,
                      remedy: str, check: Callable[[h5py.h5d.DatasetID], None] | None = None) -> np.ndarray:
    """All of the dataset at `path`'s values, checked first, through h5py's low-level API: the same
    checks and bytes as `read_values`, without the high-level lookup and selection machinery that
    took more time per dataset than reading a tensor of 64Ki floats (compare reads thousands).
    `check`: the caller's own check of the opened dataset (containment's external-storage refusal)."""
    with damaged_file_errors(where, remedy):
        try:
            dataset = h5py.h5d.open(file.id, path.encode())
        except (KeyError, ValueError, TypeError):  # no such link, or a group: not where ttrace writes values
            raise TraceFormatError(f"{where}: the file holds no such dataset; {remedy}") from None
        if check is not None:
            check(dataset)
        check_storage(dataset, dtype, shape, where, remedy)
        values = np.empty(shape, dtype=dtype)
        if values.size:
            dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, values)
        return values


def read_bytes_dataset(dataset: h5py.Dataset, where: str, remedy: str) -> bytes:
    """A dataset ttrace writes as one row of bytes (JSON lines: findings, stats-only records), checked first."""
    with damaged_file_errors(where, remedy):
        if len(dataset.shape) != 1:
            raise TraceFormatError(f"{where}: stored shape {dataset.shape}, ttrace writes one row of bytes here; {remedy}")
        return read_values(dataset, np.dtype("uint8"), dataset.shape, where, remedy).tobytes()


CLASS_NAMES = {h5py.h5t.INTEGER: "an integer", h5py.h5t.FLOAT: "a float", h5py.h5t.STRING: "a string",
               h5py.h5t.BITFIELD: "a bitfield", h5py.h5t.OPAQUE: "opaque bytes", h5py.h5t.COMPOUND: "a compound",
               h5py.h5t.REFERENCE: "a reference", h5py.h5t.ENUM: "an enum", h5py.h5t.VLEN: "a variable-length sequence",
               h5py.h5t.ARRAY: "an array"}
"""How an attribute's HDF5 datatype class is named in a refusal."""
STRING = (h5py.h5t.TypeStringID,)
INTEGER = (h5py.h5t.TypeIntegerID,)


def scalar_attribute(owner, name: str, kinds: tuple[type, ...], where: str, remedy: str) -> object | None:
    """Attribute `name` of `owner` (a file, group or dataset, or its low-level id), or None when it has
    none: one value of one of `kinds` of HDF5 datatype, checked before HDF5 converts it. A flipped bit
    can turn a variable-length string into a variable-length sequence of garbage, whose conversion
    crashes the process (a segmentation fault, not an exception), or give it 2**40 elements."""
    owner_id = owner.id if isinstance(owner, h5py.HLObject) else owner
    with damaged_file_errors(f"{where}: attribute {name}", remedy):
        if not h5py.h5a.exists(owner_id, name.encode()):
            return None
        attribute = h5py.h5a.open(owner_id, name.encode())
        datatype = attribute.get_type()
        if attribute.shape != () or not isinstance(datatype, kinds):
            shape = "" if attribute.shape == () else f" of shape {attribute.shape}"
            raise TraceFormatError(f"{where}: attribute {name} is {CLASS_NAMES.get(datatype.get_class(), 'unknown')}"
                                   f"{shape}, not the one {_kind_names(kinds)} ttrace writes: its header is damaged; {remedy}")
        value = np.empty((), dtype=attribute.dtype)
        attribute.read(value)
        return value[()]


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join("string" if kind is h5py.h5t.TypeStringID else "integer" for kind in kinds)


def tensor_from_array(array: np.ndarray, name: str, where: str) -> torch.Tensor:
    value = torch.from_numpy(np.asarray(array, order="C"))
    bits = raw_bits_view(name, where)
    return value if bits is None else value.view(bits)


def raw_bits_view(name: str, where: str) -> torch.dtype | None:
    """The torch dtype a tensor stored as raw bits (`RAW_BITS`) is viewed as; None for one stored natively.
    A dtype the schema does not name is refused in one line."""
    if name in RAW_BITS:
        return getattr(torch, name)
    if name in NATIVE_DTYPES:
        return None
    raise TraceFormatError(f"{where}: unknown dtype {name!r} in the trace; it was written by another ttrace version")
