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
from dataclasses import fields
from pathlib import Path

import msgspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ttrace_core.compare.results import Coverage, RunComparison, TensorComparison, row_detectable
from ttrace_core.format.naming import layer_of, module_of, tensor_id, tensor_kind
from ttrace_core.format.reader import RunReader
from ttrace_core.format.records import record_from_data, unknown_key
from ttrace_core.format.schema import TensorKey

TABLE_FORMAT_VERSION = 6  # 2: the "call" column; 3: the coverage block in the provenance; 4: structure tests;
# 5: whether the reference trained (coverage) and the headroom by tensor kind (provenance); 6: `detectable`
# finished in the row (the norm test's tolerance where no structure test set it, empty where not compared by value)
METADATA_KEY = b"ttrace"

_INT_COLUMNS = ("layer", "stage", "numel", "num_mismatched")
_FLOAT_COLUMNS = (*(spec.name for spec in fields(TensorComparison) if spec.type in ("float", "float | None")),
                  "tolerance_rel", "tolerance_abs", "tolerance_drift_rel", "drift_max_abs_diff", "drift_relative_diff")
"""Float columns stay float where every row of a frame is empty (a streamed chunk of one missing tensor): the
chunks concatenate to the finished table's dtypes."""
_NESTED_PATHS = {
    "step": ("key", "step"), "micro_batch": ("key", "micro_batch"), "phase": ("key", "phase"), "fqn": ("key", "fqn"),
    "slot": ("key", "slot"), "call": ("key", "call"),
    "tolerance_rel": ("tolerance", "rel"), "tolerance_abs": ("tolerance", "abs"),
    "tolerance_drift_rel": ("tolerance", "drift_rel"), "tolerance_method": ("tolerance", "method"),
    "tolerance_params": ("tolerance", "params"), "tolerance_source": ("tolerance", "source"),
    "num_nan_candidate": ("num_nan", 0), "num_nan_reference": ("num_nan", 1),
    "num_inf_candidate": ("num_inf", 0), "num_inf_reference": ("num_inf", 1),
    "drift_ranks": ("replica_drift", "ranks"), "drift_max_abs_diff": ("replica_drift", "max_abs_diff"),
    "drift_relative_diff": ("replica_drift", "relative_diff"),
}
ROW_PATHS: dict[str, tuple] = {
    **{spec.name: (spec.name,) for spec in fields(TensorComparison)
       if spec.name not in ("key", "tolerance", "num_nan", "num_inf", "replica_drift")},
    **_NESTED_PATHS,
}
"""Column -> where its value sits in a TensorComparison's serialized form (`data_from_record`). A new
field of TensorComparison becomes a column by itself; the other columns are derived from the key."""
_PRESENCE = {"tolerance": "tolerance_method", "replica_drift": "drift_ranks"}
"""A nested record is absent (None) when this column of it is."""
_JSON_COLUMNS = ("shape", "max_abs_index", "max_rel_index", "tolerance_params", "drift_ranks", "structure")
_DERIVED = ("tensor", "module", "layer", "stage", "kind", "order", "passed")
_ORDER = (
    "tensor", "step", "micro_batch", "phase", "fqn", "slot", "call", "module", "layer", "stage", "kind", "order", "status",
    "passed", "message", "dtype", "shape", "numel", "error", "abs_error", "reference_norm", "ratio", "value_ratio",
    "drift_ratio", "min_rel_tolerance", "tolerance_rel", "tolerance_abs", "tolerance_drift_rel", "tolerance_method",
    "tolerance_params", "tolerance_source", "max_abs_diff", "max_abs_index", "max_rel_diff", "max_rel_index",
    "num_mismatched", "num_nan_candidate", "num_nan_reference", "num_inf_candidate", "num_inf_reference",
    "num_nonfinite_apart", "drift_ranks", "drift_max_abs_diff", "drift_relative_diff", "stats_only",
)
COLUMNS = _ORDER + tuple(name for name in ROW_PATHS if name not in _ORDER)
"""One row per compared tensor instance; lists and dicts are JSON text, so plain pandas reads every cell."""


def pipeline_stage(reader: RunReader, key: TensorKey) -> int | None:
    """The candidate's pipeline stage that recorded `key` (None without a pp mesh axis)."""
    names = reader.manifest.mesh_axis_names
    metas = reader.index.get(key)
    if "pp" not in names or not metas or not reader.manifest.rank_coordinates:
        return None
    axis = names.index("pp")
    return min(reader.manifest.rank_coordinates[m.rank][axis] for m in metas)


def table_from_comparison(result: RunComparison, candidate: RunReader) -> pd.DataFrame:
    return frame_from_comparisons(result.comparisons, candidate)


def _field_values(comparisons: list[TensorComparison], path: tuple) -> list:
    """The value at `path` (ROW_PATHS) of every comparison: a field, or a field of a nested record or pair."""
    values = [getattr(c, path[0]) for c in comparisons]
    if len(path) == 1:
        return values
    part = path[1]
    if isinstance(part, int):
        return [None if value is None else value[part] for value in values]
    return [None if value is None else getattr(value, part) for value in values]


