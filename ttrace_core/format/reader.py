"""Trace store: stage 1 (record) writes it (writer.py), stage 2 (canonicalize) reads it here.

A run directory holds `manifest.json` and one HDF5 file per rank and step,
`rank_00001.step_000000.h5`. A step file is written as `<name>.partial` and renamed only after it
is complete and flushed, so a killed recording leaves every finished step readable and its
interrupted step marked partial. Datasets are uncompressed and contiguous: fp32 activations
compress by under 10% while gzip makes writing 10x slower. Every tensor's `TensorMeta` is one row of
its step file's tensor index (tensor_index.py; format 4); up to format 3 each dataset carried its own
as one JSON attribute, and those files are read as they were. Values are raw bits: bf16 as int16, fp8 as uint8 plus its scale; nothing is
upcast. Reading never executes code: JSON and HDF5 numeric arrays only, no pickle, no torch.load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import defaultdict
from pathlib import Path

import h5py
import numpy as np
import torch

from ttrace_core.format.containment import contained, dataset_metas, refuse_external_storage, refuse_links
from ttrace_core.format.regular_files import regular_file_bytes
from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.format.datasets import (
    INTEGER, READ_ERRORS, STRING, damaged_file_errors, read_bytes_dataset, read_values, read_whole_values, scalar_attribute,
    stored_dtype,
    tensor_from_array,
)
from ttrace_core.format.findings import FINDINGS, findings_in_file
from ttrace_core.format.naming import in_subtree
from ttrace_core.format.global_heap import refuse_looping_heaps
from ttrace_core.format.records import data_from_json, meta_from_json, record_from_data
from ttrace_core.format.tensor_index import IndexRow, checked_rows, collector_paused
from ttrace_core.format.schema import (
    FORMAT_VERSION, INDEXED_FORMAT, NO_MICRO_BATCH, PHASES, PRE_STEP_SLOT, READABLE_FORMAT_VERSIONS, REQUIRED_MANIFEST_FIELDS, Finding, RunManifest,
    TOKENS_SLOT, TensorKey, TensorMeta,
)

MANIFEST_NAME = "manifest.json"
INVENTORY_ATTR = "num_tensors"
"""Step-file attribute: how many datasets the writer put in it (a reader that finds fewer names the gap)."""
PARTIAL_SUFFIX = ".partial"
STATS_ONLY_METAS = "stats_only_metas"
"""Step-file dataset: the metadata of every stats-only tensor of the step, one JSON record per line
(a stats-only tensor has no values, and one dataset per tensor cost more than recording it)."""
STOPPED_ATTR = "stopped"
"""Partial step-file attribute: the exception that stopped the step on that rank (a killed rank leaves none)."""
MAX_STOPPED_CHARS = 300
STEP_FILE = re.compile(r"^rank_(\d{5})\.step_(\d{6})\.h5(\.partial)?$")

def step_file_name(rank: int, step: int) -> str:
    return f"rank_{rank:05d}.step_{step:06d}.h5"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dataset_path(key: TensorKey) -> str:
    group = "all" if key.micro_batch < 0 else f"mb_{key.micro_batch:04d}"
    call = f"@{key.call}" if key.call else ""
    return f"{key.phase}/{group}/{key.fqn or '<root>'}#{key.slot}{call}"


def key_fromdataset_path(path: str, step: int) -> TensorKey | None:
    """The key a dataset's place in its file names (the inverse of `_dataset_path`); None for a name
    ttrace does not write."""
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
    return TensorKey(step=step, micro_batch=micro_batch, phase=parts[0], fqn="" if fqn == "<root>" else fqn, slot=slot,
                     call=int(call or 0))


def pre_step_key(reader: RunReader, key: TensorKey) -> TensorKey | None:
    """Where a post-step parameter's value before the step is in `reader`: the same step's PRE_STEP_SLOT,
    else the previous step's post-step value; None for other tensors, or when neither was recorded."""
    if key.phase != "param" or key.slot != "value":
        return None
    for candidate in (dataclasses.replace(key, slot=PRE_STEP_SLOT), dataclasses.replace(key, step=key.step - 1)):
        if candidate.step >= 0 and candidate in reader.index:
            return candidate
    return None


