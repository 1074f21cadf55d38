"""Trace store: stage 1 (record) writes it (writer.py), stage 2 (canonicalize) reads it here.

A run directory holds `manifest.json` and one HDF5 file per rank and step,
`rank_00001.step_000000.h5`. A step file is written as `<name>.partial` and renamed only after it
is complete and flushed, so a killed recording leaves every finished step readable and its
interrupted step marked partial. `RunReader` reads the manifest, tells complete steps from partial
ones by the files' names, and opens every step file through one wall, step_file.py's `open_step`,
which checks the file once (containment, regular file, links, attributes, the tensor index against
the datasets) and reads its values on demand. Reading never executes code: JSON and HDF5 numeric
arrays only, no pickle, no torch.load.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np
import torch

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.containment import contained
from ttrace_core.format.datasets import tensor_from_array  # noqa: F401 - re-exported: readers of raw arrays
from ttrace_core.format.fingerprint import DISTRIBUTIONS, installed_version
from ttrace_core.format.naming import in_subtree
from ttrace_core.format.packs import coalesced_runs
from ttrace_core.format.records import data_from_json, record_from_data
from ttrace_core.format.regular_files import regular_file_bytes
from ttrace_core.format.schema import (
    FORMAT_VERSION, PRE_STEP_SLOT, READABLE_FORMAT_VERSIONS, REQUIRED_MANIFEST_FIELDS, Finding, RunManifest, TOKENS_SLOT,
    TensorKey, TensorMeta,
)
from ttrace_core.format.step_file import (  # noqa: F401 - the step file's names, re-exported for the writer and tools
    INVENTORY_ATTR, MAX_STOPPED_CHARS, PARTIAL_SUFFIX, STATS_ONLY_METAS, STEP_FILE, STOPPED_ATTR, StepFile, dataset_path,
    open_step, remedy_of, step_file_name,
)
from ttrace_core.format.tensor_index import collector_paused

MANIFEST_NAME = "manifest.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pre_step_key(reader: RunReader, key: TensorKey) -> TensorKey | None:
    """Where a post-step parameter's value before the step is in `reader`: the same step's PRE_STEP_SLOT,
    else the previous step's post-step value; None for other tensors, or when neither was recorded."""
    if key.phase != "param" or key.slot != "value":
        return None
    for candidate in (msgspec.structs.replace(key, slot=PRE_STEP_SLOT), msgspec.structs.replace(key, step=key.step - 1)):
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
    recorded_by = _recorded_by(data)
    if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        newer = isinstance(version, int) and not isinstance(version, bool) and version > max(READABLE_FORMAT_VERSIONS)
        raise TraceFormatError(
            f"{path}: trace format version {version!r}, this ttrace reads versions {READABLE_FORMAT_VERSIONS}; "
            + (_other_version_remedy(recorded_by) if recorded_by else
               "upgrade ttrace to read it" if newer else "use the ttrace version that recorded it")
        )
    remedy = _other_version_remedy(recorded_by) if recorded_by else "re-record the run"
    if isinstance(data, dict) and (missing := [f for f in REQUIRED_MANIFEST_FIELDS if f not in data]):
        raise TraceFormatError(f"{path}: not a valid manifest (field $.{missing[0]} is missing); {remedy}")
    return record_from_data(data, RunManifest, str(path), "manifest", remedy)


def _recorded_by(data: object) -> str | None:
    """The ttrace version a manifest's fingerprint names, when it is not this one's: a field this ttrace
    does not know, or a format it does not read, then most likely comes from that version (None: the same
    version, or none named)."""
    environment = data.get("environment") if isinstance(data, dict) else None
    packages = environment.get("packages") if isinstance(environment, dict) else None
    recorded = packages.get("ttrace") if isinstance(packages, dict) else None
    if not isinstance(recorded, str) or not recorded or len(recorded) > 64 or recorded == installed_version("ttrace"):
        return None
    return recorded


def _other_version_remedy(recorded: str) -> str:
    ours = installed_version("ttrace") or "not installed as a package"
    return (f"it was recorded by ttrace {recorded!r} and this is ttrace {ours}: read it with ttrace {recorded!r} or newer "
            f"(pip install -U {DISTRIBUTIONS['ttrace']}), or re-record the run with this one")


def _step_file_states(run_dir: Path) -> dict[int, dict[int, bool]]:
    """step -> rank -> complete, from file names alone."""
    found: dict[int, dict[int, bool]] = defaultdict(dict)
    for entry in sorted(os.listdir(run_dir)):
        if match := STEP_FILE.match(entry):
            rank, step = int(match.group(1)), int(match.group(2))
            if match.group(3) is None or rank not in found[step]:
                found[step][rank] = match.group(3) is None
    return found


def _why_partial(leftovers: dict[int, StepFile], step: int, by_rank: dict[int, bool], world_size: int) -> str:
    """Which ranks left step `step` unfinished (a `.partial` file, and what stopped each) and which have
    no file for it at all."""
    interrupted = [r for r in range(world_size) if by_rank.get(r) is False]
    missing = [r for r in range(world_size) if r not in by_rank]
    reasons = []
    if interrupted:
        words = "; ".join(f"rank {r} {leftovers[r].stopped}" for r in interrupted)
        reasons.append(f"ranks {interrupted} did not finish step {step} ({words})")
    if missing:
        finished = [r for r in range(world_size) if by_rank.get(r)]
        reasons.append(f"ranks {missing} have no file for step {step} (the rank died before the step began, or its "
                       f"file was not copied){f'; ranks {finished} finished it' if finished else ''}")
    return "; ".join(reasons)


