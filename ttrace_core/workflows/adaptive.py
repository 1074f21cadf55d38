"""Stage 1 (record), adaptively: statistics everywhere, values only where they are needed.

Pass 1 records the candidate in stats-only mode, every step. Compared with the reference, its first
diverging tensor names the window of steps that get values: the step that tensor belongs to, and the
first recorded step, because a bug that keeps every norm (a wrong shard order) shows in no statistic.
Pass 2 relaunches the same command with values recorded for the window's steps only
(`SessionSpec.value_steps`), and its step files replace pass 1's. The result is one run directory:
values where the divergence starts, statistics elsewhere; its manifest says which steps hold values
(`tracer.value_steps`). Both passes run the same deterministic command from the same weights and
data, so a step recorded by pass 2 is the step pass 1 summarized.

Input: a reference run directory and a function that records the stats-only pass. Output: an
`AdaptiveCapture` that carries what each pass cost.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ttrace_core.compare.engine import compare_runs
from ttrace_core.errors import TtraceError
from ttrace_core.format.reader import RunReader, read_manifest, step_file_name
from ttrace_core.format.writer import write_manifest

VALUES_PASS_DIR = ".ttrace/adaptive-values"
"""Where pass 2 records inside the run directory, before its step files move into place."""


@dataclass(kw_only=True, slots=True)
class AdaptiveCapture:
    run_dir: str
    steps: list[int]
    """Every step pass 1 recorded."""
    value_steps: list[int]
    """The window: the steps recorded with values."""
    stats_divergence: str | None
    """The first tensor whose statistics diverge from the reference's (None: none did)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """"stats pass", "compare", "values pass"."""
    bytes_on_disk: int = 0

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "steps": self.steps, "value_steps": self.value_steps,
                "stats_divergence": self.stats_divergence, "seconds": self.seconds, "bytes_on_disk": self.bytes_on_disk}


def value_window(first_divergence_step: int | None, steps: list[int]) -> list[int]:
    """The steps to record with values: the first recorded step, and the step of the first divergence."""
    window = {min(steps)} if steps else set()
    if first_divergence_step is not None:
        window.add(first_divergence_step)
    return sorted(window)


def capture_adaptively(reference: str | os.PathLike, out: str | os.PathLike,
                       record_stats: Callable[[Path], object], *, timeout_s: float) -> AdaptiveCapture:
    """Record `out` adaptively against `reference`; `record_stats(out)` records pass 1 (stats only)."""
    from ttrace_core.record.command import relaunch

    out = Path(out).resolve()
    seconds = {}
    started = time.perf_counter()
    record_stats(out)
    seconds["stats pass"] = time.perf_counter() - started
    started = time.perf_counter()
    with RunReader(reference) as ref, RunReader(out) as cand:
        first = compare_runs(ref, cand).first_divergence
        steps = sorted(cand.complete_steps)
    seconds["compare"] = time.perf_counter() - started
    if not steps:
        raise TtraceError(f"{out}: the stats-only pass completed no step, so there is no window to record values for; "
                          "see its partial steps with `ttrace inspect`")
    window = value_window(first.key.step if first is not None else None, steps)
    started = time.perf_counter()
    _record_values(out, window, relaunch, timeout_s)
    seconds["values pass"] = time.perf_counter() - started
    return AdaptiveCapture(run_dir=str(out), steps=steps, value_steps=window,
                           stats_divergence=str(first.key) if first is not None else None, seconds=seconds,
                           bytes_on_disk=sum(p.stat().st_size for p in out.glob("*.h5")))


def _record_values(out: Path, window: list[int], relaunch, timeout_s: float) -> None:
    """Pass 2: relaunch into a staging directory, then move its step files over pass 1's. Pass 1's
    files stay untouched until every rank's file of every window step is there."""
    manifest = read_manifest(out)
    staging = out / VALUES_PASS_DIR
    shutil.rmtree(staging, ignore_errors=True)
    relaunch(out, manifest, staging, value_steps=window, timeout_s=timeout_s)
    names = [step_file_name(rank, step) for step in window for rank in range(manifest.world_size)]
    missing = [name for name in names if not (staging / name).is_file()]
    if missing:
        raise TtraceError(f"{staging}: the values pass left no complete {missing[0]}; the stats-only trace in {out} "
                          "is kept as it was, record again or compare it as it is")
    for name in names:
        os.replace(staging / name, out / name)
    manifest.tracer["value_steps"] = window
    write_manifest(out, manifest)
    shutil.rmtree(staging, ignore_errors=True)
