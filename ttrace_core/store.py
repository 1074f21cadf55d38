"""Trace store: stage 1 (record) writes it, stage 2 (canonicalize) reads it.

A run directory holds `manifest.json` and one HDF5 file per rank and step,
`rank_00001.step_000000.h5`. A step file is written as `<name>.partial` and renamed only after it
is complete and flushed, so a killed recording leaves every finished step readable and its
interrupted step marked partial. Datasets are uncompressed and contiguous: fp32 activations
compress by under 10% while gzip makes writing 10x slower. Every dataset carries its `TensorMeta`
as one JSON attribute. Values are raw bits: bf16 as int16, fp8 as uint8 plus its scale; nothing is
upcast. Reading never executes code: JSON and HDF5 numeric arrays only, no pickle, no torch.load.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import resource
import re
from collections import defaultdict
from pathlib import Path

import h5py
import numpy as np
import torch

from ttrace_core.containment import contained, dataset_metas, refuse_external_storage, refuse_links
from ttrace_core.errors import TraceFormatError
from ttrace_core.records import data_from_json, meta_from_json, record_from_data
from ttrace_core.schema import (
    FORMAT_VERSION, NO_MICRO_BATCH, PHASES, REQUIRED_MANIFEST_FIELDS, Layout, RunManifest, TensorKey, TensorMeta,
    TensorStats,
)

MANIFEST_NAME = "manifest.json"
WRITE_HEADROOM = 4 * 2**20
"""Bytes kept free beyond a dataset's own for HDF5's metadata and the step file's close."""
INVENTORY_ATTR = "num_tensors"
"""Step-file attribute: how many datasets the writer put in it (a reader that finds fewer names the gap)."""
PARTIAL_SUFFIX = ".partial"
_STEP_FILE = re.compile(r"^rank_(\d{5})\.step_(\d{6})\.h5(\.partial)?$")

# Dtypes stored as raw bits of an integer dtype of the same width.
_RAW_BITS = {
    "bfloat16": torch.int16,
    "float8_e4m3fn": torch.uint8,
    "float8_e5m2": torch.uint8,
    "float8_e4m3fnuz": torch.uint8,
    "float8_e5m2fnuz": torch.uint8,
}
_NATIVE = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def step_file_name(rank: int, step: int) -> str:
    return f"rank_{rank:05d}.step_{step:06d}.h5"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def array_from_tensor(value: torch.Tensor) -> np.ndarray:
    name = dtype_name(value.dtype)
    value = value.detach().cpu().contiguous()
    if name in _RAW_BITS:
        return value.view(_RAW_BITS[name]).numpy()
    if name not in _NATIVE:
        raise TypeError(f"cannot store a tensor of dtype {value.dtype}")
    return value.numpy()


def tensor_from_array(array: np.ndarray, name: str, where: str) -> torch.Tensor:
    if name in _RAW_BITS:
        return torch.from_numpy(np.asarray(array, order="C")).view(getattr(torch, name))
    if name in _NATIVE:
        return torch.from_numpy(np.asarray(array, order="C"))
    raise TraceFormatError(f"{where}: unknown dtype {name!r} in the trace; it was written by another ttrace version")


def stats_from_tensor(value: torch.Tensor) -> TensorStats:
    numel = value.numel()
    if numel == 0 or not value.is_floating_point():
        return TensorStats(numel=numel, sum=0.0, sumsq=0.0, min=0.0, max=0.0, num_nan=0, num_inf=0)
    as_float = value.detach() if value.dtype in (torch.float32, torch.float64) else value.detach().float()
    # Statistics accumulate in the tensor's own precision (fp32 at least): they summarize, the
    # comparison of values is done in float64 elsewhere.
    total = float(as_float.sum())
    if not math.isfinite(total):  # rare: only then pay for masking out NaN/Inf
        num_nan, num_inf = int(torch.isnan(as_float).sum()), int(torch.isinf(as_float).sum())
        as_float = as_float[torch.isfinite(as_float)].double()
        total = float(as_float.sum())
    else:
        num_nan = num_inf = 0
    minimum, maximum = torch.aminmax(as_float) if as_float.numel() else (torch.zeros(()), torch.zeros(()))
    sumsq = float(torch.linalg.vector_norm(as_float)) ** 2
    if not math.isfinite(sumsq):  # the norm of large fp32 values overflows fp32; the format holds finite norms
        sumsq = float(torch.linalg.vector_norm(as_float.double())) ** 2
    return TensorStats(
        numel=numel, sum=total, sumsq=sumsq,
        min=float(minimum), max=float(maximum), num_nan=num_nan, num_inf=num_inf,
    )


