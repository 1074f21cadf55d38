"""One tensor under the microscope: what the dashboard's tensor page shows (via `api.tensor_view`).

Input: a reference and a candidate run directory and one `TensorKey`. Output: a `TensorView`, the
canonical (logical, loss scale undone) arrays of both runs in float64, the element-wise |difference|
as a downsampled 2-D image, a histogram of element-wise relative errors, the worst elements, and
the candidate's shard map (which rank holds which block, and how far that block is off).
Reads only the datasets of that key, one per rank: the rest of the trace is never opened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ttrace_core.canonicalize import placements as pl
from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.canonicalize.shards import RecordedShard, canonicalize, shard
from ttrace_core.compare.metrics import relative_difference
from ttrace_core.errors import LayoutError, TraceFormatError
from ttrace_core.format.schema import TensorKey
from ttrace_core.format.reader import read_manifest
from ttrace_core.format.shard_reads import read_shards

IMAGE_MAX_SIDE = 192
"""The difference image is max-pooled down to at most this many cells a side."""
HISTOGRAM_EDGES = np.logspace(-12, 4, 33)
"""Relative-error bins, log10 from -12 to 4 (half a decade each); smaller errors fall in the first."""


@dataclass(kw_only=True, slots=True)
class ShardInfo:
    rank: int
    coordinate: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_axis_names: tuple[str, ...]
    region: tuple[tuple[int, int], ...]
    """(start, stop) per dim of the logical tensor."""
    flat_range: tuple[int, int] | None
    local_shape: tuple[int, ...]
    error: float | None
    """||local - reference's block|| / ||reference's block||; None for partial placements (only the
    sum over ranks means something) and stats-only shards."""
    note: str = ""


@dataclass(kw_only=True, slots=True)
class TensorView:
    key: TensorKey
    dtype: str
    shape: tuple[int, ...]
    reference: np.ndarray
    candidate: np.ndarray
    image: np.ndarray
    """max |candidate - reference| over blocks of the 2-D view (rows: leading dims flattened)."""
    image_block: tuple[int, int]
    """How many elements of the 2-D view (rows, columns) one image cell covers."""
    image_view_shape: tuple[int, int]
    histogram_edges: np.ndarray
    histogram_counts: np.ndarray
    num_exact: int
    """Elements whose relative error is 0 (not in the histogram)."""
    worst: list[dict] = field(default_factory=list)
    """{"index", "reference", "candidate", "abs_diff", "rel_diff"} by decreasing |difference|."""
    shards: list[ShardInfo] = field(default_factory=list)
    replica_drift: ReplicaDrift | None = None


def _logical(run_dir: Path, key: TensorKey) -> tuple[torch.Tensor, list, ReplicaDrift | None]:
    manifest = read_manifest(run_dir)
    recorded = read_shards(run_dir, key, manifest.world_size)
    if any(value is None for _, value in recorded):
        raise TraceFormatError(f"{run_dir}: {key} was recorded in stats-only mode; it has no values to show")
    shards = [RecordedShard(rank=meta.rank, layout=meta.layout, value=value) for meta, value in recorded]
    canonical = canonicalize(shards, key)
    return canonical.full.double() / recorded[0][0].scale, recorded, canonical.replica_drift


def as_matrix(array: np.ndarray) -> np.ndarray:
    """A 2-D view of any tensor: leading dims flattened into rows; a vector (or a scalar) is one row, so the
    page draws it as the vector it is (wrapped into a square, 16 elements read as a 4 x 4 image)."""
    if array.ndim >= 2:
        return array.reshape(-1, array.shape[-1])
    return array.reshape(1, -1)


def max_pool(matrix: np.ndarray, max_side: int = IMAGE_MAX_SIDE) -> tuple[np.ndarray, tuple[int, int]]:
    """Downsample by the max over blocks, so a single bad element still shows."""
    rows, columns = matrix.shape
    block = (max(1, math.ceil(rows / max_side)), max(1, math.ceil(columns / max_side)))
    out_rows, out_columns = math.ceil(rows / block[0]), math.ceil(columns / block[1])
    padded = np.full((out_rows * block[0], out_columns * block[1]), np.nan)
    padded[:rows, :columns] = matrix
    blocks = padded.reshape(out_rows, block[0], out_columns, block[1])
    with np.errstate(all="ignore"):
        pooled = np.nanmax(np.where(np.isnan(blocks), -np.inf, blocks), axis=(1, 3))
    return np.where(np.isneginf(pooled), np.nan, pooled), block


def _worst_elements(reference: np.ndarray, candidate: np.ndarray, abs_diff: np.ndarray, count: int) -> list[dict]:
    flat = np.nan_to_num(abs_diff.reshape(-1), nan=np.inf)
    count = min(count, flat.size)
    if count == 0:
        return []
    positions = np.argpartition(-flat, count - 1)[:count]
    positions = positions[np.argsort(-flat[positions], kind="stable")]
    rows = []
    for position in positions:
        index = tuple(int(i) for i in np.unravel_index(position, reference.shape))
        expected, actual = float(reference[index]), float(candidate[index])
        rows.append({"index": index, "reference": expected, "candidate": actual, "abs_diff": float(abs_diff[index]),
                     "rel_diff": relative_difference(actual, expected)})
    return rows


def _shard_infos(recorded: list, reference_full: torch.Tensor) -> list[ShardInfo]:
    infos = []
    for meta, value in recorded:
        layout = meta.layout
        region = tuple((start, start + length) for start, length in pl.local_region(layout))
        error, note = None, ""
        if pl.axes_of_kind(layout, "partial"):
            note = "partial: only the sum over ranks is the logical tensor"
        else:
            try:
                expected = shard(reference_full, layout)
                local = value.double() / meta.scale
                norm = float(torch.linalg.vector_norm(expected))
                diff = float(torch.linalg.vector_norm(local - expected))
                error = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
            except LayoutError as why:
                note = str(why)
        infos.append(ShardInfo(rank=meta.rank, coordinate=layout.coordinate, placements=layout.placements,
                               mesh_axis_names=layout.mesh_axis_names, region=region, flat_range=layout.flat_range,
                               local_shape=meta.local_shape, error=error, note=note))
    return sorted(infos, key=lambda info: info.rank)


def _relative_errors(reference: np.ndarray, abs_diff: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        relative = abs_diff / np.abs(reference)
    return relative[np.isfinite(relative)]


def build_tensor_view(reference_dir: Path, candidate_dir: Path, key: TensorKey, *,
                      region: tuple[slice, ...] | None = None, num_worst: int = 10) -> TensorView:
    expected, _, _ = _logical(reference_dir, key)
    actual, recorded, drift = _logical(candidate_dir, key)
    if actual.shape != expected.shape:
        raise LayoutError(f"{key}: shape {tuple(actual.shape)} in the candidate, {tuple(expected.shape)} in the "
                          "reference; the tensor view needs equal shapes")
    shards = _shard_infos(recorded, expected)
    reference, candidate = expected.numpy(), actual.numpy()
    if region is not None:
        reference, candidate = reference[region], candidate[region]
    with np.errstate(all="ignore"):
        abs_diff = np.abs(candidate - reference)
    matrix = as_matrix(abs_diff)
    image, block = max_pool(matrix)
    relative = _relative_errors(reference, abs_diff)
    counts, _ = np.histogram(np.clip(relative[relative > 0], HISTOGRAM_EDGES[0], HISTOGRAM_EDGES[-1]), HISTOGRAM_EDGES)
    return TensorView(key=key, dtype=recorded[0][0].dtype, shape=tuple(expected.shape), reference=reference,
                      candidate=candidate, image=image, image_block=block, image_view_shape=tuple(matrix.shape),
                      histogram_edges=HISTOGRAM_EDGES, histogram_counts=counts, num_exact=int((abs_diff == 0).sum()),
                      worst=_worst_elements(reference, candidate, abs_diff, num_worst), shards=shards,
                      replica_drift=drift)
