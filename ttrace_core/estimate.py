"""Perturbation-based error estimation: how far round-off alone can move each traced tensor.

Part of stage 3 (compare). Input: a reference run directory whose manifest names its entrypoint.
Output: a `PerturbationEstimate` stored beside the trace (`tolerance_estimate.json`), from which
`tolerances.PerturbationTolerances` derives one tolerance per tensor for every later candidate.

The method (TTrace v2): a backward-stable floating-point run equals the exact computation on
inputs moved by about the unit round-off u, so the reference re-run with its weights perturbed
elementwise, w * (1 + delta) with delta ~ U[-u, u], moves each tensor t by as much as round-off
can. For N samples, deviation_t = max_n ||T_t^(n) - T_t||_F. Relaunching uses only the manifest
(entrypoint factory and config); the re-runs are written under `.estimate/` and removed after.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from msgspec import Meta

from ttrace_core.containment import contained
from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.records import data_from_json, record_from_data
from ttrace_core.schema import Count, FiniteNonNegative, FinitePositive, TensorKey
from ttrace_core.store import RunReader, read_manifest
from ttrace_core.tolerances import machine_epsilon

ESTIMATE_FILE = "tolerance_estimate.json"
ESTIMATE_FORMAT = "ttrace-perturbation-estimate/1"


@dataclass(kw_only=True, slots=True)
class TensorDeviation:
    key: TensorKey
    deviation: FiniteNonNegative
    """max over samples of ||perturbed - reference||_F."""
    reference_norm: FiniteNonNegative
    numel: Count
    per_sample: list[Annotated[float, Meta(ge=0.0)]] = field(default_factory=list)
    """||perturbed - reference||_F / ||reference||_F of each sample (inf where the norm is 0)."""

    @property
    def relative(self) -> float:
        if self.reference_norm > 0:
            return self.deviation / self.reference_norm
        return 0.0 if self.deviation == 0 else math.inf


@dataclass(kw_only=True, slots=True)
class PerturbationEstimate:
    precision: str
    num_samples: int
    relative: float
    """Perturbation size: delta ~ U[-relative, relative]."""
    reference_precision: str = ""
    """The reference's own precision; `precision` differs from it when the re-runs computed in another
    one (`--for-precision fp8` on a bf16 reference), so the deviations include that precision's
    quantization. "" means the same as `precision`."""
    seconds: float = 0.0
    tensors: dict[TensorKey, TensorDeviation] = field(default_factory=dict)

    def to_json(self) -> str:
        rows = [{**asdict(d), "key": asdict(d.key)} for d in self.tensors.values()]
        return json.dumps({"format": ESTIMATE_FORMAT, "precision": self.precision, "num_samples": self.num_samples,
                           "relative": self.relative, "reference_precision": self.reference_precision or self.precision,
                           "seconds": self.seconds, "tensors": rows})

    @staticmethod
    def from_json(text: str, where: str) -> PerturbationEstimate:
        remedy = "delete it and run `ttrace estimate` again"
        data = data_from_json(text, where, "tolerance estimate", remedy)
        if not isinstance(data, dict) or data.get("format") != ESTIMATE_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise TraceFormatError(f"{where}: not a tolerance estimate (format {found!r}, expected {ESTIMATE_FORMAT!r}); {remedy}")
        stored = record_from_data(data, _EstimateFile, where, "tolerance estimate", remedy)
        return PerturbationEstimate(precision=stored.precision, num_samples=stored.num_samples, relative=stored.relative,
                                    seconds=stored.seconds, tensors={row.key: row for row in stored.tensors},
                                    reference_precision=stored.reference_precision or stored.precision)


@dataclass(kw_only=True, slots=True)
class _EstimateFile:
    """tolerance_estimate.json as stored: the ranges every field must lie in (records.py)."""

    format: str
    precision: Literal["fp32", "bf16", "fp16", "fp8"]
    num_samples: Annotated[int, Meta(ge=1, le=10_000)]
    relative: FinitePositive
    reference_precision: str = ""
    seconds: FiniteNonNegative = 0.0
    tensors: list[TensorDeviation] = field(default_factory=list)


def _crossed_name(precision: str) -> str:
    return ESTIMATE_FILE.replace(".json", f".{precision}.json")


def estimate_path(run_dir: str | os.PathLike, for_precision: str | None = None) -> Path:
    """The estimate for candidates of the reference's own precision, or of `for_precision`
    (tolerance_estimate.fp8.json: the reference re-run in fp8, for fp8 candidates)."""
    run_dir = Path(run_dir)
    if for_precision is None or for_precision == read_manifest(run_dir).precision:
        return run_dir / ESTIMATE_FILE
    return run_dir / _crossed_name(for_precision)


def estimate_files(run_dir: str | os.PathLike) -> dict[str | None, Path]:
    """Every estimate stored in a reference: None -> its own precision's, "fp8" -> the one for fp8 candidates."""
    run_dir = Path(run_dir)
    found: dict[str | None, Path] = {None: run_dir / ESTIMATE_FILE} if (run_dir / ESTIMATE_FILE).is_file() else {}
    for path in sorted(run_dir.glob(_crossed_name("*"))):
        found[path.name.removeprefix(ESTIMATE_FILE.removesuffix(".json") + ".").removesuffix(".json")] = path
    return found


