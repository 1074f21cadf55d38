"""The one facade over the stages, for the CLI and the dashboard alike.

- `find_runs(root)`: every run directory under a root, from its manifest and file names only;
- `comparison(ref, cand)`: the comparison table (table.py), computed once and cached as Parquet
  under the candidate until one of its inputs changes; `run_comparison` is the same as a
  `RunComparison`, which the CLI renders;
- `tensor_view(ref, cand, tensor, step, micro_batch)`: one tensor's canonical arrays, their
  difference and the per-rank shard map, read from the few datasets that hold it;
- `submit_replay(ref, cand, module)`: a localization replay as a job (jobs.py), cached by its
  inputs; `localization(job)` reads its verdict;
- `path_under_root(root, relative)`: a user-given path confined to the root (the dashboard serves
  only files under it).

Pages and the CLI call these, never the stages directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from ttrace_core import table
from ttrace_core.jobs import Job, JobFileError, JobSpec, submit
from ttrace_core.compare import RunComparison, compare_runs
from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.estimate import estimate_files
from ttrace_core.dashboard import ROOT_ENV
from ttrace_core.schema import FORMAT_VERSION
from ttrace_core.table import KINDS
from ttrace_core.store import MANIFEST_NAME, RunReader, read_blind_spots, read_manifest, step_files
from ttrace_core.tensor_view import TensorView, build_tensor_view
from ttrace_core.tolerances import (
    DEFAULT_ALPHA, DEFAULT_EXACT_INPUTS_K, DEFAULT_THEOREM_C, DEFAULT_THEOREM_K, TOLERANCE_KINDS, select_tolerances,
)

__all__ = ["KINDS", "ROOT_ENV", "CompareSettings", "TtraceError", "ComparisonTable", "Job", "RunInfo", "TensorView", "comparison", "comparison_table",
           "find_runs", "localization", "path_under_root", "replay_job", "run_info", "run_comparison", "submit_replay", "tensor_view",
           "ttrace_version"]

# Directories of a run that hold derived data, not runs to list (replays are listed by the localizer).
_DERIVED_DIRS = (".ttrace", ".localize")


def ttrace_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ttrace")
    except PackageNotFoundError:
        return "0+unknown"


MIN_MAX_MEMORY = 2**20
"""The smallest budget `CompareSettings.max_memory` takes."""


@dataclass(kw_only=True, slots=True)
class CompareSettings:
    """How tensors are judged; the CLI's compare flags map one to one onto these fields."""

    tolerance: str = "auto"
    """auto | perturbation | theorem | dtype (tolerances.py)."""
    alpha: float = DEFAULT_ALPHA
    """perturbation: tolerance = alpha x deviation."""
    theorem_k: float = DEFAULT_THEOREM_K
    theorem_c: float = DEFAULT_THEOREM_C
    exact_inputs_k: float = DEFAULT_EXACT_INPUTS_K
    """k of the exact-inputs rule, 0 turns it off."""
    ignore_dtype: bool = False
    partial: bool = False
    """Give a verdict on what was recorded when the evidence is incomplete ("partial", not "incomplete")."""
    max_memory: int | None = None
    """Bytes one tensor's comparison may take; a larger tensor is compared slab by slab (bounded.py).
    None: unbounded."""

    def __post_init__(self) -> None:
        if self.tolerance not in TOLERANCE_KINDS:
            raise TtraceError(f"tolerance {self.tolerance!r}: choose from {', '.join(TOLERANCE_KINDS)}")
        if self.max_memory is not None and self.max_memory < MIN_MAX_MEMORY:
            raise TtraceError(f"max_memory {self.max_memory} bytes is too small to compare anything; "
                              f"give at least {MIN_MAX_MEMORY // 2**20} MiB")


