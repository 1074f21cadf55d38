"""The runs under a root, from their manifests and file names only (no tensor is read): the Runs
page's list and the dashboard's path confinement. `RunInfo` is imported with the api, so the trace
reader (and torch behind it) is imported only when a run is read."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ttrace_core.errors import TraceFormatError, TtraceError

# Directories of a run that hold derived data, not runs to list (replays are listed by the localizer).
_DERIVED_DIRS = (".ttrace", ".localize")


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
    """What recorded (and relaunches) the run: its command ("python -m ttrace_examples megatron-gpt --config
    ..."), or "module:function" for a trace recorded before runs were recorded as commands."""
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


def example_config(entrypoint: dict) -> dict:
    """The bundled example's config (its injected bug among it): under the factory in older traces, else the
    --config JSON of the `python -m ttrace_examples WORKLOAD --config JSON` command `ttrace example` records;
    empty for a user's own command."""
    if isinstance(entrypoint.get("config"), dict):
        return entrypoint["config"]
    command = entrypoint.get("command") or []
    if "ttrace_examples" not in command or "--config" not in command[:-1]:
        return {}
    try:
        config = json.loads(command[command.index("--config") + 1])
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def entrypoint_text(entrypoint: dict) -> str | None:
    """The recorded command as one shell line, or the factory of an older trace; None when neither is recorded."""
    if entrypoint.get("command"):
        return shlex.join(entrypoint["command"])
    return entrypoint.get("factory")


def _run_info(root: Path, run_dir: Path) -> RunInfo:
    from ttrace_core.compare.estimate_file import estimate_files
    from ttrace_core.format.reader import read_blind_spots, read_manifest, step_files

    relative = run_dir.relative_to(root).as_posix() if run_dir != root else "."
    try:
        manifest = read_manifest(run_dir)
    except TtraceError as error:
        return RunInfo(path=relative, error=str(error))
    complete, partial = step_files(run_dir, manifest.world_size)
    config = example_config(manifest.entrypoint)
    try:
        blind_spots = read_blind_spots(run_dir, manifest, complete[0]) if complete else dict(manifest.blind_spots)
    except TtraceError as error:
        return RunInfo(path=relative, error=str(error))
    estimates = estimate_files(run_dir)
    crossed = sorted(p for p in estimates if p is not None)
    return RunInfo(path=relative, role=manifest.role, precision=manifest.precision, world_size=manifest.world_size,
                   degrees=dict(manifest.degrees), steps=complete, partial_steps=partial, model=dict(manifest.model),
                   bug=config.get("bug"), has_estimate=None in estimates,
                   entrypoint=entrypoint_text(manifest.entrypoint), format_version=manifest.format_version,
                   versions=_versions(manifest.environment), blind_spots=blind_spots, estimates_for=crossed,
                   error=None if complete else f"{run_dir}: no complete step (partial: {partial}); re-record the run")


def run_info(run_dir: str | os.PathLike) -> RunInfo:
    """One run's metadata (its path relative to its parent folder)."""
    run_dir = Path(run_dir).resolve()
    return _run_info(run_dir.parent, run_dir)


MAPPED_RUNS = (".ttrace", "mapped")
"""Where `--map` keeps a reference rewritten through a correspondence map, inside the reference
(workflows/mapped_reference.MAPPED_DIR; docs/porting.md): listed with the runs, so the dashboard can pair it."""


def find_runs(root: str | os.PathLike) -> list[RunInfo]:
    """Every directory under `root` holding a manifest.json, sorted by path, and the mapped references kept
    inside them (MAPPED_RUNS); unreadable ones carry `error`."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise TraceFormatError(f"{root}: not a directory; pass the folder that holds your run directories")
    from ttrace_core.format.reader import MANIFEST_NAME

    found = []
    for directory, subdirs, files in os.walk(root, followlinks=False):
        subdirs[:] = sorted(d for d in subdirs if d not in _DERIVED_DIRS and not d.startswith("."))
        if MANIFEST_NAME in files:
            found.append(_run_info(root, Path(directory)))
            mapped = Path(directory, *MAPPED_RUNS)
            found += [_run_info(root, manifest.parent) for manifest in sorted(mapped.glob(f"*/{MANIFEST_NAME}"))
                      if not manifest.parent.name.endswith(".partial")]
    return sorted(found, key=lambda run: run.path)


def pair_problem(reference: str | os.PathLike, candidate: str | os.PathLike) -> str | None:
    """Why comparing these two runs would say nothing, as one line, or None: the same run twice (it always passes),
    or the two swapped (each manifest records its role; a swapped pair judges the reference by the candidate's
    tolerances). Runs whose manifest cannot be read are left to the comparison, which names the problem."""
    from ttrace_core.format.reader import read_manifest

    if Path(reference).resolve() == Path(candidate).resolve():
        return (f"{reference} is compared with itself, which always passes; pass a reference and a different "
                "candidate run")
    try:
        roles = read_manifest(reference).role, read_manifest(candidate).role
    except TtraceError:
        return None
    if roles == ("candidate", "reference"):
        return (f"the runs are swapped: {reference} was recorded as a candidate and {candidate} as a reference; "
                f"pass the reference first")
    return None


def path_under_root(root: str | os.PathLike, relative: str) -> Path:
    """`root / relative`, refused when it resolves (symlinks followed) outside the root."""
    base = Path(root).resolve()
    target = (base / relative).resolve()
    if target != base and base not in target.parents:
        raise TtraceError(f"{relative}: resolves to {target}, outside the dashboard root {base}; "
                          "only runs under the root are served")
    return target
