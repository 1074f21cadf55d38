"""Part of stage 3 (compare): a window's small tensors, gathered straight from their shards' bytes into batches.

Input: keys whose tensors are small (batched.batchable) and whose metadata agree, both runs' readers, and each
key's tolerance. Output: each key's `ValueSums`, the very numbers `batched_sums` gives for its assembled tensors.
A key taken no faster this way is left out, and the engine reads and assembles it alone (which words whatever is
wrong with it): shards `canonicalize` does more than copy into place (partial sums, flat ranges, a blocked view,
layouts that do not assemble), a candidate replica whose bytes are not those of its block's first, NaN or Inf,
a shard not read this way (trace format 4 and older, or a file that could not give its bytes).

Why: assembling each small tensor (a torch tensor per shard, its assembly looked up, a copy per block, then a
flattening into the batch) cost as much as the rest of its comparison. Here each set of layouts is an index map
planned once (canonicalize.shards.gather_plan), a window's shards are read from each file in a few `pread`s into
one buffer (RunReader.read_raw), and each batch of each run is one `np.take` of its elements out of that buffer,
converted to float64 as `canonicalize`'s tensors were (torch's conversion from the stored dtype), then summed by
batched.py's arithmetic: the calls are per batch and per set of layouts, not per tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ttrace_core.canonicalize.shards import GatherPlan, gather_plan
from ttrace_core.compare.batched import BATCH_ELEMENTS, segment_sums
from ttrace_core.compare.metrics import WORKSPACE, ValueSums
from ttrace_core.compare.results import Tolerance
from ttrace_core.format.datasets import raw_bits_view, stored_dtype
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TensorKey, TensorMeta


@dataclass(slots=True)
class _Run:
    """One run's shards of the window, read (`RunReader.read_raw`)."""

    buffer: np.ndarray
    offsets: list[int | None]
    views: dict[str, np.ndarray]
    """Stored dtype name -> the buffer viewed as its elements."""


@dataclass(slots=True)
class _Gathered:
    """Where one key's logical tensor lies in a run's buffer."""

    plan: GatherPlan
    bases: list[int]
    """Each shard's first element in the buffer viewed as the stored dtype."""
    dtype: str
    scale: float
    shape: tuple[int, ...]
    """The logical tensor's (its layout's global shape: what `canonicalize` assembles)."""


READ_BYTES = 32 * 2**20
"""The most bytes of shards read at once: keys are taken in parts of at most this many (a small tensor replicated on
many ranks has a shard on each, and a window's worth of them read together could take gigabytes)."""


