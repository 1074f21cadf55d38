"""The recording side of the trace format: one rank's step files and the run's manifest, as
docs/trace-format.md describes them (reader.py reads them back).

A step file is written as `<name>.partial` and renamed only once complete and flushed, so a killed
recording keeps every finished step. Values are stored dtype-exact (bf16 as int16 bits, fp8 as
uint8), uncompressed and contiguous. A write that would not fit on the disk, or past the file-size
limit, is refused while the file can still be closed (`RunWriter._check_room`).

Format 5: a step's values are packed (packs.py). A tensor of at least OWN_PACK_BYTES is a pack of its own,
written as it is recorded; smaller ones are copied into one buffer of PACK_BYTES, written as one pack
when it is full or the step ends, so a small tensor costs a copy in memory instead of an HDF5 dataset.
Every tensor's metadata is one row of the step's tensor index (tensor_index.py) with its pack and
offset, written when the step ends (and, best effort, when a stopped step is closed). A tensor recorded
again in the same step with the same bytes (same_storage.py) is a second row naming the same span.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import resource
from pathlib import Path

import h5py
import msgspec
import numpy as np
import torch

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.findings import FINDINGS
from ttrace_core.format.schema import FORMAT_VERSION, Finding, RunManifest, TensorMeta, TensorStats
from ttrace_core.format.datasets import NATIVE_DTYPES, RAW_BITS
from ttrace_core.format.packs import OWN_PACK_BYTES, PACK_BYTES, aligned, pack_path
from ttrace_core.format.same_storage import WrittenStorages
from ttrace_core.format.tensor_index import LINKS_ATTR, TENSOR_INDEX, row_line
from ttrace_core.format.reader import (
    INVENTORY_ATTR, MANIFEST_NAME, MAX_STOPPED_CHARS, PARTIAL_SUFFIX, STEP_FILE, STOPPED_ATTR, dataset_path, dtype_name, step_file_name,
)

WRITE_HEADROOM = 4 * 2**20
"""Bytes kept free beyond a dataset's own for HDF5's metadata and the step file's close."""
ROOM_RECHECK = 64 * 2**20
"""Free space is measured again after at most this many bytes, or 1/8 of what was free, are written."""


def array_from_tensor(value: torch.Tensor) -> np.ndarray:
    name = dtype_name(value.dtype)
    value = value.detach().cpu().contiguous()
    if name in RAW_BITS:
        return value.view(RAW_BITS[name]).numpy()
    if name not in NATIVE_DTYPES:
        raise TypeError(f"cannot store a tensor of dtype {value.dtype}")
    return value.numpy()


def stats_from_tensor(value: torch.Tensor) -> TensorStats:
    """Sum, sum of squares, min and max in the tensor's own precision (fp32 at least): they summarize, the
    comparison of values is done in float64 elsewhere. Eager torch has no kernel that fuses the four, so
    this is four reductions, each of which reads the tensor once (on CPU the fastest mix measured,
    benchmarks/tensor_statistics.py); NaN and Inf are counted, and masked out, only when the sum says
    there are any."""
    numel = value.numel()
    if numel == 0 or not value.is_floating_point():
        return TensorStats(numel=numel, sum=0.0, sumsq=0.0, min=0.0, max=0.0, num_nan=0, num_inf=0)
    as_float = value.detach() if value.dtype in (torch.float32, torch.float64) else value.detach().float()
    total = float(as_float.sum())
    num_nan = num_inf = 0
    if not math.isfinite(total):  # rare: only then pay for masking out NaN/Inf
        num_nan, num_inf = int(torch.isnan(as_float).sum()), int(torch.isinf(as_float).sum())
        as_float = as_float[torch.isfinite(as_float)].double()
        total = float(as_float.sum())
    minimum, maximum = _min_max(as_float)
    sumsq = float(torch.linalg.vector_norm(as_float)) ** 2
    if not math.isfinite(sumsq):  # the norm of large fp32 values overflows fp32; the format holds finite norms
        sumsq = float(torch.linalg.vector_norm(as_float.double())) ** 2
    return TensorStats(numel=numel, sum=total, sumsq=sumsq, min=minimum, max=maximum, num_nan=num_nan, num_inf=num_inf)


