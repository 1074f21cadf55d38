"""Reading one tensor without indexing the run: every rank's shard of one key (the tensor page), and the
forward inputs one rank recorded for one module (a one-module replay). Part of the trace store
(reader.py): the same containment, link and storage checks, on the few datasets these need.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import h5py
import torch

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.containment import contained, refuse_external_storage, refuse_links
from ttrace_core.format.datasets import STRING, damaged_file_errors, read_values, scalar_attribute, stored_dtype, tensor_from_array
from ttrace_core.format.reader import (STATS_ONLY_METAS, dataset_path, is_indexed, open_step_file, remedy_of, stats_only_metas,
                                       step_file_name)
from ttrace_core.format.records import meta_from_json
from ttrace_core.format.schema import TensorKey, TensorMeta
from ttrace_core.format.tensor_index import IndexRow, read_rows


def read_shards(run_dir: str | os.PathLike, key: TensorKey, world_size: int) -> list[tuple[TensorMeta, torch.Tensor | None]]:
    """Every rank's shard of one tensor, opening only that dataset in each rank's step file.

    Values are None for stats-only shards. A rank that did not record the key is skipped.
    """
    run_dir = Path(run_dir)
    path = dataset_path(key)
    shards = []
    for rank in range(world_size):
        file_path = contained(run_dir, step_file_name(rank, key.step))
        with open_step_file(file_path, rank) as handle, damaged_file_errors(f"{file_path}:{path}", remedy_of(rank)):
            refuse_links(handle, str(file_path))
            if is_indexed(handle, file_path, rank):
                shards += _indexed_shards(handle, key, file_path, rank)
            elif path in handle:
                shards.append(_shard_of(handle[path], f"{file_path}:{path}", rank))
            elif STATS_ONLY_METAS in handle:
                refuse_external_storage(handle[STATS_ONLY_METAS].id, f"{file_path}:{STATS_ONLY_METAS}")
                shards += [(m, None) for m in stats_only_metas(handle, str(file_path)) if m.key == key and m.rank == rank]
    if not shards:
        raise TraceFormatError(f"{run_dir}: no rank recorded {key}; pick a tensor the run holds (`ttrace inspect --tensors`)")
    return shards


def _indexed_shards(handle: h5py.File, key: TensorKey, path: Path, rank: int) -> list[tuple[TensorMeta, torch.Tensor | None]]:
    """The shards of `key` one format-4 step file holds, from its index (one read) and its dataset."""
    rows = [row for row in read_rows(handle, str(path)) if row.meta.key == key and row.meta.rank == rank]
    return [(row.meta, None) if row.dataset is None else _row_shard(handle, row, path, rank) for row in rows]


def _row_shard(handle: h5py.File, row: IndexRow, path: Path, rank: int) -> tuple[TensorMeta, torch.Tensor | None]:
    where = f"{path}:{row.dataset}"
    dataset = handle.get(row.dataset)
    if not isinstance(dataset, h5py.Dataset):
        raise TraceFormatError(f"{where}: listed in the tensor index, but the file holds no such dataset; "
                               f"{remedy_of(rank)}")
    return _shard_of(dataset, where, rank, row.meta)


def _shard_of(dataset: h5py.Dataset, where: str, rank: int, meta: TensorMeta | None = None,
              ) -> tuple[TensorMeta, torch.Tensor | None]:
    """One dataset's metadata (`meta`: its index row's; by default its own attribute, up to format 3)
    and values (None for a stats-only shard), its storage checked first."""
    refuse_external_storage(dataset.id, where)
    if meta is None:
        meta = meta_from_json(scalar_attribute(dataset, "meta", STRING, where, remedy_of(rank)) or b"", where)
    if meta.stats_only:
        return meta, None
    array = read_values(dataset, stored_dtype(meta.dtype), meta.local_shape, where, remedy_of(rank))
    return meta, tensor_from_array(array, meta.dtype, where)


def forward_inputs(run_dir: str | os.PathLike, rank: int, step: int, fqn: str) -> dict[int, dict[str, torch.Tensor]]:
    """{global micro-batch: {slot: value}} of the forward inputs one rank recorded for one module,
    reading only those datasets (names are listed, nothing else is opened)."""
    path = contained(run_dir, step_file_name(rank, step))
    prefix = f"{fqn or '<root>'}#input."
    calls: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    with open_step_file(path, rank) as handle, damaged_file_errors(f"{path}:forward", remedy_of(rank)):
        refuse_links(handle, str(path))
        if is_indexed(handle, path, rank):
            for row in read_rows(handle, str(path)):
                if row.dataset is not None and row.dataset.startswith("forward/") and row.dataset.split("/")[-1].startswith(prefix):
                    meta, value = _row_shard(handle, row, path, rank)
                    calls[meta.key.micro_batch][meta.key.slot] = _replayable(value, f"{path}:{row.dataset}")
            return dict(calls)
        forward = handle.get("forward")
        for group_name in (sorted(forward) if forward is not None else []):
            group = forward[group_name]
            for name in group:
                if name.startswith(prefix):
                    where = f"{path}:forward/{group_name}/{name}"
                    meta, value = _shard_of(group[name], where, rank)
                    calls[meta.key.micro_batch][meta.key.slot] = _replayable(value, where)
    return dict(calls)


def _replayable(value: torch.Tensor | None, where: str) -> torch.Tensor:
    if value is None:
        raise TraceFormatError(f"{where}: recorded in stats-only mode; it holds no values to replay with, record its "
                               "inputs with values")
    return value
