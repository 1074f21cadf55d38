"""The comparison of two runs as a cached table: computed once (compare), kept as Parquet under the
candidate (compare/table.py) and reused until either run's files, the reference's tolerance
estimate or the settings change.

The same table computed by worker processes: `ttrace compare --workers N` spawns N local gloo workers,
and `ttrace compare --distributed` makes every rank of a torchrun launch one. Each worker compares its
part of the tensors (compare/partition.py); rank 0 writes the table, which the parent reads."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import pandas as pd
import torch.distributed as dist

from ttrace_core.compare import table
from ttrace_core.compare.engine import compare_runs
from ttrace_core.compare.estimate_file import estimate_files
from ttrace_core.compare.partition import compare_partitioned
from ttrace_core.compare.results import RunComparison, TensorComparison
from ttrace_core.compare.settings import CompareSettings
from ttrace_core.compare.step_scalars import tolerances_from_settings
from ttrace_core.compare.tolerances import behind_step_scalars
from ttrace_core.errors import TtraceError
from ttrace_core.format.containment import contained
from ttrace_core.format.regular_files import regular_file_bytes
from ttrace_core.format.fingerprint import installed_version
from ttrace_core.format.reader import MANIFEST_NAME, RunReader, read_manifest
from ttrace_core.format.records import data_from_record
from ttrace_core.format.schema import FORMAT_VERSION
from ttrace_core.record.launch import run_ranks


def ttrace_version() -> str:
    return installed_version("ttrace") or "0+unknown"


def run_fingerprint(run_dir: Path) -> list:
    """What a replay job depends on in a run directory: its manifest's bytes and its data files' names,
    sizes and mtimes (a candidate shared with its finished replay job finds it again: service/replays.py)."""
    manifest = regular_file_bytes(contained(run_dir, MANIFEST_NAME))
    return [hashlib.sha256(manifest).hexdigest(), [(name, *_file_stat(run_dir / name)[1:3]) for name in _data_files(run_dir)]]


def comparison_fingerprint(run_dir: Path) -> list:
    """What a cached comparison is bound to: where the run is (a copied run is compared again, and its report
    names the directories the user passed), its manifest's bytes and each data file's inode, size, mtime and
    ctime. The ctime changes on every write and cannot be set back (an mtime can), so values rewritten in
    place with the size and mtime kept still make a new fingerprint."""
    manifest = regular_file_bytes(contained(run_dir, MANIFEST_NAME))
    stats = [(name, *_file_stat(run_dir / name)) for name in _data_files(run_dir)]
    return [str(run_dir.resolve()), hashlib.sha256(manifest).hexdigest(), stats]


def _data_files(run_dir: Path) -> list[str]:
    estimates = {path.name for path in estimate_files(run_dir).values()}
    return sorted(p for p in os.listdir(run_dir) if p.endswith((".h5", ".partial")) or p in estimates)


def _file_stat(path: Path) -> tuple[int, int, int, int]:
    """(inode, size, mtime, ctime) of the file a name leads to; of the link itself when it leads nowhere (a
    loop, a dangling link: the reader refuses those with one line, the fingerprint must not fail first)."""
    try:
        info = path.stat()
    except OSError:
        info = path.lstat()
    return info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def cache_path(reference: Path, candidate: Path, settings: CompareSettings) -> tuple[Path, dict]:
    inputs = {"reference": comparison_fingerprint(reference), "candidate": comparison_fingerprint(candidate),
              "settings": settings.to_data(),
              "ttrace": ttrace_version(), "table_format": table.TABLE_FORMAT_VERSION}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    name = f"comparison-{digest}.parquet"
    own = candidate / ".ttrace" / "comparisons"
    if os.access(candidate, os.W_OK) and (not own.exists() or os.access(own, os.W_OK)):
        return own / name, inputs
    user_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ttrace" / "comparisons"
    return user_cache / name, inputs


_PROVIDER_NAMES = {"PerturbationTolerances": "perturbation estimate", "TheoremTolerances": "theorem bound",
                   "DtypeTolerances": "dtype table"}


def provider_name(tolerances: object) -> str:
    """How the Runs page and the report name the provider that judged a pair (`behind_step_scalars`)."""
    return _PROVIDER_NAMES.get(type(behind_step_scalars(tolerances)).__name__, "custom")


class RowStream(Protocol):
    """Where a comparison's rows go as they are made (comparison_jobs.RowChunkWriter)."""

    def add(self, comparison: TensorComparison, candidate: RunReader) -> None: ...

    def flush(self, candidate: RunReader) -> None: ...

    def frame_of(self, comparisons: list[TensorComparison]) -> pd.DataFrame | None:
        """The table of `comparisons` from the rows already made for the stream, None unless it holds exactly
        those, in that order."""


@dataclass(kw_only=True, slots=True)
class ComparisonTable:
    frame: pd.DataFrame
    provenance: dict
    path: Path
    cached: bool
    """True when the table was read from an earlier computation."""


def _provenance(result: RunComparison, inputs: dict, settings: CompareSettings, tolerance_kind: str, seconds: float) -> dict:
    return {
        "ttrace_version": inputs["ttrace"], "table_format": table.TABLE_FORMAT_VERSION, "trace_format": FORMAT_VERSION,
        "reference": result.reference, "candidate": result.candidate,
        "reference_manifest_sha256": inputs["reference"][1], "candidate_manifest_sha256": inputs["candidate"][1],
        "settings": settings.to_data(), "tolerance_provider": tolerance_kind,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": round(seconds, 3),
        "steps_compared": result.steps_compared, "notes": result.notes,
        "num_tensors": len(result.comparisons), "num_failed": len(result.failures),
        **data_from_record(result.summary()),
    }