def _min_max(value: torch.Tensor) -> tuple[float, float]:
    """On CPU amin and amax apart: each is a vectorized pass, and from about 64k elements on the two take
    0.8x-0.9x of one aminmax over a contiguous tensor, and far less over a strided one (below that, one
    call less would save about 1 us; benchmarks/tensor_statistics.py, torch 2.13). Elsewhere (not measured)
    the one pass of aminmax over a contiguous tensor, as before. 0.0 and 0.0 for an empty tensor (every
    element was NaN or Inf)."""
    if not value.numel():
        return 0.0, 0.0
    if value.device.type != "cpu" and value.is_contiguous():
        minimum, maximum = torch.aminmax(value)
        return float(minimum), float(maximum)
    return float(value.amin()), float(value.amax())


_META_ENCODER = msgspec.json.Encoder()


def _finding_to_json(meta: Finding) -> bytes:
    """One line of FINDINGS (records.finding_from_json reads it back): every field, finite numbers."""
    return _META_ENCODER.encode(meta)


_EMPTY = np.zeros((0,), dtype=np.uint8)
_LINK_CREATE = h5py.h5p.create(h5py.h5p.LINK_CREATE)
_LINK_CREATE.set_create_intermediate_group(True)
_SCALAR = h5py.h5s.create(h5py.h5s.SCALAR)


def _write_dataset(handle: h5py.File, path: str, data: np.ndarray) -> None:
    """One uncompressed contiguous dataset, through HDF5's low-level API: the same file as
    `create_dataset`, at a third of the Python cost."""
    space = h5py.h5s.create_simple(data.shape) if data.shape else _SCALAR
    dataset = h5py.h5d.create(handle.id, path.encode(), h5py.h5t.py_create(data.dtype, logical=True), space,
                              lcpl=_LINK_CREATE)
    if data.size:
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))