def _dataset_path(key: TensorKey) -> str:
    group = "all" if key.micro_batch < 0 else f"mb_{key.micro_batch:04d}"
    call = f"@{key.call}" if key.call else ""
    return f"{key.phase}/{group}/{key.fqn or '<root>'}#{key.slot}{call}"


def key_from_dataset_path(path: str, step: int) -> TensorKey | None:
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


def _meta_to_json(meta: TensorMeta) -> str:
    # Shallow conversion: dataclasses.asdict deep-copies every field and costs more than the write.
    data = {name: getattr(meta, name) for name in TensorMeta.__dataclass_fields__}
    data["key"] = {name: getattr(meta.key, name) for name in TensorKey.__dataclass_fields__}
    data["layout"] = {name: getattr(meta.layout, name) for name in Layout.__dataclass_fields__}
    data["stats"] = None if meta.stats is None else {name: getattr(meta.stats, name) for name in TensorStats.__dataclass_fields__}
    return json.dumps(data)


class RunWriter:
    """Writes one rank's step files. Only the tracer uses it."""

    def __init__(self, run_dir: str | os.PathLike, rank: int) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file: h5py.File | None = None
        self._step: int | None = None
        self._num_tensors = 0
        self._step_bytes = 0
        self.num_bytes_written = 0

    def begin_step(self, step: int) -> None:
        assert self._file is None, "a step is already open"
        final = self.run_dir / step_file_name(self.rank, step)
        final.unlink(missing_ok=True)
        self._file = h5py.File(str(final) + PARTIAL_SUFFIX, "w")
        self._file.attrs["rank"] = self.rank
        self._file.attrs["step"] = step
        self._file.attrs["format_version"] = FORMAT_VERSION
        self._step = step
        self._num_tensors = 0
        self._step_bytes = 0

    def write(self, meta: TensorMeta, value: torch.Tensor | None) -> None:
        assert self._file is not None, "write outside a step"
        data = np.zeros((0,), dtype=np.uint8) if value is None else array_from_tensor(value)
        self._check_room(data.nbytes)
        dataset = self._file.create_dataset(_dataset_path(meta.key), data=data)
        dataset.attrs["meta"] = _meta_to_json(meta)
        self.num_bytes_written += data.nbytes
        self._num_tensors += 1

    def _check_room(self, num_bytes: int) -> None:
        """Refuse a write that would fill the disk or pass the file-size limit, while HDF5 can still
        close the step file: past ENOSPC, HDF5's cache fails inside deallocators and the process can
        crash without a word (measured: a segfault)."""
        needed = num_bytes + WRITE_HEADROOM
        stats = os.statvfs(self.run_dir)
        if stats.f_bavail * stats.f_frsize < needed:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir))
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and self._step_bytes + needed > limit:
            raise OSError(errno.EFBIG, f"File too large: the file-size limit is {limit} bytes", str(self.run_dir))
        self._step_bytes += num_bytes

    def end_step(self, blind_spots: dict[str, str] | None = None) -> None:
        """`blind_spots`: module -> what this rank's trace of it misses (RunReader merges them into the manifest's)."""
        assert self._file is not None and self._step is not None
        if blind_spots:
            self._file.attrs["blind_spots"] = json.dumps(blind_spots, sort_keys=True)
        self._file.attrs[INVENTORY_ATTR] = self._num_tensors
        self._file.attrs["complete"] = True
        self._file.flush()
        self._file.close()
        final = self.run_dir / step_file_name(self.rank, self._step)
        os.replace(str(final) + PARTIAL_SUFFIX, final)
        self._file, self._step = None, None

    def close(self) -> None:
        """Close without completing an open step: it stays marked partial."""
        if self._file is not None:
            self._file.close()
            self._file = None


def write_manifest(run_dir: str | os.PathLike, manifest: RunManifest) -> None:
    path = Path(run_dir) / MANIFEST_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".json.partial")
    staging.write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
    os.replace(staging, path)


def refuse_existing_trace(run_dir: str | os.PathLike, *, manifest_only: bool = False) -> None:
    """Recording into a directory that already holds a trace would mix two runs' files.

    `manifest_only` is for rank 0 of a running recording: the other ranks may already have
    opened their first step files, so only a manifest proves an earlier run.
    """
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise TraceFormatError(f"{path}: is a file, not a directory; record into a new directory")
    earlier = path.is_dir() and ((path / MANIFEST_NAME).exists() or
                                 (not manifest_only and any(_STEP_FILE.match(p) for p in os.listdir(path))))
    if earlier:
        raise TraceFormatError(f"{path}: already holds a trace; record into a new directory, or delete this one first")