def read_manifest(run_dir: str | os.PathLike) -> RunManifest:
    path = Path(run_dir) / MANIFEST_NAME
    if not Path(run_dir).is_dir():
        raise TraceFormatError(f"{run_dir}: no such run directory; pass the --out directory of `ttrace record`, `ttrace "
                               "example` or a Tracer")
    if not os.path.lexists(path):
        raise TraceFormatError(f"{path}: missing; this directory is not a ttrace run (or its recording never started)")
    data = data_from_json(regular_file_bytes(contained(run_dir, MANIFEST_NAME)), str(path), "manifest", "re-record the run")
    version = data.get("format_version", FORMAT_VERSION) if isinstance(data, dict) else FORMAT_VERSION
    if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        raise TraceFormatError(
            f"{path}: trace format version {version!r}, this ttrace reads versions {READABLE_FORMAT_VERSIONS}; "
            "use the ttrace version that recorded it"
        )
    if isinstance(data, dict) and (missing := [f for f in REQUIRED_MANIFEST_FIELDS if f not in data]):
        raise TraceFormatError(f"{path}: not a valid manifest (field $.{missing[0]} is missing); re-record the run")
    return record_from_data(data, RunManifest, str(path), "manifest", "re-record the run")


def _step_file_states(run_dir: Path) -> dict[int, dict[int, bool]]:
    """step -> rank -> complete, from file names alone."""
    found: dict[int, dict[int, bool]] = defaultdict(dict)
    for entry in sorted(os.listdir(run_dir)):
        if match := STEP_FILE.match(entry):
            rank, step = int(match.group(1)), int(match.group(2))
            if match.group(3) is None or rank not in found[step]:
                found[step][rank] = match.group(3) is None
    return found


def _why_partial(run_dir: Path, step: int, by_rank: dict[int, bool], world_size: int) -> str:
    """Which ranks left step `step` unfinished (a `.partial` file, and what stopped each) and which have
    no file for it at all."""
    interrupted = [r for r in range(world_size) if by_rank.get(r) is False]
    missing = [r for r in range(world_size) if r not in by_rank]
    reasons = []
    if interrupted:
        words = "; ".join(f"rank {r} {_stopped_word(run_dir, r, step)}" for r in interrupted)
        reasons.append(f"ranks {interrupted} did not finish step {step} ({words})")
    if missing:
        finished = [r for r in range(world_size) if by_rank.get(r)]
        reasons.append(f"ranks {missing} have no file for step {step} (the rank died before the step began, or its "
                       f"file was not copied){f'; ranks {finished} finished it' if finished else ''}")
    return "; ".join(reasons)


def open_step_file(path: Path, rank: int) -> h5py.File:
    """A step file opened read-only (after `contained` checked what `path` is) whose global heap HDF5 can
    read without looping (global_heap.py), or one line saying why not."""
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


def remedy_of(rank: int) -> str:
    return f"re-record rank {rank} (or copy its file again)"


def _stopped_word(run_dir: Path, rank: int, step: int) -> str:
    """What a rank's partial step file says stopped it; a file without a word was killed or lost its machine."""
    silent = "left no word: killed, or its machine died"
    path = Path(run_dir) / (step_file_name(rank, step) + PARTIAL_SUFFIX)
    try:
        with open_step_file(contained(run_dir, path.name), rank) as handle, damaged_file_errors(str(path), remedy_of(rank)):
            word = scalar_attribute(handle, STOPPED_ATTR, STRING, str(path), remedy_of(rank))
    except TtraceError:  # a file cut off mid-write is expected here: the step was interrupted
        return silent
    if isinstance(word, bytes):
        word = word.decode(errors="replace")
    if not isinstance(word, str) or not word.strip():
        return silent
    return "stopped on " + " ".join(word.split())[:MAX_STOPPED_CHARS]


