"""Opening a step file safely: the one wall every reader of a trace's HDF5 files sits behind.

Part of stage 0, the trace format: reader.py indexes a run through it, shard_reads.py reads one tensor
through it, and nothing else opens a step file. `open_step` is the only way in. It checks the file once:

1. the path: inside the run directory, and a regular file (containment.contained, regular_files.py);
2. the file: HDF5 opens it, and its global heap cannot make HDF5 loop forever (global_heap.py);
3. its links: hard links inside the file only, no soft or external link (containment.py);
4. its attributes: format version, blind spots and inventory, each checked before HDF5 converts it
   (datasets.scalar_attribute);
5. its tensors: the tensor index (tensor_index.py) against the file's packs (packs.py, format 5: every
   pack a row names, and every row's span in it) or its datasets (format 4), or each dataset's own
   `meta` attribute (formats 1 to 3); every row decoded into a range-checked record (records.py) and
   placed where the file keeps it (a row naming another key or rank is misplaced);
6. its findings (findings.py).

Whatever HDF5, numpy or torch raise on the way becomes one line naming the file and the object
(datasets.damaged_file_errors). After it, `StepFile.read` reads one tensor's values: in format 5 one
`pread` of the span checked at open, with no HDF5 call (the file's HDF5 handle is already closed); up
to format 4 through its dataset, whose stored dtype, shape and storage are checked before a byte is
allocated.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import msgspec
import numpy as np
import torch

from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.format.containment import contained, dataset_metas, refuse_external_storage, refuse_links
from ttrace_core.format.datasets import (
    INTEGER, READ_ERRORS, STRING, damaged_file_errors, read_bytes_dataset, read_values, read_whole_values,
    scalar_attribute, stored_dtype, tensor_from_array,
)
from ttrace_core.format.findings import FINDINGS, findings_in_file
from ttrace_core.format.global_heap import refuse_looping_heaps
from ttrace_core.format.naming import ROOT_NAME, display_fqn
from ttrace_core.format.records import meta_from_json
from ttrace_core.format.packs import (
    Span, checked_spans, read_run, read_span, read_span_quietly, refuse_foreign_objects,
)
from ttrace_core.format.schema import INDEXED_FORMAT, NO_MICRO_BATCH, PACKED_FORMAT, PHASES, Finding, TensorKey, TensorMeta
from ttrace_core.format.tensor_index import TENSOR_INDEX, IndexRow, checked_rows, collector_paused, read_rows

INVENTORY_ATTR = "num_tensors"
"""Step-file attribute: how many tensors the writer put in it (a reader that finds fewer names the gap)."""
PARTIAL_SUFFIX = ".partial"
STATS_ONLY_METAS = "stats_only_metas"
"""Step-file dataset (formats 2 and 3): the metadata of every stats-only tensor of the step, one JSON
record per line (a stats-only tensor has no values, and one dataset per tensor cost more than recording it)."""
STOPPED_ATTR = "stopped"
"""Partial step-file attribute: the exception that stopped the step on that rank (a killed rank leaves none)."""
MAX_STOPPED_CHARS = 300
STEP_FILE = re.compile(r"^rank_(\d{5})\.step_(\d{6})\.h5(\.partial)?$")

Wanted = Callable[[str], bool]
"""Which tensors to index, by the path of their place in the file (`dataset_path`)."""


def step_file_name(rank: int, step: int) -> str:
    return f"rank_{rank:05d}.step_{step:06d}.h5"


def dataset_path(key: TensorKey) -> str:
    group = "all" if key.micro_batch < 0 else _micro_batch_group(key.micro_batch)
    call = f"@{key.call}" if key.call else ""
    return f"{key.phase}/{group}/{display_fqn(key.fqn)}#{key.slot}{call}"


@functools.lru_cache(maxsize=1024)
def _micro_batch_group(micro_batch: int) -> str:
    return f"mb_{micro_batch:04d}"  # (made once: every row read names its place)


def key_from_dataset_path(path: str, step: int) -> TensorKey | None:
    """The key a tensor's place in its file names (the inverse of `dataset_path`); None for a name
    ttrace does not write, another spelling of a key's place included ("mb_1", "@0", "" for <root>): each
    key has one place, so no two places of a file name the same tensor."""
    parts = path.split("/")
    if len(parts) != 3 or "#" not in parts[2] or parts[0] not in PHASES:
        return None
    group, (fqn, _, slot) = parts[1], parts[2].partition("#")
    slot, _, call = slot.partition("@")
    if group == "all":
        micro_batch = NO_MICRO_BATCH
    elif group.startswith("mb_") and group[3:].isdigit():
        micro_batch = int(group[3:])
    else:
        return None
    if call and not call.isdigit():
        return None
    key = TensorKey(step=step, micro_batch=micro_batch, phase=parts[0], fqn="" if fqn == ROOT_NAME else fqn, slot=slot,
                    call=int(call or 0))
    return key if dataset_path(key) == path else None


def remedy_of(rank: int) -> str:
    return f"re-record rank {rank} (or copy its file again)"


@dataclass(slots=True)
class StepFile:
    """One step file, checked by `open_step`: what it holds, and its values on demand."""

    path: Path
    rank: int
    step: int
    metas: list[TensorMeta] = field(default_factory=list)
    """Every tensor asked for, its key and rank those of the place the file keeps it at."""
    misplaced: dict[TensorKey, str] = field(default_factory=dict)
    """Tensors whose metadata names another key or rank than the place they are stored at."""
    findings: list[Finding] = field(default_factory=list)
    blind_spots: dict[str, str] = field(default_factory=dict)
    inventory_gaps: list[str] = field(default_factory=list)
    """The file holds fewer tensors than its writer recorded (INVENTORY_ATTR), or its index names some it lacks."""
    stopped: str | None = None
    """A step not compared: what stopped it on this rank ('left no word' when nothing says)."""
    _handle: h5py.File | None = None
    _spans: dict[str, Span] | None = None
    """Format 5: each tensor's bytes in the file (by its place), checked at open."""
    _descriptor: int | None = None
    """Format 5: the file, open for `pread` (a duplicate of HDF5's own descriptor, taken before it was closed), or
    the copy of its packs when another tool rewrote them compressed or chunked (packs.unpacked)."""
    _span_of: dict[int, Span] = field(default_factory=dict)
    """Format 5: id of each of `metas` -> its span, so that reading it names nothing (they live as long as `metas`)."""

    def read(self, meta: TensorMeta, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The recorded local values of one of `metas`, in its recorded dtype; `region` (a slice per
        leading dim): only that part, read as a hyperslab (HDF5 reads only its bytes)."""
        # a row of this file's index (its dtype one the schema names): one pread; any trouble is read again below, and worded
        if region is None and (span := self._span_of.get(id(meta))) is not None and (values := read_span_quietly(
                self._descriptor, span, stored_dtype(meta.dtype), meta.local_shape)) is not None:
            return tensor_from_array(values, meta.dtype, str(self.path))
        path = dataset_path(meta.key)
        where = f"{self.path}:{path}"
        if meta.stats_only:
            raise TraceFormatError(f"{where}: recorded in stats-only mode; it holds no values")
        remedy = remedy_of(self.rank)
        if self._spans is not None:  # every placed tensor with values has its span, checked at open
            try:
                array = read_span(self._descriptor, self._spans[path], stored_dtype(meta.dtype), meta.local_shape, where,
                                  remedy, region)
                return tensor_from_array(array, meta.dtype, where)
            except TtraceError:
                raise
            except READ_ERRORS as error:
                raise TraceFormatError(f"{where}: cannot be read ({error}); {remedy}") from error
        with damaged_file_errors(where, remedy):
            if region is None:
                array = read_whole_values(self._handle, path, stored_dtype(meta.dtype), meta.local_shape, where, remedy,
                                          check=lambda dataset: refuse_external_storage(dataset, where))
            else:
                dataset = self._handle.get(path)
                if not isinstance(dataset, h5py.Dataset):
                    raise TraceFormatError(f"{where}: the file holds no such dataset; {remedy}")
                refuse_external_storage(dataset.id, where)  # format 4 checks it here, not while indexing
                array = read_values(dataset, stored_dtype(meta.dtype), meta.local_shape, where, remedy, region)
            return tensor_from_array(array, meta.dtype, where)

    def spans_of(self, metas: list[TensorMeta]) -> list[Span | None]:
        """Format 5: where each of `metas` (the file's own) lies in it, checked at open; None up to format 4."""
        get = self._span_of.get
        return [get(id(meta)) for meta in metas]

    def read_run(self, into: np.ndarray, offset: int) -> bool:
        """Format 5: `into.nbytes` bytes of the file from `offset` (a run of spans, packs.coalesced_runs); False
        when the file could not give them all (`read` then reads each tensor and words what is wrong)."""
        return self._descriptor is not None and read_run(self._descriptor, into, offset)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> StepFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_step(run_dir: str | Path, rank: int, step: int, *, complete: bool = True, unfinished: bool = False,
              tensors: bool = True, wanted: Wanted | None = None) -> StepFile:
    """Rank `rank`'s file of step `step` (its `.partial` file unless `complete`), checked; one line
    naming the file and the object when it cannot be read. `tensors`: index its tensors (only those
    `wanted`); else its attributes alone. `unfinished`: a file of a step that is not compared, read for
    what stopped it and its findings, its damage absorbed (a file cut off mid-write is expected there)."""
    name = step_file_name(rank, step) + ("" if complete else PARTIAL_SUFFIX)
    if unfinished:
        return _leftovers(run_dir, name, rank, step)
    path = contained(run_dir, name)
    step_file = StepFile(path=path, rank=rank, step=step, _handle=_opened(path, rank))
    try:
        with damaged_file_errors(str(path), remedy_of(rank)):
            step_file.blind_spots = _blind_spots_of(step_file._handle, path, rank)
            if tensors:
                _index(step_file, wanted)
            if step_file._spans is not None:  # format 5: read by pread from here on, HDF5 is done
                if step_file._descriptor is None:  # (else its packs were copied out: packs.unpacked)
                    step_file._descriptor = os.dup(step_file._handle.id.get_vfd_handle())
                step_file._handle.close()
                step_file._handle = None
    except BaseException:
        step_file.close()
        raise
    return step_file


def _opened(path: Path, rank: int) -> h5py.File:
    """The file opened read-only (after `contained` checked what `path` is), its global heap one HDF5
    can read without looping (global_heap.py), or one line saying why not."""
    try:
        handle = h5py.File(path, "r")
    except READ_ERRORS as error:
        reason = str(error).split("(")[0].strip() or "unreadable"
        raise TraceFormatError(f"{path}: not a readable HDF5 file ({reason}); it is truncated or corrupted, "
                               f"{remedy_of(rank)}") from error
    try:
        with damaged_file_errors(str(path), remedy_of(rank)):
            refuse_looping_heaps(handle, path, remedy_of(rank))
    except TraceFormatError:
        handle.close()
        raise
    return handle


def _leftovers(run_dir: str | Path, name: str, rank: int, step: int) -> StepFile:
    """What a file of an unfinished step keeps: the word of what stopped it and its findings (RunWriter.close
    writes both into a stopped step's file), each part given up on damage."""
    step_file = StepFile(path=Path(run_dir) / name, rank=rank, step=step, stopped="left no word: killed, or its machine died")
    try:
        step_file.path = contained(run_dir, name)
        step_file._handle = _opened(step_file.path, rank)
    except TtraceError:
        return step_file
    where, remedy = str(step_file.path), remedy_of(rank)
    with step_file:
        try:
            with damaged_file_errors(where, remedy):
                word = scalar_attribute(step_file._handle, STOPPED_ATTR, STRING, where, remedy)
            if isinstance(word, bytes):
                word = word.decode(errors="replace")
            if isinstance(word, str) and word.strip():
                step_file.stopped = "stopped on " + " ".join(word.split())[:MAX_STOPPED_CHARS]
        except TtraceError:
            pass
        try:
            with damaged_file_errors(where, remedy):
                refuse_links(step_file._handle, where)
                step_file.findings = findings_in_file(step_file._handle, where)
        except TtraceError:
            pass
    return step_file


def _blind_spots_of(handle: h5py.File, path: Path, rank: int) -> dict[str, str]:
    """The modules one rank's trace could not see into (Tracer.blind_spots), from its step file."""
    try:
        blind_spots = json.loads(scalar_attribute(handle, "blind_spots", STRING, str(path), remedy_of(rank)) or "{}")
    except (TypeError, ValueError) as error:
        raise TraceFormatError(f"{path}: attribute blind_spots is not JSON ({error}); re-record rank {rank}") from error
    if not isinstance(blind_spots, dict) or not all(isinstance(v, str) for v in blind_spots.values()):
        raise TraceFormatError(f"{path}: attribute blind_spots must map module names to text; re-record rank {rank}")
    return blind_spots


def _index(step_file: StepFile, wanted: Wanted | None) -> None:
    handle, path, rank = step_file._handle, step_file.path, step_file.rank
    version = scalar_attribute(handle, "format_version", INTEGER, str(path), remedy_of(rank))
    version = int(version) if isinstance(version, (int, np.integer)) else 0
    if version >= PACKED_FORMAT:
        held = _index_packs(step_file, wanted)
    elif version >= INDEXED_FORMAT:
        held = _index_table(step_file, wanted)
    else:
        held = _index_attributes(step_file, wanted)
    written = scalar_attribute(handle, INVENTORY_ATTR, INTEGER, str(path), remedy_of(rank))
    if written is not None:
        written = int(written) if isinstance(written, (int, np.integer)) else repr(written)
        if written != held:
            step_file.inventory_gaps.append(f"{path.name} holds {held} tensors, its writer recorded {written}")


def _index_table(step_file: StepFile, wanted: Wanted | None) -> int:
    """A format-4 step file, from its tensor index checked against the file's datasets; the tensors it holds."""
    where = str(step_file.path)
    table = checked_rows(step_file._handle, where)
    step_file.findings = findings_in_file(step_file._handle, where)
    rows = table.rows if wanted is None else [row for row in table.rows if wanted(row.dataset or dataset_path(row.meta.key))]
    with collector_paused():  # 15k rows placed make the collector walk every object again: 1/4 of the time
        for row in rows:
            _place_row(step_file, row)
    step_file.inventory_gaps += [f"{step_file.path.name}: its tensor index lists {name}, which the file does not hold"
                                 for name in table.missing]
    return len(table.rows) + len(table.missing)


def _index_packs(step_file: StepFile, wanted: Wanted | None) -> int:
    """A format-5 step file: its objects, its tensor index and every span the index names in its packs;
    the tensors it holds."""
    handle, where, remedy = step_file._handle, str(step_file.path), remedy_of(step_file.rank)
    refuse_foreign_objects(handle, where, (TENSOR_INDEX, FINDINGS))
    rows = read_rows(handle, where)
    names = [row.dataset for row in rows if row.dataset is not None]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise TraceFormatError(f"{where}: the tensor index lists {name} twice; its index is damaged, "
                                       "re-record this rank")
            seen.add(name)
    checked = checked_spans(handle, rows, where, remedy)
    step_file._spans, step_file._descriptor = checked.spans, checked.image  # (closed with the step file from here on)
    step_file.findings = findings_in_file(handle, where)
    missing = set(checked.missing)
    with collector_paused():
        for row in rows:
            if row.dataset not in missing and (wanted is None or wanted(row.dataset or dataset_path(row.meta.key))):
                _place_row(step_file, row)
    name = step_file.path.name
    step_file.inventory_gaps += [f"{name}: its tensor index lists {row}, whose pack the file does not hold"
                                 for row in checked.missing]
    step_file.inventory_gaps += [f"{name}: {line} (tensors whose index rows were lost)" for line in checked.unnamed]
    return len(rows)


def _place_row(step_file: StepFile, row: IndexRow) -> None:
    meta, rank, step = row.meta, step_file.rank, step_file.step
    if row.dataset is None:
        _place_stats_only(step_file, meta)
        return
    if meta.rank == rank and meta.key.step == step and row.dataset == dataset_path(meta.key):
        step_file.metas.append(meta)  # the row tells the truth (nearly always): no name to parse
        if step_file._spans is not None and (span := step_file._spans.get(row.dataset)) is not None:
            step_file._span_of[id(meta)] = span
        return
    placed = key_from_dataset_path(row.dataset, step)
    if placed is None:
        raise TraceFormatError(f"{step_file.path}: dataset {row.dataset} is not where ttrace writes tensors; the file "
                               "was not written by ttrace")
    step_file.misplaced[placed] = (f"{placed}: the index row of the dataset in rank {rank}'s file says it is {meta.key} "
                                   f"of rank {meta.rank}")
    step_file.metas.append(msgspec.structs.replace(meta, key=placed, rank=rank))


def _place_stats_only(step_file: StepFile, meta: TensorMeta) -> None:
    rank, step = step_file.rank, step_file.step
    placed = msgspec.structs.replace(meta.key, step=step)
    if meta.key.step != step or meta.rank != rank or not meta.stats_only:
        step_file.misplaced[placed] = (f"{placed}: the stats-only record in rank {rank}'s file of step {step} says it is "
                                       f"{meta.key} of rank {meta.rank}{'' if meta.stats_only else ', with values'}")
        meta = msgspec.structs.replace(meta, key=placed, rank=rank, stats_only=True)
    step_file.metas.append(meta)


def _index_attributes(step_file: StepFile, wanted: Wanted | None) -> int:
    """A step file of formats 1 to 3: each dataset's metadata is its own attribute; the tensors it holds."""
    handle, where = step_file._handle, str(step_file.path)
    metas = dataset_metas(handle, where)
    stats_only = _stats_only_metas(handle, where) if metas.pop(STATS_ONLY_METAS, False) is not False else []
    if metas.pop(FINDINGS, False) is not False:
        step_file.findings = findings_in_file(handle, where)
    for name, text in metas.items():
        if wanted is None or wanted(name):
            _place_dataset(step_file, name, text)
    for meta in stats_only:
        if wanted is None or wanted(dataset_path(meta.key)):
            _place_stats_only(step_file, meta)
    return len(metas) + len(stats_only)


def _stats_only_metas(handle: h5py.File, where: str) -> list[TensorMeta]:
    """The step file's stats-only records (STATS_ONLY_METAS), each checked like a dataset's metadata."""
    text = read_bytes_dataset(handle[STATS_ONLY_METAS], f"{where}:{STATS_ONLY_METAS}", "re-record this rank")
    return [meta_from_json(line, f"{where}:{STATS_ONLY_METAS} line {number}")
            for number, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _place_dataset(step_file: StepFile, name: str, text: bytes | None) -> None:
    where, rank = str(step_file.path), step_file.rank
    if text is None:
        raise TraceFormatError(f"{where}: dataset {name} has no ttrace metadata; the file was not written by ttrace")
    meta = meta_from_json(text, f"{where}:{name}")
    placed = key_from_dataset_path(name, step_file.step)
    if placed is None:
        raise TraceFormatError(f"{where}: dataset {name} is not where ttrace writes tensors; the file was not written by ttrace")
    if placed != meta.key or meta.rank != rank:
        step_file.misplaced[placed] = f"{placed}: the dataset in rank {rank}'s file says it is {meta.key} of rank {meta.rank}"
        meta = msgspec.structs.replace(meta, key=placed, rank=rank)
    step_file.metas.append(meta)