@dataclass(kw_only=True, slots=True)
class RunInfo:
    """One run directory under a root, from its manifest (tensors are not read)."""

    path: str
    """Relative to the root, with "/" separators."""
    role: str | None = None
    precision: str | None = None
    world_size: int | None = None
    degrees: dict = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    partial_steps: list[int] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    bug: str | None = None
    has_estimate: bool = False
    entrypoint: str | None = None
    """What recorded (and relaunches) the run, "module:function"."""
    format_version: int | None = None
    versions: dict = field(default_factory=dict)
    """Python and package versions from the manifest's environment fingerprint (empty for older traces)."""
    error: str | None = None
    """Why the run cannot be used (one line), else None."""
    blind_spots: dict = field(default_factory=dict)
    """Module -> what the trace of it misses (store.read_blind_spots)."""
    estimates_for: list[str] = field(default_factory=list)
    """Other precisions the reference was estimated for (`ttrace estimate --for-precision`)."""

    @property
    def layout(self) -> str:
        """"tp2 sp pp1 ..." reduced to the degrees above 1 (and flags that are on)."""
        parts = [f"{name}{value}" if value > 1 else name for name, value in sorted(self.degrees.items())
                 if isinstance(value, int) and (value > 1 or (value == 1 and name in ("sp", "dist_opt")))]
        return " ".join(parts) or "single rank"


def _versions(environment: dict) -> dict:
    packages = {name: version for name, version in (environment.get("packages") or {}).items() if version}
    return {"python": environment["python"], **packages} if environment.get("python") else packages


def _run_info(root: Path, run_dir: Path) -> RunInfo:
    relative = run_dir.relative_to(root).as_posix() if run_dir != root else "."
    try:
        manifest = read_manifest(run_dir)
    except TtraceError as error:
        return RunInfo(path=relative, error=str(error))
    complete, partial = step_files(run_dir, manifest.world_size)
    config = manifest.entrypoint.get("config") or {}
    try:
        blind_spots = read_blind_spots(run_dir, manifest, complete[0]) if complete else dict(manifest.blind_spots)
    except TtraceError as error:
        return RunInfo(path=relative, error=str(error))
    estimates = estimate_files(run_dir)
    crossed = sorted(p for p in estimates if p is not None)
    return RunInfo(path=relative, role=manifest.role, precision=manifest.precision, world_size=manifest.world_size,
                   degrees=dict(manifest.degrees), steps=complete, partial_steps=partial, model=dict(manifest.model),
                   bug=config.get("bug"), has_estimate=None in estimates,
                   entrypoint=manifest.entrypoint.get("factory"), format_version=manifest.format_version,
                   versions=_versions(manifest.environment), blind_spots=blind_spots, estimates_for=crossed,
                   error=None if complete else f"{run_dir}: no complete step (partial: {partial}); re-record the run")


def run_info(run_dir: str | os.PathLike) -> RunInfo:
    """One run's metadata (its path relative to its parent folder)."""
    run_dir = Path(run_dir).resolve()
    return _run_info(run_dir.parent, run_dir)


