"""The comparison table: stage 3's result (compare) as one flat, versioned Parquet file.

Input: a `RunComparison` and the candidate's `RunReader` (for pipeline stages). Output: a pandas
DataFrame with one row per compared tensor instance, in execution order, and a Parquet file under
the candidate's run directory that holds it with its provenance. The row keeps every number of a
`TensorComparison`, so `comparison_from_table` gives the same result back: the CLI and the
dashboard read one file, and can never disagree. It opens in plain pandas
(`pandas.read_parquet(path)`); the provenance is the schema's `ttrace` metadata (`read_provenance`).

Cache: the file name is a hash of the inputs (both runs' manifests and step files by name, size and
mtime, the reference's tolerance estimate, the settings, the ttrace and table versions), so a
changed input gives a new name and an unchanged one reuses the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ttrace_core.compare import RunComparison, TensorComparison
from ttrace_core.dataflow import owner_of
from ttrace_core.evidence import Coverage
from ttrace_core.schema import TensorKey
from ttrace_core.store import RunReader
from ttrace_core.tolerances import Tolerance

TABLE_FORMAT_VERSION = 3  # 2: the "call" column; 3: the coverage block in the provenance
METADATA_KEY = b"ttrace"

# Tensor kinds in the order the heatmap shows them: (phase, slot family) -> kind.
KINDS = ("input", "output", "grad_output", "grad_input", "param_grad", "param")
_KIND_OF = {("forward", "input"): "input", ("forward", "output"): "output", ("backward", "grad_output"): "grad_output",
            ("backward", "grad_input"): "grad_input", ("grad", "grad"): "param_grad", ("param", "value"): "param"}
_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(?:\.|$)")
_JSON_COLUMNS = ("shape", "max_abs_index", "max_rel_index", "tolerance_params", "drift_ranks")
_INT_COLUMNS = ("layer", "stage", "numel", "num_mismatched")
COLUMNS = (
    "tensor", "step", "micro_batch", "phase", "fqn", "slot", "call", "module", "layer", "stage", "kind", "order", "status",
    "passed", "message", "dtype", "shape", "numel", "error", "abs_error", "reference_norm", "ratio", "value_ratio",
    "drift_ratio", "min_rel_tolerance", "tolerance_rel", "tolerance_abs", "tolerance_drift_rel", "tolerance_method",
    "tolerance_params", "tolerance_source", "max_abs_diff", "max_abs_index", "max_rel_diff", "max_rel_index",
    "num_mismatched", "num_nan_candidate", "num_nan_reference", "num_inf_candidate", "num_inf_reference",
    "drift_ranks", "drift_max_abs_diff", "drift_relative_diff", "stats_only",
)
"""One row per compared tensor instance; lists and dicts are JSON text, so plain pandas reads every cell."""


def tensor_id(key: TensorKey) -> str:
    """"phase/fqn/slot": a tensor across steps and micro-batches (the URL's `tensor`); a module's later
    calls within a micro-batch add "@call" ("forward/lm_head/output.0@1")."""
    return f"{key.phase}/{key.fqn}/{key.slot}" + (f"@{key.call}" if key.call else "")


def key_from_tensor_id(text: str, step: int, micro_batch: int) -> TensorKey:
    phase, rest = text.split("/", 1)
    fqn, slot = rest.rsplit("/", 1)
    slot, _, call = slot.partition("@")
    return TensorKey(step=step, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot, call=int(call or 0))


def tensor_kind(key: TensorKey) -> str:
    return _KIND_OF.get((key.phase, key.slot.split(".", 1)[0]), key.slot.split(".", 1)[0])


def module_of(key: TensorKey) -> str:
    """The module a tensor belongs to: its own fqn for activations, the owner for parameters."""
    return owner_of(key.fqn) if key.phase in ("grad", "param") else key.fqn


def layer_of(fqn: str) -> int | None:
    match = _LAYER.search(fqn)
    return int(match.group(1)) if match else None


def pipeline_stage(reader: RunReader, key: TensorKey) -> int | None:
    """The candidate's pipeline stage that recorded `key` (None without a pp mesh axis)."""
    names = reader.manifest.mesh_axis_names
    metas = reader.index.get(key)
    if "pp" not in names or not metas or not reader.manifest.rank_coordinates:
        return None
    axis = names.index("pp")
    return min(reader.manifest.rank_coordinates[m.rank][axis] for m in metas)


def row_from_comparison(c: TensorComparison, order: int, stage: int | None) -> dict:
    tolerance = c.tolerance
    drift = c.replica_drift or {}
    return {
        "tensor": tensor_id(c.key), "step": c.key.step, "micro_batch": c.key.micro_batch, "phase": c.key.phase,
        "fqn": c.key.fqn, "slot": c.key.slot, "call": c.key.call, "module": module_of(c.key), "layer": layer_of(c.key.fqn), "stage": stage,
        "kind": tensor_kind(c.key), "order": order, "status": c.status, "passed": c.passed, "message": c.message,
        "dtype": c.dtype, "shape": c.shape, "numel": c.numel, "error": c.error, "abs_error": c.abs_error,
        "reference_norm": c.reference_norm, "ratio": c.ratio, "value_ratio": c.value_ratio, "drift_ratio": c.drift_ratio,
        "min_rel_tolerance": c.min_rel_tolerance,
        "tolerance_rel": tolerance.rel if tolerance else None, "tolerance_abs": tolerance.abs if tolerance else None,
        "tolerance_drift_rel": tolerance.drift_rel if tolerance else None,
        "tolerance_method": tolerance.method if tolerance else None,
        "tolerance_params": dict(tolerance.params) if tolerance else None,
        "tolerance_source": tolerance.source if tolerance else None,
        "max_abs_diff": c.max_abs_diff, "max_abs_index": c.max_abs_index, "max_rel_diff": c.max_rel_diff,
        "max_rel_index": c.max_rel_index, "num_mismatched": c.num_mismatched,
        "num_nan_candidate": c.num_nan[0], "num_nan_reference": c.num_nan[1],
        "num_inf_candidate": c.num_inf[0], "num_inf_reference": c.num_inf[1],
        "drift_ranks": drift.get("ranks"), "drift_max_abs_diff": drift.get("max_abs_diff"),
        "drift_relative_diff": drift.get("relative_diff"), "stats_only": c.stats_only,
    }


def table_from_comparison(result: RunComparison, candidate: RunReader) -> pd.DataFrame:
    rows = [row_from_comparison(c, order, pipeline_stage(candidate, c.key)) for order, c in enumerate(result.comparisons)]
    frame = pd.DataFrame(rows, columns=COLUMNS)
    for name in _JSON_COLUMNS:
        frame[name] = [None if v is None else json.dumps(list(v) if not isinstance(v, dict) else v) for v in frame[name]]
    for name in _INT_COLUMNS:
        frame[name] = frame[name].astype("Int64")
    return frame


def _optional(value):
    """A cell as a Python scalar, None where it is missing (None, pandas' NA, or NaN in a float column)."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if hasattr(value, "item") else value


def _loaded(text: str | None):
    return None if _optional(text) is None else json.loads(text)


def _tuple(row: dict, name: str) -> tuple | None:
    loaded = _loaded(row[name])
    return None if loaded is None else tuple(loaded)


def comparison_from_row(row: dict) -> TensorComparison:
    key = TensorKey(step=int(row["step"]), micro_batch=int(row["micro_batch"]), phase=row["phase"], fqn=row["fqn"],
                    slot=row["slot"], call=int(row.get("call", 0) or 0))
    tolerance = None
    if _optional(row["tolerance_method"]) is not None:
        tolerance = Tolerance(rel=row["tolerance_rel"], abs=row["tolerance_abs"], source=row["tolerance_source"],
                              drift_rel=_optional(row["tolerance_drift_rel"]), method=row["tolerance_method"],
                              params=tuple((_loaded(row["tolerance_params"]) or {}).items()))
    drift_ranks = _loaded(row["drift_ranks"])
    drift = None if drift_ranks is None else {"ranks": tuple(drift_ranks), "max_abs_diff": row["drift_max_abs_diff"],
                                              "relative_diff": row["drift_relative_diff"]}
    return TensorComparison(
        key=key, status=row["status"], message=_optional(row["message"]) or "", dtype=_optional(row["dtype"]), shape=_tuple(row, "shape"),
        error=_optional(row["error"]), abs_error=_optional(row["abs_error"]),
        reference_norm=_optional(row["reference_norm"]), tolerance=tolerance, ratio=_optional(row["ratio"]),
        value_ratio=_optional(row["value_ratio"]), drift_ratio=_optional(row["drift_ratio"]),
        min_rel_tolerance=_optional(row["min_rel_tolerance"]), max_abs_diff=_optional(row["max_abs_diff"]),
        max_abs_index=_tuple(row, "max_abs_index"), max_rel_diff=_optional(row["max_rel_diff"]),
        max_rel_index=_tuple(row, "max_rel_index"), num_mismatched=_optional(row["num_mismatched"]),
        numel=_optional(row["numel"]), num_nan=(int(row["num_nan_candidate"]), int(row["num_nan_reference"])),
        num_inf=(int(row["num_inf_candidate"]), int(row["num_inf_reference"])), replica_drift=drift,
        stats_only=bool(row["stats_only"]),
    )


def comparison_from_table(frame: pd.DataFrame, provenance: dict) -> RunComparison:
    coverage = provenance.get("coverage")
    return RunComparison(
        reference=provenance["reference"], candidate=provenance["candidate"],
        steps_compared=list(provenance["steps_compared"]), notes=list(provenance["notes"]),
        comparisons=[comparison_from_row(row) for row in frame.to_dict("records")],
        coverage=None if coverage is None else Coverage.from_dict(coverage),
        partial_allowed=bool(provenance.get("settings", {}).get("partial", False)),
    )


def write_table(path: Path, frame: pd.DataFrame, provenance: dict) -> None:
    """Atomically: a reader never sees a half-written table."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    metadata = {**(table.schema.metadata or {}), METADATA_KEY: json.dumps(provenance).encode()}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    pq.write_table(table.replace_schema_metadata(metadata), staging)
    os.replace(staging, path)


def read_provenance(path: str | os.PathLike) -> dict:
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[METADATA_KEY]) if METADATA_KEY in metadata else {}


def read_table(path: str | os.PathLike) -> tuple[pd.DataFrame, dict]:
    frame = pd.read_parquet(path)
    return frame, read_provenance(path)