def read_estimate(run_dir: str | os.PathLike, for_precision: str | None = None) -> PerturbationEstimate | None:
    path = estimate_path(run_dir, for_precision)
    if not path.exists():
        return None
    return PerturbationEstimate.from_json(contained(path.parent, path.name).read_text(), str(path))


def write_estimate(run_dir: str | os.PathLike, estimate: PerturbationEstimate) -> Path:
    crossed = estimate.reference_precision and estimate.precision != estimate.reference_precision
    path = estimate_path(run_dir, estimate.precision if crossed else None)
    partial = path.with_suffix(".json.partial")
    partial.write_text(estimate.to_json())
    os.replace(partial, path)
    return path


def deviations(reference: RunReader, perturbed: RunReader) -> dict[TensorKey, tuple[float, float, int]]:
    """(||perturbed - reference||_F, ||reference||_F, numel) of every tensor both runs hold."""
    from ttrace_core.compare import logical_value

    result = {}
    for key in reference.index:
        if key not in perturbed.index or reference.index[key][0].stats_only:
            continue
        expected, actual = logical_value(reference, key), logical_value(perturbed, key)
        finite = torch.isfinite(expected) & torch.isfinite(actual)
        diff = torch.where(finite, actual - expected, torch.zeros((), dtype=torch.float64))
        norm = torch.where(finite, expected, torch.zeros((), dtype=torch.float64))
        result[key] = (float(torch.linalg.vector_norm(diff)), float(torch.linalg.vector_norm(norm)), expected.numel())
    return result


def estimate_reference(run_dir: str | os.PathLike, *, num_samples: int = 4, relative: float | None = None,
                       timeout_s: float = 600.0, num_workers: int | None = None,
                       for_precision: str | None = None) -> PerturbationEstimate:
    """Re-run the reference `num_samples` times with perturbed weights and measure every tensor's deviation.

    `for_precision` (e.g. "fp8" on a bf16 reference): the re-runs compute in that precision, so each
    deviation is the quantization plus the round-off, the tolerance an fp8 candidate needs when it
    is judged against the bf16 run (the triangle inequality again: candidate vs an fp8 reference, plus
    that fp8 reference vs this one, each about one such deviation)."""
    from ttrace_core.record import relaunch

    if num_samples < 1:
        raise TtraceError(f"--samples {num_samples}: need at least 1 perturbed re-run")
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    if not manifest.entrypoint.get("command") and not manifest.entrypoint.get("factory"):
        raise TtraceError(f"{run_dir}/manifest.json: no entrypoint recorded, so the reference cannot be re-run; "
                          "record it with `ttrace record -- COMMAND` (or `ttrace example`)")
    if manifest.tracer.get("stats_only"):
        raise TtraceError(f"{run_dir}: recorded with --stats-only, so it holds no values to measure deviations on; "
                          "record the reference again without --stats-only")
    for_precision = None if for_precision in (None, manifest.precision) else for_precision
    relative = relative if relative is not None else machine_epsilon(manifest.precision) / 2  # unit round-off
    work = run_dir / ".estimate"
    shutil.rmtree(work, ignore_errors=True)
    outs = [work / f"sample_{i}" for i in range(num_samples)]
    workers = num_workers or max(1, (os.cpu_count() or 1) // manifest.world_size)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(workers, num_samples)) as pool:
        futures = [pool.submit(relaunch, run_dir, manifest, out.resolve(), timeout_s=timeout_s, precision=for_precision,
                               perturbation={"sample": i, "relative": relative}) for i, out in enumerate(outs)]
        for future in futures:
            future.result()
    if for_precision is not None:
        _check_precision_honoured(run_dir, outs, for_precision)
    estimate = PerturbationEstimate(precision=for_precision or manifest.precision, num_samples=num_samples,
                                    relative=relative, reference_precision=manifest.precision)
    with RunReader(run_dir) as reference:
        for out in outs:
            with RunReader(out) as perturbed:
                _merge(estimate, deviations(reference, perturbed))
    estimate.seconds = time.monotonic() - started
    shutil.rmtree(work, ignore_errors=True)
    return estimate


def _check_precision_honoured(run_dir: Path, outs: list[Path], precision: str) -> None:
    for out in outs:
        recorded = read_manifest(out).precision
        if recorded != precision:
            shutil.rmtree(run_dir / ".estimate", ignore_errors=True)
            raise TtraceError(f"{run_dir}: asked its command to re-run in {precision} but it recorded {recorded}; the "
                              "script must apply ttrace_core.requested_precision() to its config (the bundled examples do)")


def _merge(estimate: PerturbationEstimate, sample: dict[TensorKey, tuple[float, float, int]]) -> None:
    for key, (deviation, norm, numel) in sample.items():
        entry = estimate.tensors.setdefault(key, TensorDeviation(key=key, deviation=0.0, reference_norm=norm, numel=numel))
        entry.deviation = max(entry.deviation, deviation)
        entry.per_sample.append(deviation / norm if norm > 0 else (0.0 if deviation == 0 else math.inf))
