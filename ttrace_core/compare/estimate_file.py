"""The perturbation estimate as a file: `tolerance_estimate.json` beside a reference's trace.

Part of stage 3 (compare). `workflows/estimate.py` measures it (re-running the reference); this module
only reads and writes it, and `tolerances.PerturbationTolerances` derives one tolerance per tensor from
it for every later candidate.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ttrace_core.format.containment import contained
from ttrace_core.format.regular_files import regular_file_bytes
from ttrace_core.errors import TraceFormatError
from ttrace_core.format.records import data_from_json, record_from_data
from ttrace_core.format.schema import Count, Finite, FiniteNonNegative, FinitePositive, TensorKey
from ttrace_core.format.reader import read_manifest

ESTIMATE_FILE = "tolerance_estimate.json"
ESTIMATE_FORMAT = "ttrace-perturbation-estimate/2"
READABLE_ESTIMATE_FORMATS = ("ttrace-perturbation-estimate/1", ESTIMATE_FORMAT)
"""/2: each tensor's structure statistics per sample; a /1 estimate gives the norm test only."""


@dataclass(kw_only=True, slots=True)
class TensorDeviation:
    key: TensorKey
    deviation: FiniteNonNegative
    """max over samples of ||perturbed - reference||_F."""
    reference_norm: FiniteNonNegative
    numel: Count
    per_sample: list[Annotated[float, Meta(ge=0.0)]] = field(default_factory=list)
    """||perturbed - reference||_F / ||reference||_F of each sample (inf where the norm is 0)."""
    structure: dict[Literal["scale", "offset", "bias", "shard", "update"], list[Finite]] = field(default_factory=dict)
    """Each structure statistic (compare/structure.py) of each sample: how large round-off alone made it."""

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
        rows = [{**asdict(d), "key": msgspec.to_builtins(d.key)} for d in self.tensors.values()]
        return json.dumps({"format": ESTIMATE_FORMAT, "precision": self.precision, "num_samples": self.num_samples,
                           "relative": self.relative, "reference_precision": self.reference_precision or self.precision,
                           "seconds": self.seconds, "tensors": rows})

    @staticmethod
    def from_json(text: str, where: str) -> PerturbationEstimate:
        remedy = "delete it and run `ttrace estimate` again"
        data = data_from_json(text, where, "tolerance estimate", remedy)
        if not isinstance(data, dict) or data.get("format") not in READABLE_ESTIMATE_FORMATS:
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
    """Every estimate stored in a reference: None -> its own precision's, "fp8" -> the one for fp8 candidates
    (present, readable or not: `read_estimate` says what is wrong with one)."""
    run_dir = Path(run_dir)
    found: dict[str | None, Path] = {None: run_dir / ESTIMATE_FILE} if os.path.lexists(run_dir / ESTIMATE_FILE) else {}
    for path in sorted(run_dir.glob(_crossed_name("*"))):
        found[path.name.removeprefix(ESTIMATE_FILE.removesuffix(".json") + ".").removesuffix(".json")] = path
    return found


def read_estimate(run_dir: str | os.PathLike, for_precision: str | None = None) -> PerturbationEstimate | None:
    """The estimate, or None only when there is none: one that is present but cannot be read (a
    directory, a FIFO, a symlink loop, damaged JSON) is an error, never a quiet fall back to the dtype table."""
    path = estimate_path(run_dir, for_precision)
    if not os.path.lexists(path):
        return None
    remedy = (f"the tolerance estimate cannot be read, and an unreadable estimate is never replaced by the dtype "
              f"table in silence: delete it and run `ttrace estimate {os.fspath(run_dir)}` again")
    try:
        text = regular_file_bytes(contained(path.parent, path.name, remedy=remedy))
    except OSError as error:
        raise TraceFormatError(f"{path}: {error.strerror or error}; {remedy}") from error
    return PerturbationEstimate.from_json(text, str(path))


def write_estimate(run_dir: str | os.PathLike, estimate: PerturbationEstimate) -> Path:
    crossed = estimate.reference_precision and estimate.precision != estimate.reference_precision
    path = estimate_path(run_dir, estimate.precision if crossed else None)
    partial = path.with_suffix(".json.partial")
    partial.write_text(estimate.to_json())
    os.replace(partial, path)
    return path
