"""Localization replays as jobs (jobs.py): `ttrace localize` and the Localize page submit the same
job, cached by its inputs, and read its verdict."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from ttrace_core.compare.settings import CompareSettings
from ttrace_core.errors import TtraceError
from ttrace_core.format.reader import read_manifest
from ttrace_core.localize.verdicts import Localization
from ttrace_core.service.comparisons import run_fingerprint, ttrace_version
from ttrace_core.service.jobs import Job, JobFileError, JobSpec, submit
from ttrace_core.record.session import SESSION_ENV

LOCALIZE_EXIT_CODES = (0, 1, 4)
"""`ttrace localize` exit codes that carry a verdict: none, culprit named, diverged but not explained."""
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def project_root() -> Path:
    """Where a job's command runs from, with the project on its path."""
    return _PROJECT_ROOT


def replay_job_dir(reference: Path, candidate: Path, module: str | None, settings: CompareSettings | None = None) -> Path:
    settings = settings or CompareSettings()
    inputs = {"reference": run_fingerprint(reference), "candidate": run_fingerprint(candidate), "module": module,
              "ttrace": ttrace_version()}
    if settings != CompareSettings():  # default settings keep the job directories of earlier versions
        inputs["settings"] = settings.to_data()
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return candidate / ".ttrace" / "jobs" / f"localize-{digest}"


def job_environment() -> dict[str, str]:
    """The replay's environment, written out: this process's, minus any ttrace session it runs in,
    plus one thread per rank and the project on the path."""
    env = {name: value for name, value in os.environ.items() if name != SESSION_ENV}
    path = os.pathsep.join(p for p in (str(_PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": path}


def submit_replay(reference: str | os.PathLike, candidate: str | os.PathLike, module: str | None = None, *,
                  timeout_s: float = 900.0, rerun: bool = False, job_timeout_s: float | None = None,
                  settings: CompareSettings | None = None) -> Job:
    """Start (or find) the localization replay of a candidate: the whole model, or one module's subtree.
    Asking again for the same inputs answers from the finished job at once. `timeout_s` bounds the
    replay's ranks; `job_timeout_s` (default: 120 s more) the whole job, comparing and judging included.
    `settings` judge the original and the replay (the job's command line carries them)."""
    settings = settings or CompareSettings()
    reference, candidate = Path(reference).resolve(), Path(candidate).resolve()
    for run_dir in (reference, candidate):
        read_manifest(run_dir)
    directory = replay_job_dir(reference, candidate, module, settings)
    command = [sys.executable, "-m", "ttrace_core", "localize", str(reference), str(candidate), "--here",
               "--json", str(directory / "result.json"), "--replay-dir", str(directory / "replay"),
               "--timeout", str(timeout_s), *settings.cli_args()] + (["--module", module] if module else [])
    spec = JobSpec(command=command, env=job_environment(), cwd=str(_PROJECT_ROOT),
                   timeout_s=timeout_s + 120 if job_timeout_s is None else job_timeout_s,
                   success_codes=LOCALIZE_EXIT_CODES)
    return submit(directory, spec, rerun=rerun)


def replay_job(reference: str | os.PathLike, candidate: str | os.PathLike, module: str | None = None,
               settings: CompareSettings | None = None) -> Job | None:
    """The replay job of these runs, module and settings if one was ever submitted (running or finished), else None."""
    directory = replay_job_dir(Path(reference).resolve(), Path(candidate).resolve(), module, settings)
    return Job(directory) if (directory / "spec.json").exists() else None


def localization(job: Job):
    """The `localize.Localization` of a complete replay job, else None."""
    try:
        result = job.result()
    except JobFileError as error:
        raise TtraceError(str(error)) from None
    return None if result is None else Localization.from_json(json.dumps(result), str(job.result_path))