def window_sums(keys: list[TensorKey], reference: RunReader, candidate: RunReader,
                tolerances: dict[TensorKey, Tolerance], max_bytes: int | None = None) -> dict[TensorKey, ValueSums]:
    """The sums of those of `keys` this way takes (the module's docstring says which it leaves out), their shards
    read at most READ_BYTES (and half of `max_bytes`, compare's memory budget) at a time."""
    limit = READ_BYTES if max_bytes is None else max(1, min(READ_BYTES, max_bytes // 2))
    sums: dict[TensorKey, ValueSums] = {}
    part: list[TensorKey] = []
    held = 0
    for key in keys:  # (at most: each shard counted as the whole tensor, 8 bytes an element)
        ref_metas = reference.index[key]
        nbytes = (len(ref_metas) + len(candidate.index[key])) * math.prod(ref_metas[0].layout.global_shape) * 8
        if part and held + nbytes > limit:
            sums.update(_part_sums(part, reference, candidate, tolerances))
            part, held = [], 0
        part.append(key)
        held += nbytes
    if part:
        sums.update(_part_sums(part, reference, candidate, tolerances))
    return sums


def _part_sums(keys: list[TensorKey], reference: RunReader, candidate: RunReader,
               tolerances: dict[TensorKey, Tolerance]) -> dict[TensorKey, ValueSums]:
    runs = [_read(reader, keys) for reader in (candidate, reference)]
    found_at: list[tuple[TensorKey, _Gathered, _Gathered]] = []
    (actual_index, actual_run), (expected_index, expected_run) = zip((candidate.index, reference.index), runs)
    actual_at = expected_at = 0  # (each run's first shard of the key in its buffer's offsets)
    for key in keys:
        actual_metas, expected_metas = actual_index[key], expected_index[key]
        actual = _gathered(actual_metas, actual_run, actual_at, replicas_checked=True)
        expected = _gathered(expected_metas, expected_run, expected_at, replicas_checked=False)
        actual_at += len(actual_metas)
        expected_at += len(expected_metas)
        if actual is not None and expected is not None:
            found_at.append((key, actual, expected))
    groups: dict[tuple, list[tuple[TensorKey, _Gathered, _Gathered]]] = {}
    for entry in found_at:  # one index map per set of layouts: gathered for all its keys at once
        _, actual, expected = entry
        groups.setdefault((actual.dtype, expected.dtype, id(actual.plan), id(expected.plan)), []).append(entry)
    by_dtypes: dict[tuple[str, str], list[list[tuple[TensorKey, _Gathered, _Gathered]]]] = {}
    for (actual_dtype, expected_dtype, _, _), entries in groups.items():
        by_dtypes.setdefault((actual_dtype, expected_dtype), []).append(entries)
    sums: dict[TensorKey, ValueSums] = {}
    for (actual_dtype, expected_dtype), entries_by_plan in by_dtypes.items():
        _sum_dtype_pair(entries_by_plan, runs, (actual_dtype, expected_dtype), tolerances, sums)
    return sums


def _read(reader: RunReader, keys: list[TensorKey]) -> _Run:
    buffer, offsets = reader.read_raw([meta for key in keys for meta in reader.index[key]])
    return _Run(buffer=buffer, offsets=offsets, views={})


def _view(run: _Run, dtype: str) -> np.ndarray:
    if (view := run.views.get(dtype)) is None:
        stored = stored_dtype(dtype)
        usable = run.buffer[:run.buffer.nbytes - run.buffer.nbytes % stored.itemsize]
        view = run.views[dtype] = usable.view(stored)
    return view


def _gathered(metas: list[TensorMeta], run: _Run, position: int, replicas_checked: bool) -> _Gathered | None:
    """Where the tensor of `metas` (read from `position` of `run.offsets` on) lies, or None when it is left out."""
    offsets = run.offsets[position:position + len(metas)]
    if None in offsets:
        return None
    first_meta = metas[0]
    plan = gather_plan(((first_meta.rank, first_meta.layout, first_meta.local_shape),) if len(metas) == 1 else
                       tuple([(meta.rank, meta.layout, meta.local_shape) for meta in metas]))
    if plan is None:
        return None
    dtype = first_meta.dtype
    itemsize = stored_dtype(dtype).itemsize
    if replicas_checked and plan.replicas:
        buffer = run.buffer
        for first, other in plan.replicas:  # (bytes compared as bytes: a fifth of np.array_equal's cost on a small shard)
            start, nbytes = offsets[first], math.prod(metas[first].local_shape) * itemsize
            if buffer[start:start + nbytes].tobytes() != buffer[offsets[other]:offsets[other] + nbytes].tobytes():
                return None  # replicas that differ: the engine measures their drift
    return _Gathered(plan=plan, bases=[offset // itemsize for offset in offsets], dtype=dtype, scale=first_meta.scale,
                     shape=tuple(first_meta.layout.global_shape))



def _sum_dtype_pair(entries_by_plan: list[list[tuple[TensorKey, _Gathered, _Gathered]]], runs: list[_Run],
                    dtypes: tuple[str, str], tolerances: dict[TensorKey, Tolerance], sums: dict[TensorKey, ValueSums]) -> None:
    """Every key of one (candidate, reference) pair of stored dtypes, batch by batch."""
    keys: list[TensorKey] = []
    shapes: list[tuple[int, ...]] = []
    lengths: list[int] = []
    indices: list[list[np.ndarray]] = [[], []]
    scales: list[list[float]] = [[], []]
    for entries in entries_by_plan:
        for side in (0, 1):
            plan = entries[0][1 + side].plan
            bases = np.array([entry[1 + side].bases for entry in entries], dtype=np.int64)
            indices[side].append((bases[:, plan.shard] + plan.local).reshape(-1))
            scales[side] += [entry[1 + side].scale for entry in entries]
        keys += [entry[0] for entry in entries]
        shapes += [entry[2].shape for entry in entries]
        lengths += [entries[0][1].plan.shard.size] * len(entries)
    flat = [np.concatenate(parts) for parts in indices]
    views = [_view(run, dtype) for run, dtype in zip(runs, dtypes)]
    bits = [raw_bits_view(dtype, "") for dtype in dtypes]
    start = element = 0
    while start < len(keys):
        stop, elements = start, 0
        while stop < len(keys) and (elements + lengths[stop] <= BATCH_ELEMENTS or stop == start):
            elements += lengths[stop]
            stop += 1
        batch_lengths = np.array(lengths[start:stop], dtype=np.int64)
        segments = np.repeat(np.arange(stop - start), batch_lengths)
        values = []
        for side, into in ((0, WORKSPACE.actual), (1, WORKSPACE.expected)):
            raw = torch.from_numpy(np.take(views[side], flat[side][element:element + elements]))
            promoted = into[:elements]
            promoted.copy_(raw if bits[side] is None else raw.view(bits[side]))
            array = promoted.numpy()
            batch_scales = scales[side][start:stop]
            if any(scale != 1 for scale in batch_scales):
                np.divide(array, np.asarray(batch_scales, dtype=np.float64)[segments], out=array)
            values.append(array)
        batch_keys = keys[start:stop]
        found = segment_sums(values[0], values[1], batch_lengths, segments, [tolerances[key] for key in batch_keys],
                             shapes[start:stop])
        for key, key_sums in zip(batch_keys, found):
            if key_sums is not None:
                sums[key] = key_sums
        start, element = stop, element + elements

