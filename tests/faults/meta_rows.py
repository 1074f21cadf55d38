"""Reading and rewriting one tensor's recorded metadata and values in a step file, whatever its trace
format: the dataset's own `meta` attribute up to format 3, its row of the tensor index from format 4;
its values in its own dataset up to format 4, in a span of a pack in format 5 (`tensor_names`,
`tensor_values`, `write_tensor_values`, `storage_of`).

Also `write_legacy_copy`: a run rewritten as format 3 wrote it (an attribute per dataset), and
`write_format4_copy`: a run rewritten as format 4 wrote it (a dataset per tensor, hard links).

Used by the damage families (corruptions.py, size_lies.py, pristine.py), by the tests that make a trace
lie or read an old format (tests/core/format/test_writer.py, tests/core/format/test_tensor_index.py,
tests/test_damaged_traces.py), and by benchmarks/index_open.py (the format-3 copy it times, made in a
child: `python -m tests.faults.meta_rows RUN LEGACY [--format 4] --out FILE`), so one lie is told the same
way to every format.
"""

from __future__ import annotations

import argparse
import json

from pathlib import Path

import h5py
import msgspec
import numpy as np

from ttrace_core.format.findings import FINDINGS
from ttrace_core.format.reader import INVENTORY_ATTR, MANIFEST_NAME, STATS_ONLY_METAS
from ttrace_core.format.tensor_index import LINKS_ATTR, TENSOR_INDEX, read_rows

RAW_BITS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "float8_e4m3fnuz": "uint8",
            "float8_e5m2fnuz": "uint8"}
"""How a dtype's values are stored (docs/trace-format.md), told here apart from ttrace's reader."""


def is_packed(handle: h5py.File) -> bool:
    """Format 5: the file keeps its tensors' values in packs (spans of `packs/N`), not a dataset each."""
    return int(handle.attrs.get("format_version", 0)) >= 5


def tensor_names(handle: h5py.File) -> list[str]:
    """The places of the file's tensors with values: their datasets (every name of one, hard links
    included) up to format 4, the names their index rows give in format 5."""
    if is_packed(handle):
        return [row["dataset"] for row in index_rows(handle) if row["dataset"] is not None]
    return [name for name in dataset_names(handle) if name != TENSOR_INDEX]


def _row_of(handle: h5py.File, name: str) -> dict:
    return next(row for row in index_rows(handle) if row["dataset"] == name)


def storage_of(handle: h5py.File, name: str) -> str:
    """The HDF5 dataset holding tensor `name`'s bytes: its own up to format 4, its pack in format 5."""
    return f"packs/{_row_of(handle, name)['pack']}" if is_packed(handle) else name


def stored_dtype(name: str) -> np.dtype:
    return np.dtype(RAW_BITS.get(name, name))


def span_of(handle: h5py.File, name: str, row: dict | None = None) -> tuple[str, int, int, np.dtype, tuple[int, ...]]:
    """Format 5: (pack, offset, bytes, stored dtype, shape) of tensor `name`, as its index row (`row`, when
    the caller has it) says."""
    row = row or _row_of(handle, name)
    dtype, shape = stored_dtype(row["meta"]["dtype"]), tuple(row["meta"]["local_shape"])
    return f"packs/{row['pack']}", row["offset"], int(np.prod(shape)) * dtype.itemsize, dtype, shape


def tensor_values(handle: h5py.File, name: str, row: dict | None = None) -> np.ndarray:
    """Tensor `name`'s stored values (raw bits for bf16 and fp8), read with plain h5py; `row`: its index
    row, when the caller has it (finding it reads the whole index)."""
    if not is_packed(handle):
        return handle[name][()]
    pack, offset, nbytes, dtype, shape = span_of(handle, name, row)
    return np.asarray(handle[pack][offset:offset + nbytes]).view(dtype).reshape(shape)


def write_tensor_values(handle: h5py.File, name: str, values: np.ndarray) -> None:
    """Overwrite tensor `name`'s values in place (the same dtype and size)."""
    if not is_packed(handle):
        handle[name][...] = values
        return
    pack, offset, nbytes, dtype, _ = span_of(handle, name)
    raw = np.ascontiguousarray(values, dtype=dtype).reshape(-1).view(np.uint8)
    assert raw.nbytes == nbytes, (name, raw.nbytes, nbytes)
    handle[pack][offset:offset + nbytes] = raw