@dataclass(kw_only=True, slots=True)
class CacheLookup:
    """One answer to "is this comparison cached?": both runs checked to be runs, fingerprinted once, and the
    table when it was computed with these inputs before. A page asks once and hands the answer on
    (`comparison_table`, comparison_jobs.submit_comparison), so one page load reads each manifest once."""

    path: Path
    """Where the table is, or will be written."""
    inputs: dict
    """What the table is keyed by (`cache_path`): both runs' fingerprints, the settings, the versions."""
    settings: CompareSettings
    table: ComparisonTable | None
    """The cached table; None when it must be computed."""


def lookup_table(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
                 *, read: bool = True) -> CacheLookup:
    """Whether the comparison was computed with these inputs before; `read=False` (a rebuild) only says where
    its table goes."""
    settings = settings or CompareSettings()
    reference, candidate = Path(reference), Path(candidate)
    for run_dir in (reference, candidate):
        read_manifest(run_dir)  # one clear line for a missing or foreign directory
    path, inputs = cache_path(reference, candidate, settings)
    found = None
    if read and path.is_file():
        try:
            frame, provenance = table.read_table(path)
            found = ComparisonTable(frame=frame, provenance=provenance, path=path, cached=True)
        except (OSError, ValueError):
            pass  # a damaged cache file is computed again
    return CacheLookup(path=path, inputs=inputs, settings=settings, table=found)


def cached_table(reference: str | os.PathLike, candidate: str | os.PathLike,
                 settings: CompareSettings | None = None) -> ComparisonTable | None:
    """The comparison's table if it was computed with these inputs before, else None (nothing is compared)."""
    return lookup_table(reference, candidate, settings).table


def comparison_table(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
                     *, progress: Callable[[int, int], None] | None = None, rebuild: bool = False,
                     partitioned: bool = False, stream: RowStream | None = None,
                     lookup: CacheLookup | None = None) -> ComparisonTable:
    """The comparison of two runs as a table, from the cache when its inputs are unchanged. `partitioned`:
    this process is one rank of an initialized gloo group of compare workers (compare_worker), which
    each compare a part; rank 0 writes the cache. `stream` receives every row as soon as it is compared
    (comparison_jobs.py), and is flushed before the cache is written. `lookup`: the caller's answer of
    `lookup_table` for these runs and settings, not asked again."""
    reference, candidate = Path(reference), Path(candidate)
    if lookup is None:
        lookup = lookup_table(reference, candidate, settings, read=not rebuild)
    assert settings is None or settings == lookup.settings, "a lookup made for other settings"
    settings = lookup.settings
    if lookup.table is not None and not rebuild:
        return lookup.table
    path, inputs = lookup.path, lookup.inputs
    started = time.perf_counter()
    with RunReader(reference) as ref_reader, RunReader(candidate) as cand_reader:
        tolerances = tolerances_from_settings(settings, ref_reader, cand_reader)
        if partitioned:
            result = compare_partitioned(ref_reader, cand_reader, tolerances, **settings.engine_options())
        else:
            on_row = None if stream is None else (lambda row: stream.add(row, cand_reader))
            result = compare_runs(ref_reader, cand_reader, tolerances, progress=progress, on_row=on_row,
                                  **settings.engine_options())
        frame = None
        if stream is not None:
            stream.flush(cand_reader)
            frame = stream.frame_of(result.comparisons)  # the streamed rows are the table's: not made twice
        if frame is None:
            frame = table.table_from_comparison(result, cand_reader)
    if not result.comparisons:
        raise TtraceError(f"{candidate}: no step was completed in both runs, nothing to compare")
    provenance = _provenance(result, inputs, settings, provider_name(tolerances), time.perf_counter() - started)
    try:
        if not partitioned or dist.get_rank() == 0:  # one writer of the cache among partitioned workers
            table.write_table(path, frame, provenance)
    except OSError:
        pass  # a read-only place: the table is still returned, just not kept
    return ComparisonTable(frame=frame, provenance=provenance, path=path, cached=False)


def compare_worker(config: dict) -> None:
    """A spawned worker of `ttrace compare --workers N` (launch.run_ranks): compare, and on rank 0
    write the comparison table (the cache, and a copy where the parent reads it)."""
    dist.init_process_group("gloo")
    try:
        settings = CompareSettings(**config["settings"])
        result = comparison_table(config["reference"], config["candidate"], settings, rebuild=config["rebuild"],
                                  partitioned=True)
        if dist.get_rank() == 0:  # the cache's own format: infinite ratios survive, unlike in strict JSON
            table.write_table(Path(config["out"]), result.frame, result.provenance)
    finally:
        dist.destroy_process_group()


def run_workers(reference: str, candidate: str, settings: CompareSettings, *, workers: int, rebuild: bool) -> RunComparison:
    """`ttrace compare --workers N`: N local gloo workers; the parent reads rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="ttrace-compare-") as folder:
        out = Path(folder) / "comparison.parquet"
        run_ranks("ttrace_core.service.comparisons:compare_worker",
                  {"reference": os.fspath(reference), "candidate": os.fspath(candidate), "settings": asdict(settings),
                   "rebuild": rebuild, "out": str(out)}, workers, timeout_s=24 * 3600)
        return table.comparison_from_table(*table.read_table(out))


def compare_distributed(reference: str, candidate: str, settings: CompareSettings, *, rebuild: bool) -> RunComparison | None:
    """`ttrace compare --distributed`, run by every rank of a torchrun launch: each compares its part;
    rank 0 gets the result, the others None."""
    dist.init_process_group("gloo")
    try:
        result = comparison_table(reference, candidate, settings, rebuild=rebuild, partitioned=True)
        return table.comparison_from_table(result.frame, result.provenance) if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()