class RunWriter:
    """Writes one rank's step files. Only the tracer uses it."""

    def __init__(self, run_dir: str | os.PathLike, rank: int) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file: h5py.File | None = None
        self._step: int | None = None
        self._rows: list[bytes] = []
        """The step's tensor index so far, one encoded `IndexRow` per tensor."""
        self._findings: list[bytes] = []
        self._written = WrittenStorages()
        self._places: dict[str, tuple[int, int]] = {}
        """The step's tensors so far -> (pack, offset) of their bytes, for a second record of the same bytes."""
        self._num_packs = 0
        self._gathering: int | None = None
        """The pack the gathering buffer will be written as; None while it holds nothing."""
        self._buffer: np.ndarray | None = None
        """The gathering buffer (PACK_BYTES, allocated at the first small tensor and kept from step to step)."""
        self._fill = 0
        self._step_links = 0
        self._step_bytes = 0
        self.num_bytes_written = 0
        self.num_links_written = 0
        """Tensors stored as a hard link to the same bytes written earlier in their step."""
        self.num_link_bytes = 0
        """The bytes those links did not write again."""
        self._unchecked_allowance = 0
        """Bytes that may still be written before free space is measured again."""

    def begin_step(self, step: int) -> None:
        assert self._file is None, "a step is already open"
        final = self.run_dir / step_file_name(self.rank, step)
        final.unlink(missing_ok=True)
        self._file = h5py.File(str(final) + PARTIAL_SUFFIX, "w")
        self._file.attrs["rank"] = self.rank
        self._file.attrs["step"] = step
        self._file.attrs["format_version"] = FORMAT_VERSION
        self._step = step
        self._step_bytes = 0
        self._unchecked_allowance = 0  # every step starts with a fresh look at the free space
        self._rows = []
        self._findings = []
        self._written.clear()
        self._places.clear()
        self._num_packs, self._gathering, self._fill = 0, None, 0
        self._step_links = 0

    def add_finding(self, finding: Finding) -> None:
        """A tensor this step leaves out, and why; stored with the step (FINDINGS), even when it stays partial."""
        assert self._file is not None, "a finding outside a step"
        self._findings.append(_finding_to_json(finding))

    def write(self, meta: TensorMeta, value: torch.Tensor | None, *, deduplicate: bool = True) -> None:
        """A tensor's values and metadata; a stats-only one (no `value`) is a row of the index alone.
        `deduplicate`: link `value` to a dataset of this step holding the same bytes (same_storage.py);
        a caller that hands over a copy (background_writer.py) checks the original itself."""
        assert self._file is not None, "write outside a step"
        if value is None and meta.stats_only:
            self._rows.append(row_line(None, meta))
            return
        path = dataset_path(meta.key)
        checked = deduplicate and value is not None
        identity, first = self._written.first_dataset(value, meta.stats) if checked else (None, None)
        if first is not None:
            self.write_link(meta, first, value.numel() * value.element_size())
            return
        data = _EMPTY if value is None else array_from_tensor(value)
        pack, offset = self._places[path] = self._store(data.reshape(-1).view(np.uint8))
        self._rows.append(row_line(path, meta, pack, offset))
        self.num_bytes_written += data.nbytes
        if value is not None:
            self._written.remember(identity, value, path, meta.stats)

    def _store(self, raw: np.ndarray) -> tuple[int, int]:
        """(pack, offset) of `raw`'s bytes (uint8): a pack of its own when it is large, else a place in the
        gathering buffer, which is written as a pack first when it has no room left."""
        if raw.nbytes >= OWN_PACK_BYTES:
            self._check_room(raw.nbytes)
            number = self._num_packs
            self._num_packs += 1
            _write_dataset(self._file, pack_path(number), raw)
            return number, 0
        offset = aligned(self._fill) if raw.nbytes else self._fill
        if self._gathering is None or offset + raw.nbytes > PACK_BYTES:
            self._write_gathered()
            self._gathering, offset = self._num_packs, 0
            self._num_packs += 1
        if raw.nbytes:
            if self._buffer is None:
                self._buffer = np.empty(PACK_BYTES, dtype=np.uint8)
            self._buffer[offset:offset + raw.nbytes] = raw
            self._fill = offset + raw.nbytes
        return self._gathering, offset

    def _write_gathered(self) -> None:
        """The gathering buffer as its pack, when it holds any tensor."""
        if self._gathering is not None:
            self._check_room(self._fill)
            gathered = _EMPTY if self._buffer is None else self._buffer[:self._fill]
            _write_dataset(self._file, pack_path(self._gathering), gathered)
            self._gathering, self._fill = None, 0

    def write_link(self, meta: TensorMeta, first: str, num_bytes: int) -> None:
        """A tensor whose bytes were written earlier in this step as tensor `first` (`num_bytes` of them)."""
        assert self._file is not None, "write outside a step"
        path = dataset_path(meta.key)
        self._rows.append(row_line(path, meta, *self._places[first]))
        self.num_links_written += 1
        self._step_links += 1
        self.num_link_bytes += num_bytes

    def _check_room(self, num_bytes: int) -> None:
        """Refuse a write that would fill the disk or pass the file-size limit, while HDF5 can still
        close the step file: past ENOSPC, HDF5's cache fails inside deallocators and the process can
        crash without a word (measured: a segfault)."""
        needed = num_bytes + WRITE_HEADROOM
        if self._unchecked_allowance < num_bytes:  # statvfs only once the allowance since the last one is spent
            stats = os.statvfs(self.run_dir)
            free = stats.f_bavail * stats.f_frsize
            if free < needed:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir))
            # Other ranks may fill the same disk meanwhile: write at most 1/8 of the free space unchecked.
            self._unchecked_allowance = min(ROOM_RECHECK, (free - needed) // 8)
        self._unchecked_allowance -= num_bytes
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and self._step_bytes + needed > limit:
            raise OSError(errno.EFBIG, f"File too large: the file-size limit is {limit} bytes", str(self.run_dir))
        self._step_bytes += num_bytes

    def end_step(self, blind_spots: dict[str, str] | None = None) -> None:
        """`blind_spots`: module -> what this rank's trace of it misses (RunReader merges them into the manifest's)."""
        assert self._file is not None and self._step is not None
        # Even empty: a rank that held none of the traced modules (a pipeline stage without the module
        # `ttrace localize --module` replays) completes a step of no tensors, which the reader must find.
        self._write_gathered()
        self._write_rows_dataset(TENSOR_INDEX, self._rows, even_empty=True)
        self._write_rows_dataset(FINDINGS, self._findings)
        if blind_spots:
            self._file.attrs["blind_spots"] = json.dumps(blind_spots, sort_keys=True)
        self._file.attrs[INVENTORY_ATTR] = len(self._rows)
        self._file.attrs[LINKS_ATTR] = self._step_links
        self._file.attrs["complete"] = True
        self._file.flush()
        self._file.close()
        final = self.run_dir / step_file_name(self.rank, self._step)
        os.replace(str(final) + PARTIAL_SUFFIX, final)
        self._file, self._step = None, None
        self._written.clear()  # links stay within a step; hold no weak reference to training's storages past it
        self._places.clear()

    def _write_rows_dataset(self, name: str, rows: list[bytes], *, even_empty: bool = False) -> None:
        """The tensor index or the findings: JSON lines as one uint8 dataset (none when there is no row,
        unless `even_empty`)."""
        if (rows or even_empty) and name not in self._file:  # a step whose end failed half-way is closed with what it has
            text = b"\n".join(rows)
            self._check_room(len(text))
            self._file.create_dataset(name, data=np.frombuffer(text, dtype=np.uint8))

    def close(self, why: str = "") -> None:
        """Close without completing an open step: it stays marked partial, with `why` (the exception
        that stopped the step) in its STOPPED_ATTR, its findings so far and the index of the tensors it
        holds, when the file still takes them (a killed recording leaves a partial file without them)."""
        if self._file is not None:
            try:
                if why:
                    self._file.attrs[STOPPED_ATTR] = why[:MAX_STOPPED_CHARS]
                self._write_rows_dataset(FINDINGS, self._findings)
                self._write_gathered()
                self._write_rows_dataset(TENSOR_INDEX, self._rows)
            except Exception:  # best effort: a full disk may refuse the word, never the close
                pass
            finally:
                self._file.close()
                self._file = None
        self._written.clear()

    def stop(self) -> None:
        """Nothing to stop: this writer writes on the caller's thread (background_writer.py's does not)."""


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
                                 (not manifest_only and any(STEP_FILE.match(p) for p in os.listdir(path))))
    if earlier:
        raise TraceFormatError(f"{path}: already holds a trace; record into a new directory, or delete this one first")


def write_failure(run_dir: Path, rank: int, step: int, error: Exception) -> str:
    """The one line a recording stops with when a step cannot be written (a full disk, a file-size limit)."""
    # HDF5 reports "... errno = 28, error message = 'No space left on device', ..." over several lines
    reason = getattr(error, "strerror", None) or next(iter(re.findall(r"error message = '([^']*)'", str(error))), None) \
        or (str(error).splitlines() or [type(error).__name__])[0][:200]
    remedy = "Free space (or raise the file-size limit) and record again" if isinstance(error, OSError) else \
        f"A ttrace bug ({type(error).__name__}): report it with this line"
    return (f"ttrace: {run_dir}: cannot write step {step} of rank {rank} ({reason}); recording stopped for the rest of "
            "the run and training goes on. The steps finished before it are complete and kept, this one is left "
            f"partial. {remedy}")