def read_manifest(run_dir: str | os.PathLike) -> RunManifest:
    path = Path(run_dir) / MANIFEST_NAME
    if not Path(run_dir).is_dir():
        raise TraceFormatError(f"{run_dir}: no such run directory; pass the --out directory of `ttrace example` or a Tracer")
    if not path.is_file():
        raise TraceFormatError(f"{path}: missing; this directory is not a ttrace run (or its recording never started)")
    data = data_from_json(contained(run_dir, MANIFEST_NAME).read_bytes(), str(path), "manifest", "re-record the run")
    version = data.get("format_version", FORMAT_VERSION) if isinstance(data, dict) else FORMAT_VERSION
    if version != FORMAT_VERSION:
        raise TraceFormatError(
            f"{path}: trace format version {version!r}, this ttrace reads version {FORMAT_VERSION}; "
            "use the ttrace version that recorded it"
        )
    if isinstance(data, dict) and (missing := [f for f in REQUIRED_MANIFEST_FIELDS if f not in data]):
        raise TraceFormatError(f"{path}: not a valid manifest (field $.{missing[0]} is missing); re-record the run")
    return record_from_data(data, RunManifest, str(path), "manifest", "re-record the run")


def _step_file_states(run_dir: Path) -> dict[int, dict[int, bool]]:
    """step -> rank -> complete, from file names alone."""
    found: dict[int, dict[int, bool]] = defaultdict(dict)
    for entry in sorted(os.listdir(run_dir)):
        if match := _STEP_FILE.match(entry):
            rank, step = int(match.group(1)), int(match.group(2))
            if match.group(3) is None or rank not in found[step]:
                found[step][rank] = match.group(3) is None
    return found


def step_files(run_dir: str | os.PathLike, world_size: int) -> tuple[list[int], list[int]]:
    """(complete steps, partial steps) of a run, from file names alone: no HDF5 file is opened."""
    found = _step_file_states(Path(run_dir))
    complete = [step for step, by_rank in sorted(found.items()) if all(by_rank.get(r, False) for r in range(world_size))]
    return complete, [step for step in sorted(found) if step not in complete]


def read_shards(run_dir: str | os.PathLike, key: TensorKey, world_size: int) -> list[tuple[TensorMeta, torch.Tensor | None]]:
    """Every rank's shard of one tensor, opening only that dataset in each rank's step file.

    Values are None for stats-only shards. A rank that did not record the key is skipped.
    """
    run_dir = Path(run_dir)
    path = _dataset_path(key)
    shards = []
    for rank in range(world_size):
        file_path = contained(run_dir, step_file_name(rank, key.step))
        where = f"{file_path}:{path}"
        try:
            with h5py.File(file_path, "r") as handle:
                refuse_links(handle, str(file_path))
                if path not in handle:
                    continue
                dataset = handle[path]
                refuse_external_storage(dataset.id, where)
                meta = meta_from_json(dataset.attrs["meta"], where)
                array = None if meta.stats_only else dataset[()]
        except (OSError, KeyError) as error:
            raise TraceFormatError(f"{where}: cannot read the dataset ({error}); the file is truncated or corrupted, "
                                   f"re-record rank {rank}") from error
        value = None if array is None else tensor_from_array(array, meta.dtype, where)
        if value is not None and tuple(value.shape) != meta.local_shape:
            raise TraceFormatError(f"{where}: stored shape {tuple(value.shape)} differs from its metadata {meta.local_shape}")
        shards.append((meta, value))
    if not shards:
        raise TraceFormatError(f"{run_dir}: no rank recorded {key}; pick a tensor the run holds (`ttrace inspect --tensors`)")
    return shards


def forward_inputs(run_dir: str | os.PathLike, rank: int, step: int, fqn: str) -> dict[int, dict[str, torch.Tensor]]:
    """{global micro-batch: {slot: value}} of the forward inputs one rank recorded for one module,
    reading only those datasets (names are listed, nothing else is opened)."""
    path = contained(run_dir, step_file_name(rank, step))
    prefix = f"{fqn or '<root>'}#input."
    calls: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    try:
        with h5py.File(path, "r") as handle:
            refuse_links(handle, str(path))
            forward = handle.get("forward")
            for group_name in (sorted(forward) if forward is not None else []):
                group = forward[group_name]
                for name in group:
                    if name.startswith(prefix):
                        refuse_external_storage(group[name].id, f"{path}:forward/{group_name}/{name}")
                        meta = meta_from_json(group[name].attrs["meta"], f"{path}:forward/{group_name}/{name}")
                        calls[meta.key.micro_batch][meta.key.slot] = tensor_from_array(group[name][()], meta.dtype, str(path))
    except OSError as error:
        raise TraceFormatError(f"{path}: not a readable HDF5 file ({error}); it is truncated or corrupted, "
                               f"re-record rank {rank}") from error
    return dict(calls)