def frame_from_comparisons(comparisons: list[TensorComparison], candidate: RunReader | None,
                           first_order: int = 0) -> pd.DataFrame:
    """The table's rows of `comparisons`, the first at position `first_order` of the whole table (a streamed
    chunk's rows are the same as the finished table's). Made a column at a time from the records' fields; the
    pipeline stages from `candidate` (None: no stages)."""
    columns = {column: _field_values(comparisons, path) for column, path in ROW_PATHS.items()}
    columns["status"] = [str(status) for status in columns["status"]]  # a ComparisonStatus as its text
    columns["structure"] = [msgspec.to_builtins(tests) if tests else [] for tests in columns["structure"]]
    columns["detectable"] = [row_detectable(c) for c in comparisons]  # a reader of the table takes it as it is
    columns["tolerance_params"] = [None if params is None else dict(params) for params in columns["tolerance_params"]]
    keys = [c.key for c in comparisons]
    columns.update(tensor=[tensor_id(key) for key in keys], module=[module_of(key) for key in keys],
                   layer=[layer_of(key.fqn) for key in keys],
                   stage=[None if candidate is None else pipeline_stage(candidate, key) for key in keys],
                   kind=[tensor_kind(key) for key in keys], order=list(range(first_order, first_order + len(keys))),
                   passed=[c.passed for c in comparisons])
    frame = pd.DataFrame({column: columns[column] for column in COLUMNS}, columns=list(COLUMNS))
    for name in _JSON_COLUMNS:
        frame[name] = [None if v is None else json.dumps(list(v) if not isinstance(v, dict) else v) for v in frame[name]]
    frame["structure"] = [None if not v or v == "[]" else v for v in frame["structure"]]
    for name in _INT_COLUMNS:
        frame[name] = frame[name].astype("Int64")
    for name in _FLOAT_COLUMNS:
        frame[name] = frame[name].astype(float)
    return frame


def _optional(value):
    """A cell as a Python scalar, None where it is missing (None, pandas' NA, or NaN in a float column)."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if hasattr(value, "item") else value


def _cells(frame: pd.DataFrame, column: str) -> list:
    """A column as Python scalars, None where missing (`_optional` of each cell, a column at a time); a JSON
    column's text parsed. A column the table does not have (an older table) is all None."""
    if column not in frame:
        return [None] * len(frame)
    series = frame[column]
    values = series.astype(object).where(series.notna(), None).tolist()
    if column in _JSON_COLUMNS:
        return [None if text is None else json.loads(text) for text in values]
    return [_optional(value) for value in values] if series.dtype == object else values


def _row_data(frame: pd.DataFrame) -> list[dict]:
    """Every row as the serialized form of its TensorComparison (`data_from_record`'s), built a column at a time:
    the inverse of `frame_from_comparisons`."""
    columns = {column: _cells(frame, column) for column in ROW_PATHS}
    columns["message"] = [text or "" for text in columns["message"]]
    columns["structure"] = [tests or [] for tests in columns["structure"]]
    columns["decided_by"] = [name or None for name in columns["decided_by"]]
    columns["call"] = [call or 0 for call in columns["call"]]
    columns["tolerance_params"] = [list((params or {}).items()) for params in columns["tolerance_params"]]
    top = [column for column, path in ROW_PATHS.items() if len(path) == 1]
    nested: dict[str, list[tuple[str, object]]] = {}
    for column, (name, field_name) in ((c, p) for c, p in ROW_PATHS.items() if len(p) == 2):
        nested.setdefault(name, []).append((column, field_name))
    parts = {name: [dict(zip([f for _, f in fields_of], cells)) if isinstance(fields_of[0][1], str) else list(cells)
                    for cells in zip(*(columns[c] for c, _ in fields_of))]
             for name, fields_of in nested.items()}
    for name, column in _PRESENCE.items():  # an absent nested record is None
        parts[name] = [None if present is None else part for part, present in zip(parts[name], columns[column])]
    names = top + list(parts)
    return [dict(zip(names, cells)) for cells in zip(*(columns[c] for c in top), *parts.values())]


def comparisons_from_frame(frame: pd.DataFrame) -> list[TensorComparison]:
    """The TensorComparisons a table's rows were made from. Read in one conversion; a row that does not convert
    (a damaged table) is named by its first error, as `record_from_data` words it."""
    data = _row_data(frame)
    try:
        comparisons = msgspec.convert(data, type=list[TensorComparison], strict=True)
    except (msgspec.ValidationError, RecursionError):
        comparisons = None
    if comparisons is None or any(_structure_has_unknown_keys(row, c) for row, c in zip(data, comparisons)):
        return [record_from_data(row, TensorComparison, "comparison table", "comparison row", "compare the runs again")
                for row in data]  # the first bad row raises, worded as a single row's error is
    return comparisons


def _structure_has_unknown_keys(row: dict, comparison: TensorComparison) -> bool:
    """Whether a structure test read from a row's JSON holds a key its record does not (msgspec drops those): the
    only part of a row whose keys come from the file rather than from the table's columns."""
    return bool(row["structure"]) and unknown_key(row["structure"], msgspec.to_builtins(comparison.structure), "$") is not None


def comparison_from_table(frame: pd.DataFrame, provenance: dict) -> RunComparison:
    coverage = provenance.get("coverage")
    return RunComparison(
        reference=provenance["reference"], candidate=provenance["candidate"],
        steps_compared=list(provenance["steps_compared"]), notes=list(provenance["notes"]),
        comparisons=comparisons_from_frame(frame),
        coverage=None if coverage is None else record_from_data(coverage, Coverage, "comparison table", "coverage block",
                                                                "compare the runs again"),
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