def drop_tensor(handle: h5py.File, name: str, *, keep_row: bool) -> None:
    """Tensor `name`'s values gone from the file: its dataset deleted (up to format 4); in format 5 its bytes cut
    out of its pack (the later spans moved up, their rows with them) unless another row names them too.
    `keep_row`: its index row stays, naming what the file no longer holds (format 5: a pack it lacks)."""
    if not is_packed(handle):
        del handle[name]
        if not keep_row:
            drop_meta(handle, name)
        return
    rows = index_rows(handle)
    row = next(row for row in rows if row["dataset"] == name)
    if keep_row:
        row["pack"] = 10**6
        write_index_rows(handle, rows)
        return
    rows.remove(row)
    pack, offset, nbytes, _, _ = span_of(handle, name, row)
    shared = any(other["pack"] == row["pack"] and other["offset"] == offset for other in rows if other["dataset"])
    if not shared:
        later = sorted({other["offset"] for other in rows if other["pack"] == row["pack"] and other["offset"] is not None
                        and other["offset"] > offset})
        cut = (later[0] if later else offset + nbytes) - offset  # the span and the padding after it
        values = np.asarray(handle[pack][()])
        del handle[pack]
        handle[pack] = np.concatenate([values[:offset], values[offset + cut:]]) if later else values[:offset]
        for other in rows:
            if other["pack"] == row["pack"] and other["offset"] is not None and other["offset"] > offset:
                other["offset"] -= cut
    write_index_rows(handle, rows)


def add_pack(handle: h5py.File, values: np.ndarray | None = None, **create) -> tuple[int, str]:
    """A new pack holding `values`' bytes (or made by `create`, e.g. never written): (its number, its name)."""
    group = handle.require_group("packs")
    number = max((int(name) for name in group if name.isdigit()), default=-1) + 1
    if values is not None:
        group[str(number)] = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    else:
        group.create_dataset(str(number), **create)
    return number, f"packs/{number}"


def index_rows(handle: h5py.File) -> list[dict]:
    """The tensor index of a format-4 step file, as JSON-able rows (an empty list when it has none)."""
    if TENSOR_INDEX not in handle:
        return []
    text = bytes(handle[TENSOR_INDEX][()])
    return [json.loads(line) for line in text.split(b"\n") if line.strip()]


def write_index_text(handle: h5py.File, text: bytes) -> None:
    """Replace the tensor index with `text` (any bytes: a damaged index too)."""
    if TENSOR_INDEX in handle:
        del handle[TENSOR_INDEX]
    handle[TENSOR_INDEX] = np.frombuffer(text, dtype=np.uint8)


def write_index_rows(handle: h5py.File, rows: list[dict]) -> None:
    write_index_text(handle, b"\n".join(json.dumps(row).encode() for row in rows))


def read_meta(handle: h5py.File, dataset: str) -> dict:
    """The metadata recorded for `dataset`."""
    if TENSOR_INDEX in handle:
        return next(row["meta"] for row in index_rows(handle) if row["dataset"] == dataset)
    return json.loads(handle[dataset].attrs["meta"])


def write_meta(handle: h5py.File, dataset: str, meta: dict | str) -> None:
    """Record `meta` (a dict, or any text for a damaged record) as `dataset`'s metadata."""
    if TENSOR_INDEX not in handle:
        handle[dataset].attrs["meta"] = meta if isinstance(meta, str) else json.dumps(meta)
        return
    lines = []
    for row in index_rows(handle):
        if row["dataset"] != dataset:
            lines.append(json.dumps(row))
        elif isinstance(meta, dict):
            lines.append(json.dumps({**row, "meta": meta}))
        else:  # damaged text stands where the row's metadata was
            lines.append(f'{{"dataset": {json.dumps(dataset)}, "meta": {meta}}}')
    write_index_text(handle, "\n".join(lines).encode())


def drop_meta(handle: h5py.File, dataset: str) -> None:
    """Leave `dataset` without recorded metadata (its attribute, or its index row, deleted)."""
    if TENSOR_INDEX not in handle:
        del handle[dataset].attrs["meta"]
        return
    write_index_rows(handle, [row for row in index_rows(handle) if row["dataset"] != dataset])


def metas_by_dataset(handle: h5py.File) -> dict[str, dict]:
    """Every tensor dataset's recorded metadata; ValueError when an index lists a dataset twice (or is not JSON),
    KeyError when a dataset has no metadata attribute."""
    if TENSOR_INDEX not in handle:
        return {name: json.loads(handle[name].attrs["meta"]) for name in dataset_names(handle)}
    rows = [row for row in index_rows(handle) if row["dataset"] is not None]
    found = {row["dataset"]: row["meta"] for row in rows}
    if len(found) != len(rows):
        raise ValueError("the tensor index lists a dataset twice")
    return found


