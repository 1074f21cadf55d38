"""A step file's tensor index (formats 4 and 5): its inventory and every tensor's metadata in one dataset.

Part of stage 1's store: writer.py writes it when a step ends, step_file.py's wall indexes a file with it.
Until format 3 each dataset carried its `TensorMeta` as its own attribute, and indexing a 48-layer
run (15,838 tensors) read 15,838 attributes one HDF5 object at a time: 1-3 s. The index is one uint8
dataset, TENSOR_INDEX, of JSON lines, one `IndexRow` per tensor: the dataset that holds its values
(None for a stats-only tensor, which has none) and its metadata. One read and one decode index a file.

The index is checked against the file as the attributes were: every dataset it names must exist, every
dataset of the file must have exactly one row (`TableCheck`), and a row whose metadata names another key
or rank than its dataset is misplaced (step_file.py). Stored dtype, shape and storage size are checked
against the row before values are read (datasets.check_storage), as before. Soft and external links
are refused while the names are listed; hard links, which the writer uses for a tensor recorded twice
in one step (the same storage and version), stay inside the file by construction.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import h5py
import msgspec

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.containment import link_refusal, refuse_external_storage
from ttrace_core.format.datasets import read_bytes_dataset
from ttrace_core.format.records import _reason
from ttrace_core.format.schema import Count, TensorMeta

TENSOR_INDEX = "tensor_index"
"""Step-file dataset (format 4): one JSON `IndexRow` per line, as uint8."""
LINKS_ATTR = "num_links"
"""Step-file attribute (format 4): how many of its tensors are hard links to bytes written earlier in the step."""


class IndexRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One tensor of a step file."""

    dataset: str | None
    """Where its values are (`step_file.dataset_path(meta.key)` when the row tells the truth): format 4,
    the dataset holding them; format 5, a name only, the bytes being at `offset` of pack `pack`. None
    for a stats-only tensor."""
    meta: TensorMeta
    pack: Count | None = None
    """Format 5: the pack holding its bytes (packs.py)."""
    offset: Count | None = None
    """Format 5: where its bytes start in that pack."""


_ROW_ENCODER = msgspec.json.Encoder()
_ROW_DECODER = msgspec.json.Decoder(IndexRow)


def row_line(dataset: str | None, meta: TensorMeta, pack: int | None = None, offset: int | None = None) -> bytes:
    """One line of the index (no newline inside: JSON escapes it in strings)."""
    return _ROW_ENCODER.encode(IndexRow(dataset=dataset, meta=meta, pack=pack, offset=offset))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Decoding 15k rows allocates ~100k objects, and the cyclic collector, triggered every 700 of
    them, walks all of them again each time: 4x the decode itself (measured). Nothing decoded here
    forms a cycle, so the collector waits until the rows are built."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def rows_from_text(text: bytes, where: str) -> list[IndexRow]:
    """Every row of an index; a malformed one is named by its line number."""
    with collector_paused():
        try:
            return _ROW_DECODER.decode_lines(text)
        except (msgspec.DecodeError, RecursionError, UnicodeError, TypeError):
            pass  # find the line, and say what is wrong with it
        for number, line in enumerate(text.split(b"\n"), start=1):
            try:
                _ROW_DECODER.decode(line)
            except (msgspec.DecodeError, RecursionError, UnicodeError, TypeError) as error:
                raise TraceFormatError(f"{where}:{TENSOR_INDEX} line {number}: tensor metadata is malformed "
                                       f"({_reason(error)}); re-record this rank") from error
    raise TraceFormatError(f"{where}:{TENSOR_INDEX}: tensor metadata is malformed; re-record this rank")


def read_rows(handle: h5py.File, where: str) -> list[IndexRow]:
    """The rows of a step file's index, or one line saying it has none."""
    if TENSOR_INDEX not in handle:
        raise TraceFormatError(f"{where}: has no tensor index ({TENSOR_INDEX}), which every step file of trace format 4 "
                               "holds: the file is damaged or was not written by ttrace; re-record this rank")
    dataset = handle[TENSOR_INDEX]
    refuse_external_storage(dataset.id, f"{where}:{TENSOR_INDEX}")
    return rows_from_text(read_bytes_dataset(dataset, f"{where}:{TENSOR_INDEX}", "re-record this rank"), where)


def tensor_names(handle: h5py.File, where: str) -> set[str]:
    """The names of the file's tensor datasets (below a phase group; hard links included), refusing a
    soft or external link, in one walk of the file's links (the step file's own datasets excluded)."""
    found: list[bytes] = []
    keep, refused = found.append, []

    def visit(name: bytes, info) -> bool | None:  # raising inside an HDF5 callback corrupts h5py's lock
        if info.type == h5py.h5l.TYPE_HARD:
            keep(name)  # as little as possible per link: the walk is a third of opening a file
            return None
        refused.append((name, info.type))
        return True

    with collector_paused():
        handle.id.links.visit(visit, info=True)
    if refused:
        raise link_refusal(where, *refused[0])
    return {name.decode("utf-8", "backslashreplace") for name in found if name.count(b"/") == 2}


@dataclass(slots=True)
class TableCheck:
    """What a step file's index says against what the file holds."""

    rows: list[IndexRow] = field(default_factory=list)
    """The rows whose dataset exists (and the stats-only rows), each dataset once."""
    missing: list[str] = field(default_factory=list)
    """Datasets the index names and the file does not hold."""


def checked_rows(handle: h5py.File, where: str) -> TableCheck:
    """The index rows of a step file checked against its datasets: a dataset without a row, or with
    two, is refused (the file was not written by ttrace, or its index lies); a row whose dataset is
    missing is reported in `missing` (its tensor is lost, as a dataset missing from the inventory was)."""
    names = tensor_names(handle, where)
    check = TableCheck()
    seen: set[str] = set()
    for row in read_rows(handle, where):
        if row.dataset is None:
            check.rows.append(row)
        elif row.dataset in seen:
            raise TraceFormatError(f"{where}: the tensor index lists dataset {row.dataset} twice; its index is "
                                   "damaged, re-record this rank")
        elif row.dataset in names:
            seen.add(row.dataset)
            check.rows.append(row)
        else:
            check.missing.append(row.dataset)
    if len(seen) != len(names):
        unlisted = sorted(names - seen)
        raise TraceFormatError(f"{where}: dataset {unlisted[0]} has no row in the tensor index"
                               f"{f' ({len(unlisted)} datasets have none)' if len(unlisted) > 1 else ''}; the file "
                               "was not written by ttrace or its index is damaged, re-record this rank")
    return check


def row_of_dataset(handle: h5py.File, dataset: str, where: str) -> IndexRow | None:
    """The row of one dataset (None when the index has none), for readers of a single tensor."""
    return next((row for row in read_rows(handle, where) if row.dataset == dataset), None)