def find_runs(root: str | os.PathLike) -> list[RunInfo]:
    """Every directory under `root` holding a manifest.json, sorted by path; unreadable ones carry `error`."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise TraceFormatError(f"{root}: not a directory; pass the folder that holds your run directories")
    found = []
    for directory, subdirs, files in os.walk(root, followlinks=False):
        subdirs[:] = sorted(d for d in subdirs if d not in _DERIVED_DIRS and not d.startswith("."))
        if MANIFEST_NAME in files:
            found.append(_run_info(root, Path(directory)))
    return sorted(found, key=lambda run: run.path)


def path_under_root(root: str | os.PathLike, relative: str) -> Path:
    """`root / relative`, refused when it resolves (symlinks followed) outside the root."""
    base = Path(root).resolve()
    target = (base / relative).resolve()
    if target != base and base not in target.parents:
        raise TtraceError(f"{relative}: resolves to {target}, outside the dashboard root {base}; "
                          "only runs under the root are served")
    return target


def _fingerprint(run_dir: Path) -> list:
    """What a comparison depends on in a run directory: its manifest's bytes and its data files' stats."""
    manifest = (run_dir / MANIFEST_NAME).read_bytes()
    estimates = {path.name for path in estimate_files(run_dir).values()}
    names = sorted(p for p in os.listdir(run_dir) if p.endswith((".h5", ".partial")) or p in estimates)
    stats = [(name, (run_dir / name).stat().st_size, (run_dir / name).stat().st_mtime_ns) for name in names]
    return [hashlib.sha256(manifest).hexdigest(), stats]


def _cache_path(reference: Path, candidate: Path, settings: CompareSettings) -> tuple[Path, dict]:
    inputs = {"reference": _fingerprint(reference), "candidate": _fingerprint(candidate), "settings": asdict(settings),
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


@dataclass(kw_only=True, slots=True)
class ComparisonTable:
    frame: pd.DataFrame
    provenance: dict
    path: Path
    cached: bool
    """True when the table was read from an earlier computation."""


def _provenance(result: RunComparison, inputs: dict, settings: CompareSettings, tolerance_kind: str, seconds: float) -> dict:
    first = result.first_divergence
    return {
        "ttrace_version": inputs["ttrace"], "table_format": table.TABLE_FORMAT_VERSION, "trace_format": FORMAT_VERSION,
        "reference": result.reference, "candidate": result.candidate,
        "reference_manifest_sha256": inputs["reference"][0], "candidate_manifest_sha256": inputs["candidate"][0],
        "settings": asdict(settings), "tolerance_provider": tolerance_kind,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": round(seconds, 3),
        "steps_compared": result.steps_compared, "notes": result.notes, "passed": result.passed,
        "verdict": result.verdict, "findings": result.findings,
        "coverage": None if result.coverage is None else result.coverage.to_dict(),
        "num_tensors": len(result.comparisons), "num_failed": len(result.failures),
        "first_divergence": None if first is None else {"tensor": table.tensor_id(first.key), "step": first.key.step,
                                                        "micro_batch": first.key.micro_batch},
    }


def comparison_table(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
                     *, progress: Callable[[int, int], None] | None = None, rebuild: bool = False) -> ComparisonTable:
    """The comparison of two runs as a table, from the cache when its inputs are unchanged."""
    settings = settings or CompareSettings()
    reference, candidate = Path(reference), Path(candidate)
    for run_dir in (reference, candidate):
        read_manifest(run_dir)  # one clear line for a missing or foreign directory
    path, inputs = _cache_path(reference, candidate, settings)
    if path.is_file() and not rebuild:
        try:
            frame, provenance = table.read_table(path)
            return ComparisonTable(frame=frame, provenance=provenance, path=path, cached=True)
        except (OSError, ValueError):
            pass  # a damaged cache file is rebuilt below
    started = time.perf_counter()
    with RunReader(reference) as ref_reader, RunReader(candidate) as cand_reader:
        tolerances = select_tolerances(settings.tolerance, ref_reader, cand_reader, alpha=settings.alpha,
                                       k=settings.theorem_k, c=settings.theorem_c)
        options = dict(ignore_dtype=settings.ignore_dtype, exact_inputs_k=settings.exact_inputs_k, partial=settings.partial,
                       max_bytes=settings.max_memory)
        if _workers() > 1:  # inside `ttrace compare --workers N` or torchrun: each worker compares a part
            from ttrace_core.partition import compare_partitioned

            result = compare_partitioned(ref_reader, cand_reader, tolerances, **options)
        else:
            result = compare_runs(ref_reader, cand_reader, tolerances, progress=progress, **options)
        frame = table.table_from_comparison(result, cand_reader)
    if not result.comparisons:
        raise TtraceError(f"{candidate}: no step was completed in both runs, nothing to compare")
    provenance = _provenance(result, inputs, settings, _PROVIDER_NAMES.get(type(tolerances).__name__, "custom"),
                             time.perf_counter() - started)
    try:
        if _worker_rank() == 0:  # one writer of the cache among partitioned workers
            table.write_table(path, frame, provenance)
    except OSError:
        pass  # a read-only place: the table is still returned, just not kept
    return ComparisonTable(frame=frame, provenance=provenance, path=path, cached=False)


def comparison(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
               **kwargs) -> pd.DataFrame:
    """The comparison table as a DataFrame; `frame.attrs["ttrace"]` holds its provenance."""
    result = comparison_table(reference, candidate, settings, **kwargs)
    result.frame.attrs["ttrace"] = result.provenance
    return result.frame


def _workers() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _worker_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run_comparison(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
                   **kwargs) -> RunComparison:
    """The same comparison as a `RunComparison` (what `ttrace compare` prints and writes as JSON)."""
    result = comparison_table(reference, candidate, settings, **kwargs)
    return table.comparison_from_table(result.frame, result.provenance)


def tensor_view(reference: str | os.PathLike, candidate: str | os.PathLike, tensor: str, step: int, micro_batch: int,
                region: tuple[slice, ...] | None = None, *, num_worst: int = 10) -> TensorView:
    """One tensor of both runs: canonical arrays, difference image, histogram, worst elements, shard map."""
    key = table.key_from_tensor_id(tensor, step, micro_batch)
    return build_tensor_view(Path(reference), Path(candidate), key, region=region, num_worst=num_worst)


LOCALIZE_EXIT_CODES = (0, 1, 4)
"""`ttrace localize` exit codes that carry a verdict: none, culprit named, diverged but not explained."""
_PROJECT_ROOT = Path(__file__).resolve().parents[1]


def replay_job_dir(reference: Path, candidate: Path, module: str | None) -> Path:
    inputs = {"reference": _fingerprint(reference), "candidate": _fingerprint(candidate), "module": module,
              "ttrace": ttrace_version()}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return candidate / ".ttrace" / "jobs" / f"localize-{digest}"


def _job_environment() -> dict[str, str]:
    """The replay's environment, written out: this process's, minus any ttrace session it runs in,
    plus one thread per rank and the project on the path."""
    env = {name: value for name, value in os.environ.items() if name != "TTRACE_SESSION"}
    path = os.pathsep.join(p for p in (str(_PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": path}


def submit_replay(reference: str | os.PathLike, candidate: str | os.PathLike, module: str | None = None, *,
                  timeout_s: float = 900.0, rerun: bool = False, job_timeout_s: float | None = None) -> Job:
    """Start (or find) the localization replay of a candidate: the whole model, or one module's subtree.
    Asking again for the same inputs answers from the finished job at once. `timeout_s` bounds the
    replay's ranks; `job_timeout_s` (default: 120 s more) the whole job, comparing and judging included."""
    reference, candidate = Path(reference).resolve(), Path(candidate).resolve()
    for run_dir in (reference, candidate):
        read_manifest(run_dir)
    directory = replay_job_dir(reference, candidate, module)
    command = [sys.executable, "-m", "ttrace_core", "localize", str(reference), str(candidate), "--here",
               "--json", str(directory / "result.json"), "--replay-dir", str(directory / "replay"),
               "--timeout", str(timeout_s)] + (["--module", module] if module else [])
    spec = JobSpec(command=command, env=_job_environment(), cwd=str(_PROJECT_ROOT),
                   timeout_s=timeout_s + 120 if job_timeout_s is None else job_timeout_s,
                   success_codes=LOCALIZE_EXIT_CODES)
    return submit(directory, spec, rerun=rerun)


def replay_job(reference: str | os.PathLike, candidate: str | os.PathLike, module: str | None = None) -> Job | None:
    """The replay job of these runs and module if one was ever submitted (running or finished), else None."""
    directory = replay_job_dir(Path(reference).resolve(), Path(candidate).resolve(), module)
    return Job(directory) if (directory / "spec.json").exists() else None


def localization(job: Job):
    """The `localize.Localization` of a complete replay job, else None."""
    from ttrace_core.localize import Localization

    try:
        result = job.result()
    except JobFileError as error:
        raise TtraceError(str(error)) from None
    return None if result is None else Localization.from_json(json.dumps(result), str(job.result_path))