def dataset_names(handle: h5py.File) -> list[str]:
    """Every name of a dataset in the file; `visititems` gives a dataset behind two hard links (format 4
    writes them for a tensor recorded twice) under one name only."""
    names: list[str] = []
    handle.id.links.visit(lambda name: names.append(name.decode()))
    return [name for name in names if isinstance(handle.get(name, getlink=True), h5py.HardLink)
            and isinstance(handle.get(name), h5py.Dataset)]


_LEGACY_META = msgspec.json.Encoder()


def write_legacy_copy(run_dir: Path, legacy_dir: Path) -> None:
    """A format-4 or -5 run rewritten as format 3 wrote it: a dataset per tensor (links become copies) carrying
    its metadata as its `meta` attribute, stats-only records in STATS_ONLY_METAS, findings as they are."""
    legacy_dir.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((run_dir / MANIFEST_NAME).read_text())
    (legacy_dir / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 3}))
    for path in sorted(run_dir.glob("rank_*.step_*.h5")):
        with h5py.File(path, "r") as source, h5py.File(legacy_dir / path.name, "w") as legacy:
            for name, value in source.attrs.items():
                legacy.attrs[name] = value
            legacy.attrs["format_version"] = 3
            del legacy.attrs["num_links"]
            rows = read_rows(source, str(path))
            by_name = {row["dataset"]: row for row in index_rows(source)}
            for row in rows:
                if row.dataset is not None:
                    legacy[row.dataset] = tensor_values(source, row.dataset, by_name[row.dataset])
                    legacy[row.dataset].attrs["meta"] = _LEGACY_META.encode(row.meta).decode()
            stats_only = [_LEGACY_META.encode(row.meta) for row in rows if row.dataset is None]
            if stats_only:
                legacy[STATS_ONLY_METAS] = np.frombuffer(b"\n".join(stats_only), dtype=np.uint8)
            if FINDINGS in source:
                legacy[FINDINGS] = source[FINDINGS][()]
            legacy.attrs[INVENTORY_ATTR] = len(rows)


def write_format4_copy(run_dir: Path, copy_dir: Path) -> None:
    """A format-5 run rewritten as format 4 wrote it: a dataset per tensor, a second row of the same bytes a
    hard link to the first, every row without pack and offset; attributes, findings and stats-only rows as they are."""
    copy_dir.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((run_dir / MANIFEST_NAME).read_text())
    (copy_dir / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 4}))
    for path in sorted(run_dir.glob("rank_*.step_*.h5")):
        with h5py.File(path, "r") as source, h5py.File(copy_dir / path.name, "w") as copy:
            for name, value in source.attrs.items():
                copy.attrs[name] = value
            copy.attrs["format_version"] = 4
            first_of_span: dict[tuple, str] = {}
            rows = index_rows(source)
            for row in rows:
                if row["dataset"] is not None:
                    span = (row["pack"], row["offset"], tuple(row["meta"]["local_shape"]), row["meta"]["dtype"])
                    if span in first_of_span:
                        copy[row["dataset"]] = copy[first_of_span[span]]  # a hard link, as format 4 wrote it
                    else:
                        copy[row["dataset"]] = tensor_values(source, row["dataset"], row)
                        first_of_span[span] = row["dataset"]
                row.pop("pack", None), row.pop("offset", None)
            write_index_rows(copy, rows)
            if FINDINGS in source:
                copy[FINDINGS] = source[FINDINGS][()]
            copy.attrs[LINKS_ATTR] = sum(1 for row in rows if row["dataset"] is not None) - len(first_of_span)


def main() -> None:
    parser = argparse.ArgumentParser(description="Rewrite a run as format 3 (write_legacy_copy) or 4 (write_format4_copy) wrote it.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("legacy_dir", type=Path)
    parser.add_argument("--format", type=int, choices=(3, 4), default=3)
    parser.add_argument("--out", type=Path, required=True, help="JSON: the legacy copy's directory")
    args = parser.parse_args()
    (write_legacy_copy if args.format == 3 else write_format4_copy)(args.run_dir, args.legacy_dir)
    args.out.write_text(json.dumps({"legacy_dir": str(args.legacy_dir)}))


if __name__ == "__main__":
    main()