def _findings_of_unfinished_step(run_dir: Path, step: int, by_rank: dict[int, bool]) -> list[Finding]:
    """The findings the files of a partial step kept (RunWriter.close writes them into a stopped step's
    file); a file cut off mid-write is expected here and gives none."""
    found = []
    for rank, complete in sorted(by_rank.items()):
        path = Path(run_dir) / (step_file_name(rank, step) + ("" if complete else PARTIAL_SUFFIX))
        try:
            with open_step_file(contained(run_dir, path.name), rank) as handle, damaged_file_errors(str(path), remedy_of(rank)):
                refuse_links(handle, str(path))
                found += findings_in_file(handle, str(path))
        except TtraceError:
            continue
    return found


def step_files(run_dir: str | os.PathLike, world_size: int) -> tuple[list[int], list[int]]:
    """(complete steps, partial steps) of a run, from file names alone: no HDF5 file is opened."""
    found = _step_file_states(Path(run_dir))
    complete = [step for step, by_rank in sorted(found.items()) if all(by_rank.get(r, False) for r in range(world_size))]
    return complete, [step for step in sorted(found) if step not in complete]


def stats_only_metas(handle: h5py.File, where: str) -> list[TensorMeta]:
    """The step file's stats-only records (STATS_ONLY_METAS), each checked like a dataset's metadata."""
    text = read_bytes_dataset(handle[STATS_ONLY_METAS], f"{where}:{STATS_ONLY_METAS}", "re-record this rank")
    return [meta_from_json(line, f"{where}:{STATS_ONLY_METAS} line {number}")
            for number, line in enumerate(text.splitlines(), start=1) if line.strip()]


def is_indexed(handle: h5py.File, path: Path, rank: int) -> bool:
    """Whether a step file keeps its tensors' metadata in a tensor index (format 4) rather than one attribute each."""
    version = scalar_attribute(handle, "format_version", INTEGER, str(path), remedy_of(rank))
    return isinstance(version, (int, np.integer)) and int(version) >= INDEXED_FORMAT


def _blind_spots_of(handle: h5py.File, path: Path, rank: int) -> dict[str, str]:
    """The modules one rank's trace could not see into (Tracer.blind_spots), from its step file."""
    try:
        blind_spots = json.loads(scalar_attribute(handle, "blind_spots", STRING, str(path), remedy_of(rank)) or "{}")
    except (TypeError, ValueError) as error:
        raise TraceFormatError(f"{path}: attribute blind_spots is not JSON ({error}); re-record rank {rank}") from error
    if not isinstance(blind_spots, dict) or not all(isinstance(v, str) for v in blind_spots.values()):
        raise TraceFormatError(f"{path}: attribute blind_spots must map module names to text; re-record rank {rank}")
    return blind_spots


def read_blind_spots(run_dir: str | os.PathLike, manifest: RunManifest, step: int) -> dict[str, str]:
    """Every blind spot of a run: the manifest's and those each rank wrote with `step` (tensors are not read)."""
    found = dict(manifest.blind_spots)
    for rank in range(manifest.world_size):
        path = contained(run_dir, step_file_name(rank, step))
        with open_step_file(path, rank) as handle:
            for fqn, why in _blind_spots_of(handle, path, rank).items():
                found.setdefault(fqn, why)
    return found