def _blind_spots_of(handle: h5py.File, path: Path, rank: int) -> dict[str, str]:
    """The modules one rank's trace could not see into (Tracer.blind_spots), from its step file."""
    try:
        blind_spots = json.loads(handle.attrs.get("blind_spots", "{}"))
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
        try:
            with h5py.File(path, "r") as handle:
                for fqn, why in _blind_spots_of(handle, path, rank).items():
                    found.setdefault(fqn, why)
        except OSError as error:
            raise TraceFormatError(f"{path}: not a readable HDF5 file ({error}); re-record rank {rank}") from error
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
        self._scan()

    def _scan(self) -> None:
        found = _step_file_states(self.run_dir)
        ranks_seen = {rank for by_rank in found.values() for rank in by_rank}
        for rank in range(self.manifest.world_size):
            if rank not in ranks_seen:
                raise TraceFormatError(
                    f"{self.run_dir}: manifest says world_size {self.manifest.world_size} but there is no file of "
                    f"rank {rank} ({step_file_name(rank, 0).replace('000000', '*')}); copy the whole run directory"
                )
        for step, by_rank in sorted(found.items()):
            interrupted = [r for r in range(self.manifest.world_size) if not by_rank.get(r, False)]
            if interrupted:
                self.partial_steps[step] = f"ranks {interrupted} did not finish step {step} (recording interrupted)"
                continue
            for rank in range(self.manifest.world_size):
                self._index_file(rank, step)
            self.complete_steps.append(step)

    def _index_file(self, rank: int, step: int) -> None:
        path = contained(self.run_dir, step_file_name(rank, step))
        try:
            handle = h5py.File(path, "r")
        except OSError as error:
            reason = str(error).split("(")[0].strip() or "unreadable"
            raise TraceFormatError(
                f"{path}: not a readable HDF5 file ({reason}); it is truncated or corrupted, re-record rank {rank}"
            ) from error
        self._files[(rank, step)] = handle
        where = f"{path}"
        for fqn, why in _blind_spots_of(handle, path, rank).items():
            self.manifest.blind_spots.setdefault(fqn, why)

        try:
            metas = dataset_metas(handle, where)
        except (OSError, RuntimeError, KeyError, ValueError) as error:
            raise TraceFormatError(f"{path}: corrupted HDF5 structure ({error}); re-record rank {rank}") from error
        for name, text in metas.items():
            if self._wanted(name):
                self._index_dataset(name, text, rank, step, where)
        written = handle.attrs.get(INVENTORY_ATTR)
        if written is None:
            return
        written = int(written) if isinstance(written, (int, np.integer)) else repr(written)
        if written != len(metas):
            self.inventory_gaps.append(f"{path.name} holds {len(metas)} tensors, its writer recorded {written}")

    def _index_dataset(self, name: str, text: bytes | None, rank: int, step: int, where: str) -> None:
        if text is None:
            raise TraceFormatError(f"{where}: dataset {name} has no ttrace metadata; the file was not written by ttrace")
        meta = meta_from_json(text, f"{where}:{name}")
        placed = key_from_dataset_path(name, step)
        if placed is None:
            raise TraceFormatError(f"{where}: dataset {name} is not where ttrace writes tensors; the file was not written by ttrace")
        if placed != meta.key or meta.rank != rank:
            self.misplaced[placed] = (f"{placed}: the dataset in rank {rank}'s file says it is {meta.key} of rank {meta.rank}")
            meta = dataclasses.replace(meta, key=placed, rank=rank)
        self.index[placed].append(meta)

    def _wanted(self, dataset_path: str) -> bool:
        if self.subtree is None:
            return True
        fqn = dataset_path.rsplit("/", 1)[-1].split("#", 1)[0]
        return fqn == self.subtree or fqn.startswith(self.subtree + ".")

    def read(self, meta: TensorMeta) -> torch.Tensor:
        """The recorded local values of one shard, in its recorded dtype."""
        path = _dataset_path(meta.key)
        where = f"{self.run_dir / step_file_name(meta.rank, meta.key.step)}:{path}"
        if meta.stats_only:
            raise TraceFormatError(f"{where}: recorded in stats-only mode; it holds no values")
        try:
            array = self._files[(meta.rank, meta.key.step)][path][()]
        except (OSError, KeyError) as error:
            raise TraceFormatError(f"{where}: cannot read the dataset ({error}); the file is corrupted, re-record it") from error
        value = tensor_from_array(array, meta.dtype, where)
        if tuple(value.shape) != meta.local_shape:
            raise TraceFormatError(f"{where}: stored shape {tuple(value.shape)} differs from its metadata {meta.local_shape}")
        return value

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