def step_files(run_dir: str | os.PathLike, world_size: int) -> tuple[list[int], list[int]]:
    """(complete steps, partial steps) of a run, from file names alone: no HDF5 file is opened."""
    found = _step_file_states(Path(run_dir))
    complete = [step for step, by_rank in sorted(found.items()) if all(by_rank.get(r, False) for r in range(world_size))]
    return complete, [step for step in sorted(found) if step not in complete]


def read_blind_spots(run_dir: str | os.PathLike, manifest: RunManifest, step: int) -> dict[str, str]:
    """Every blind spot of a run: the manifest's and those each rank wrote with `step` (tensors are not read)."""
    found = dict(manifest.blind_spots)
    for rank in range(manifest.world_size):
        with open_step(run_dir, rank, step, tensors=False) as step_file:
            for fqn, why in step_file.blind_spots.items():
                found.setdefault(fqn, why)
    return found


class RunReader:
    """Read-only view of a run directory: the manifest, which steps are complete, and every shard.
    Every step file is opened through step_file.py's wall, once."""

    def __init__(self, run_dir: str | os.PathLike, *, subtree: str | None = None) -> None:
        """`subtree`: index only the tensors of that module and its descendants (their parameters
        included); the other datasets' metadata is never read (a 48-layer trace's full index takes seconds)."""
        self.run_dir = Path(run_dir)
        self.subtree = subtree or None
        self.manifest = read_manifest(run_dir)
        self._files: dict[tuple[int, int], StepFile] = {}
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
        try:
            # the collector, run as the index grows, would walk every object again at each of its full
            # collections (a fifth of opening a 400-layer pair); opening forms no cycle worth collecting
            with collector_paused():
                self._scan()
        except BaseException:
            self.close()
            raise
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
                leftovers = {rank: open_step(self.run_dir, rank, step, complete=complete, unfinished=True)
                             for rank, complete in sorted(by_rank.items())}
                self.partial_steps[step] = _why_partial(leftovers, step, by_rank, self.manifest.world_size)
                self.findings += [f for left in leftovers.values() for f in left.findings if self._in_subtree(f.fqn)]
                continue
            for rank in range(self.manifest.world_size):
                self._add(open_step(self.run_dir, rank, step, wanted=self._wanted if self.subtree else None))
            self.complete_steps.append(step)

    def _add(self, step_file: StepFile) -> None:
        self._files[(step_file.rank, step_file.step)] = step_file
        for fqn, why in step_file.blind_spots.items():
            self.manifest.blind_spots.setdefault(fqn, why)
        self.findings += [f for f in step_file.findings if self._in_subtree(f.fqn)]
        self.misplaced.update(step_file.misplaced)
        self.inventory_gaps += step_file.inventory_gaps
        index = self.index
        with collector_paused():
            for meta in step_file.metas:
                index[meta.key].append(meta)

    def _wanted(self, dataset_path: str) -> bool:
        return self._in_subtree(dataset_path.rsplit("/", 1)[-1].split("#", 1)[0])

    def _in_subtree(self, fqn: str) -> bool:
        return in_subtree(fqn, self.subtree)

    def read(self, meta: TensorMeta, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The recorded local values of one shard, in its recorded dtype; `region` (a slice per leading
        dim): only that part (only its bytes are read)."""
        return self._files[(meta.rank, meta.key.step)].read(meta, region)

    def read_raw(self, metas: list[TensorMeta]) -> tuple[np.ndarray, list[int | None]]:
        """The stored bytes of many whole shards in one buffer, the shards lying close together in a file read
        with one `pread` (packs.coalesced_runs): each shard's byte offset in the buffer, a multiple of 8 (any
        stored dtype views it aligned), or None for a shard not read this way (up to format 4, or a run the file
        could not give whole: `read` reads it, and words what is wrong)."""
        offsets: list[int | None] = [None] * len(metas)
        by_file: dict[tuple[int, int], list[int]] = {}
        for index, meta in enumerate(metas):
            by_file.setdefault((meta.rank, meta.key.step), []).append(index)
        runs, total = [], 0
        for place, indices in by_file.items():
            step_file = self._files[place]
            spans = step_file.spans_of([metas[index] for index in indices])
            placed = [(index, span) for index, span in zip(indices, spans) if span is not None]
            for first, nbytes, members in coalesced_runs([span for _, span in placed]):
                runs.append((step_file, first, nbytes, total, [(placed[m][0], placed[m][1][0] - first) for m in members]))
                total += -(-nbytes // 8) * 8
        buffer = np.empty(total, dtype=np.uint8)
        for step_file, first, nbytes, at, members in runs:
            if step_file.read_run(buffer[at:at + nbytes], first):
                for index, relative in members:
                    offsets[index] = at + relative
        return buffer, offsets

    def keys(self) -> list[TensorKey]:
        return list(self.index)

    def close(self) -> None:
        for step_file in self._files.values():
            step_file.close()
        self._files.clear()

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
