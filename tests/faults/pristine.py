"""The robustness cases' oracle: is a damaged trace pair *materially* different from the pristine one?

Material: a recorded value moved by more than the tolerance its tensor was judged with in the
pristine comparison (NaN or Inf introduced counts), a dataset or file missing or unreadable, or
metadata whose meaning changed in a field the comparison depends on (everything but `stats` and `seq`), or a
manifest field that says how the run was laid out, or a model fact stated with another value (a
fact removed contradicts nothing). Read with plain h5py and json, independently of
ttrace's reader, so that the oracle does not share ttrace's blind spots; only a file whose global
heap would make HDF5 loop forever is found with ttrace's own check (global_heap.py), since h5py
cannot read it either.

Used by damage_runner.py (a case whose `material` is None is decided here, in a process of its own),
so by tests/test_robustness.py and benchmarks/robustness.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np

from ttrace_core import api
from ttrace_core.format.schema import TensorKey
from ttrace_core.format.global_heap import refuse_looping_heaps
from ttrace_core.format.reader import MANIFEST_NAME, tensor_from_array
from ttrace_core.format.tensor_index import TENSOR_INDEX

from tests.faults.meta_rows import dataset_names, is_packed, metas_by_dataset, span_of, tensor_values

# Manifest fields that say how the run was laid out or what it computed.
JUDGED_MANIFEST = ("format_version", "role", "world_size", "degrees", "mesh_shape", "mesh_axis_names",
                   "rank_coordinates", "precision", "model")


class Pristine:
    def __init__(self, reference: Path, candidate: Path) -> None:
        comparison = api.run_comparison(reference, candidate)
        assert comparison.verdict == "equivalent", f"the base pair must pass with full coverage: {comparison.findings}"
        self.allowed = {c.key: c.tolerance.rel * (c.reference_norm or 0.0) + c.tolerance.abs * math.sqrt(c.numel or 0)
                        for c in comparison.comparisons if c.tolerance is not None}
        self.runs = {"reference": _snapshot(reference), "candidate": _snapshot(candidate)}
        self.manifests = {role: json.loads((run / MANIFEST_NAME).read_text())
                          for role, run in (("reference", reference), ("candidate", candidate))}

    def material_change(self, reference: Path, candidate: Path) -> bool:
        for role, run in (("reference", reference), ("candidate", candidate)):
            if self._manifest_changed(role, run):
                return True
            for name, datasets in self.runs[role].items():
                if self._file_changed(run / name, datasets):
                    return True
        return False

    def _manifest_changed(self, role: str, run: Path) -> bool:
        try:
            now = json.loads((run / MANIFEST_NAME).read_text())
        except (OSError, ValueError, RecursionError):
            return True
        before = self.manifests[role]
        if not isinstance(now, dict) or not isinstance(now.get("model"), dict):
            return True
        layout_changed = any(now.get(f) != before.get(f) for f in JUDGED_MANIFEST if f != "model")
        return layout_changed or _contradicts(before["model"], now["model"])

    def _file_changed(self, path: Path, datasets: dict[str, tuple[dict, np.ndarray]]) -> bool:
        try:
            with h5py.File(path, "r") as handle:
                refuse_looping_heaps(handle, path, "")  # HDF5 itself would hang on such a file: it cannot be read
                metas = metas_by_dataset(handle)  # the attributes' or the tensor index's (formats 4 and 5)
                if is_packed(handle):
                    if _packs_changed(handle, metas):
                        return True
                else:  # every name: a hard link (format 4) is a tensor of its own
                    if set(dataset_names(handle)) - {TENSOR_INDEX} != set(datasets):
                        return True
                if set(metas) != set(datasets):
                    return True
                return any(self._dataset_changed(tensor_values(handle, name), metas[name], *datasets[name])
                           for name in datasets)
        except Exception:  # noqa: BLE001 - anything h5py cannot read is material: ttrace must say so
            return True

    def _dataset_changed(self, now: np.ndarray, now_meta: dict, meta: dict, values: np.ndarray) -> bool:
        if _judged(now_meta) != _judged(meta):
            return True
        if now.dtype != values.dtype or now.shape != values.shape:
            return True
        if np.array_equal(now, values, equal_nan=False) or values.size == 0:
            return False
        before = tensor_from_array(values, meta["dtype"], "").double()
        after = tensor_from_array(now, meta["dtype"], "").double()
        if bool((before.isfinite() != after.isfinite()).any()):
            return True
        key = TensorKey(**meta["key"])
        return float((after - before).norm()) > self.allowed.get(key, 0.0)


def _packs_changed(handle: h5py.File, metas: dict[str, dict]) -> bool:
    """Format 5: whether a pack a row names is one ttrace would not read as bytes (not a contiguous, unfiltered
    uint8 row, or holding fewer bytes than the rows' spans need): its tensors then cannot be read as recorded."""
    for name in metas:
        pack, offset, nbytes, _, _ = span_of(handle, name)
        dataset = handle.get(pack)
        if not isinstance(dataset, h5py.Dataset) or dataset.dtype != np.uint8 or dataset.ndim != 1 or \
                dataset.chunks is not None or dataset.id.get_storage_size() < dataset.shape[0] or \
                offset + nbytes > dataset.shape[0]:
            return True
    return False


def _contradicts(before: dict, now: dict) -> bool:
    """Whether the damaged `model` states a fact otherwise: a fact it no longer states contradicts
    nothing (a trace recorded by a bare Tracer states none, and two runs are comparable on the facts
    both state), one it states with another value does."""
    return any(now[name] != before[name] for name in set(before) & set(now))


# The format's fields and the value an absent one means (docs/trace-format.md).
_FIELDS = {"rank": None, "dtype": None, "local_shape": None, "scale": 1.0, "stats_only": False, "fp8_scale_inv": None}
_KEY_FIELDS = {"step": None, "micro_batch": None, "phase": None, "fqn": None, "slot": None, "call": 0}
_LAYOUT_FIELDS = {"global_shape": None, "mesh_shape": [], "coordinate": [], "placements": [], "mesh_axis_names": [],
                  "flat_range": None}


def _judged(meta: dict) -> dict:
    """What a shard's metadata means to a verdict: its fields with absent ones at their defaults and
    unknown names dropped (a flipped bit that turns `call` into `canl` leaves call at its default 0)."""
    def meaning(record, fields: dict) -> dict:
        record = record if isinstance(record, dict) else {}
        return {name: record.get(name, default) for name, default in fields.items()}
    return {**meaning(meta, _FIELDS), "key": meaning(meta.get("key"), _KEY_FIELDS),
            "layout": meaning(meta.get("layout"), _LAYOUT_FIELDS)}


def _snapshot(run: Path) -> dict[str, dict[str, tuple[dict, np.ndarray]]]:
    files = {}
    for path in sorted(run.glob("rank_*.step_*.h5")):
        with h5py.File(path, "r") as handle:
            datasets = {name: (meta, tensor_values(handle, name)) for name, meta in metas_by_dataset(handle).items()}
        files[path.name] = datasets
    return files
