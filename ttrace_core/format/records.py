"""Parse the trace's files into the typed records of schema.py, checking every field's range.

The one place where text from a trace (manifest.json, each dataset's metadata attribute, the
tolerance estimate) becomes a record. msgspec checks each field against the type and range the
record declares (`schema.Count`, `schema.FinitePositive`, ...) and runs the record's own
`__post_init__` checks; a failure becomes one line that names the file and the field:

    runs/cand/manifest.json: not a valid manifest (field $.world_size: Expected `int` >= 1); re-record the run

Nothing here executes code from the file: JSON only.
"""

from __future__ import annotations

import json
from typing import TypeVar

import msgspec

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.schema import Finding, TensorMeta

Record = TypeVar("Record")

_META_DECODER = msgspec.json.Decoder(TensorMeta)
_FINDING_DECODER = msgspec.json.Decoder(Finding)


def error_at(error: Exception) -> tuple[str, str | None]:
    """msgspec's "Expected `int` >= 1 - at `$.world_size`" as ("Expected `int` >= 1", "$.world_size"); the
    path is None for an error at no field. The one reading of msgspec's error text: a trace's records, a
    correspondence map and a `ttrace check` config each word it for their reader."""
    text = str(error)
    message, _, path = text.rpartition(" - at ")
    if message and path.startswith("`$"):
        return message, path.strip("`")
    return text, None


def _reason(error: Exception) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.world_size`" as "field $.world_size: Expected `int` >= 1"."""
    message, path = error_at(error)
    return f"field {path}: {message}" if path else message


def record_from_data(data: object, record: type[Record], where: str, what: str, remedy: str) -> Record:
    """A record from already-parsed JSON (the JSON files may hold NaN, which only `json` reads).
    `what` names the file's kind in the error: "not a valid <what> (field $.x: ...); <remedy>".

    A key the record does not have is refused, at any depth: msgspec drops unknown keys of a dataclass
    record, so a key renamed by damage ("blind_spotz") would otherwise read as the field left at its
    default. (The Struct records of schema.py forbid unknown fields themselves.)"""
    try:
        parsed = msgspec.convert(data, type=record, strict=True)
    except (msgspec.ValidationError, RecursionError) as error:
        raise TraceFormatError(f"{where}: not a valid {what} ({_reason(error)}); {remedy}") from error
    written = parsed.to_dict() if hasattr(parsed, "to_dict") else msgspec.to_builtins(parsed)  # what it writes
    unknown = unknown_key(data, written, "$")
    if unknown is not None:  # worded as msgspec words it for a Struct record
        at, name = unknown
        error = ValueError(f"Object contains unknown field `{name}`" + ("" if at == "$" else f" - at `{at}`"))
        raise TraceFormatError(f"{where}: not a valid {what} ({_reason(error)}); {remedy}")
    return parsed


def unknown_key(data: object, written: object, path: str) -> tuple[str, str] | None:
    """(where, key) of the first key of `data` that the record read from it, written back, does not hold."""
    if isinstance(data, dict) and isinstance(written, dict):
        for name, value in data.items():
            if name not in written:
                return path, name
            found = unknown_key(value, written[name], f"{path}.{name}")
            if found is not None:
                return found
    elif isinstance(data, list | tuple) and isinstance(written, list | tuple):
        for index, (value, kept) in enumerate(zip(data, written)):
            found = unknown_key(value, kept, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def data_from_json(text: str | bytes, where: str, what: str, remedy: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        raise TraceFormatError(f"{where}: not a valid {what} (not JSON: {str(error)[:120]}); {remedy}") from error


def meta_from_json(text: str | bytes, where: str) -> TensorMeta:
    """One dataset's metadata attribute (written by trace_writer.RunWriter: finite numbers, so strict JSON)."""
    try:
        return _META_DECODER.decode(text)
    except (msgspec.DecodeError, RecursionError, UnicodeError, TypeError) as error:  # a flipped bit: not UTF-8
        raise TraceFormatError(f"{where}: tensor metadata is malformed ({_reason(error)}); re-record this rank") from error


def finding_from_json(text: str | bytes, where: str) -> Finding:
    """One line of a step file's findings (written by RunWriter.add_finding)."""
    try:
        return _FINDING_DECODER.decode(text)
    except (msgspec.DecodeError, RecursionError, UnicodeError, TypeError) as error:
        raise TraceFormatError(f"{where}: the finding is malformed ({_reason(error)}); re-record this rank") from error


def data_from_record(record: object) -> object:
    """A record as plain JSON-able data (dicts, lists, numbers, strings): the one serialized form that
    `record_from_data` reads back. Non-finite floats stay floats; `strict_json` writes them as null."""
    return msgspec.to_builtins(record)