class RunReader:
    """Read-only view of a run directory: the manifest, which steps are complete, and every shard."""

    def __init__(self, run_dir: str | os.PathLike, *, subtree: str | None = None) -> None:
        """`subtree`: index only the tensors of that module and its descendants (their parameters
        included); the other datasets' metadata is never read (a 48-layer trace's full index takes seconds)."""
        self.run_dir = Path(run_dir)
        self.subtree = subtree or None
        self.manifest = read_manifest(run_dir)
        self._files: dict[tuple[int, int], h5py.File] = {}
        self.index: dict[TensorKey, list[TensorMeta]] = defaultdict(list)
        self.complete_steps: list[int] = []
        self.partial_steps: dict[int, str] = {}
        """step -> why it is not complete (which ranks were interrupted or are missing)."""
        self.misplaced: dict[TensorKey, str] = {}
        """Tensors whose metadata names another key or rank than the place they are stored at."""
        self.inventory_gaps: list[str] = []
        """Step files that hold fewer tensors than their writer recorded (INVENTORY_ATTR)."""
        self.findings: list[Finding] = []
        """What the tracer could not record, and why (findings.py), from complete and partial steps alike."""
        self.tokens: dict[TensorKey, list[TensorMeta]] = {}
        """The token positions of routed modules' pieces (TOKENS_SLOT), by the key of the expert's forward call."""
        self._scan()
        self._set_tokens_apart()

    def _set_tokens_apart(self) -> None:
        """Routed modules' token positions (TOKENS_SLOT) are metadata, not tensors to compare: kept apart."""
        for key in [key for key in self.index if key.slot == TOKENS_SLOT]:
            self.tokens[key] = self.index.pop(key)

    def _scan(self) -> None:
        found = _step_file_states(self.run_dir)
        ranks_seen = {rank for by_rank in found.values() for rank in by_rank}
        for rank in range(self.manifest.world_size):
            if rank not in ranks_seen:
                raise TraceFormatError(
                    f"{self.run_dir}: manifest says world_size {self.manifest.world_size} but there is no file of "
                    f"rank {rank} ({step_file_name(rank, 0).replace('000000', '*')}): the rank died before its first step or its "
                    "files were not copied; copy the whole run directory, or re-record if the rank died"
                )
        for step, by_rank in sorted(found.items()):
            if any(not by_rank.get(r, False) for r in range(self.manifest.world_size)):
                self.partial_steps[step] = _why_partial(self.run_dir, step, by_rank, self.manifest.world_size)
                self.findings += [f for f in _findings_of_unfinished_step(self.run_dir, step, by_rank) if self._in_subtree(f.fqn)]
                continue
            for rank in range(self.manifest.world_size):
                self._index_file(rank, step)
            self.complete_steps.append(step)

    def _index_file(self, rank: int, step: int) -> None:
        path = contained(self.run_dir, step_file_name(rank, step))
        handle = self._files[(rank, step)] = open_step_file(path, rank)
        with damaged_file_errors(str(path), remedy_of(rank)):
            self._index_open_file(handle, path, rank, step)

    def _index_open_file(self, handle: h5py.File, path: Path, rank: int, step: int) -> None:
        where = f"{path}"
        for fqn, why in _blind_spots_of(handle, path, rank).items():
            self.manifest.blind_spots.setdefault(fqn, why)
        if is_indexed(handle, path, rank):
            self._index_table(handle, path, rank, step)
            return
        metas = dataset_metas(handle, where)
        stats_only = stats_only_metas(handle, where) if metas.pop(STATS_ONLY_METAS, False) is not False else []
        if metas.pop(FINDINGS, False) is not False:
            self.findings += [f for f in findings_in_file(handle, where) if self._in_subtree(f.fqn)]
        for name, text in metas.items():
            if self._wanted(name):
                self._index_dataset(name, text, rank, step, where)
        for meta in stats_only:
            if self._wanted(dataset_path(meta.key)):
                self._index_stats_only(meta, rank, step)
        self._check_inventory(handle, path, rank, len(metas) + len(stats_only))

    def _index_table(self, handle: h5py.File, path: Path, rank: int, step: int) -> None:
        """A format-4 step file, from its tensor index (checked against the file's datasets)."""
        table = checked_rows(handle, str(path))
        self.findings += [f for f in findings_in_file(handle, str(path)) if self._in_subtree(f.fqn)]
        wanted = table.rows if self.subtree is None else \
            [row for row in table.rows if self._wanted(row.dataset or dataset_path(row.meta.key))]
        with collector_paused():  # 15k rows placed make the collector walk every object again: 1/4 of the time
            for row in wanted:
                if row.dataset is None:
                    self._index_stats_only(row.meta, rank, step)
                else:
                    self._index_row(row, rank, step, str(path))
        self.inventory_gaps += [f"{path.name}: its tensor index lists {name}, which the file does not hold"
                                for name in table.missing]
        self._check_inventory(handle, path, rank, len(table.rows) + len(table.missing))

    def _index_row(self, row: IndexRow, rank: int, step: int, where: str) -> None:
        meta = row.meta
        if meta.rank == rank and meta.key.step == step and row.dataset == dataset_path(meta.key):
            self.index[meta.key].append(meta)  # the row tells the truth (nearly always): no name to parse
            return
        placed = key_fromdataset_path(row.dataset, step)
        if placed is None:
            raise TraceFormatError(f"{where}: dataset {row.dataset} is not where ttrace writes tensors; the file was "
                                   "not written by ttrace")
        self.misplaced[placed] = (f"{placed}: the index row of the dataset in rank {rank}'s file says it is {meta.key} "
                                  f"of rank {meta.rank}")
        self.index[placed].append(dataclasses.replace(meta, key=placed, rank=rank))

    def _check_inventory(self, handle: h5py.File, path: Path, rank: int, held: int) -> None:
        written = scalar_attribute(handle, INVENTORY_ATTR, INTEGER, str(path), remedy_of(rank))
        if written is None:
            return
        written = int(written) if isinstance(written, (int, np.integer)) else repr(written)
        if written != held:
            self.inventory_gaps.append(f"{path.name} holds {held} tensors, its writer recorded {written}")

    def _index_stats_only(self, meta: TensorMeta, rank: int, step: int) -> None:
        placed = dataclasses.replace(meta.key, step=step)
        if meta.key.step != step or meta.rank != rank or not meta.stats_only:
            self.misplaced[placed] = (f"{placed}: the stats-only record in rank {rank}'s file of step {step} says it is "
                                      f"{meta.key} of rank {meta.rank}{'' if meta.stats_only else ', with values'}")
            meta = dataclasses.replace(meta, key=placed, rank=rank, stats_only=True)
        self.index[placed].append(meta)

    def _index_dataset(self, name: str, text: bytes | None, rank: int, step: int, where: str) -> None:
        if text is None:
            raise TraceFormatError(f"{where}: dataset {name} has no ttrace metadata; the file was not written by ttrace")
        meta = meta_from_json(text, f"{where}:{name}")
        placed = key_fromdataset_path(name, step)
        if placed is None:
            raise TraceFormatError(f"{where}: dataset {name} is not where ttrace writes tensors; the file was not written by ttrace")
        if placed != meta.key or meta.rank != rank:
            self.misplaced[placed] = (f"{placed}: the dataset in rank {rank}'s file says it is {meta.key} of rank {meta.rank}")
            meta = dataclasses.replace(meta, key=placed, rank=rank)
        self.index[placed].append(meta)

    def _wanted(self, dataset_path: str) -> bool:
        return self._in_subtree(dataset_path.rsplit("/", 1)[-1].split("#", 1)[0])

    def _in_subtree(self, fqn: str) -> bool:
        return in_subtree(fqn, self.subtree)

    def read(self, meta: TensorMeta, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The recorded local values of one shard, in its recorded dtype; `region` (a slice per leading
        dim): only that part, read as a hyperslab (HDF5 reads only its bytes)."""
        path = dataset_path(meta.key)
        where = f"{self.run_dir / step_file_name(meta.rank, meta.key.step)}:{path}"
        if meta.stats_only:
            raise TraceFormatError(f"{where}: recorded in stats-only mode; it holds no values")
        with damaged_file_errors(where, remedy_of(meta.rank)):
            handle = self._files[(meta.rank, meta.key.step)]
            if region is None:
                array = read_whole_values(handle, path, stored_dtype(meta.dtype), meta.local_shape, where,
                                          remedy_of(meta.rank), check=lambda dataset: refuse_external_storage(dataset, where))
            else:
                dataset = handle.get(path)
                if not isinstance(dataset, h5py.Dataset):
                    raise TraceFormatError(f"{where}: the file holds no such dataset; {remedy_of(meta.rank)}")
                refuse_external_storage(dataset.id, where)  # format 4 checks it here, not while indexing
                array = read_values(dataset, stored_dtype(meta.dtype), meta.local_shape, where, remedy_of(meta.rank), region)
            return tensor_from_array(array, meta.dtype, where)

    def keys(self) -> list[TensorKey]:
        return list(self.index)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
