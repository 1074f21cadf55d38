"""Reading one tensor without indexing the run: every rank's shard of one key (the tensor page), and the
forward inputs one rank recorded for one module (a one-module replay). Part of the trace store
(reader.py): each step file is opened through the same wall (step_file.py), with the same checks, and
only the tensors asked for are placed and read.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.naming import display_fqn
from ttrace_core.format.schema import TensorKey, TensorMeta
from ttrace_core.format.step_file import dataset_path, open_step


def read_shards(run_dir: str | os.PathLike, key: TensorKey, world_size: int) -> list[tuple[TensorMeta, torch.Tensor | None]]:
    """Every rank's shard of one tensor. Values are None for stats-only shards. A rank that did not
    record the key is skipped."""
    path = dataset_path(key)
    shards = []
    for rank in range(world_size):
        with open_step(run_dir, rank, key.step, wanted=path.__eq__) as step_file:
            shards += [(meta, None if meta.stats_only else step_file.read(meta)) for meta in step_file.metas]
    if not shards:
        raise TraceFormatError(f"{run_dir}: no rank recorded {key}; pick a tensor the run holds (`ttrace inspect --tensors`)")
    return shards


def forward_inputs(run_dir: str | os.PathLike, rank: int, step: int, fqn: str) -> dict[int, dict[str, torch.Tensor]]:
    """{global micro-batch: {slot: value}} of the forward inputs one rank recorded for one module,
    reading only those tensors' values."""
    prefix = f"{display_fqn(fqn)}#input."

    def wanted(path: str) -> bool:
        return path.startswith("forward/") and path.rsplit("/", 1)[-1].startswith(prefix)

    calls: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    with open_step(run_dir, rank, step, wanted=wanted) as step_file:
        for meta in step_file.metas:
            if meta.stats_only:
                raise TraceFormatError(f"{Path(step_file.path)}:{dataset_path(meta.key)}: recorded in stats-only mode; "
                                       "it holds no values to replay with, record its inputs with values")
            calls[meta.key.micro_batch][meta.key.slot] = step_file.read(meta)
    return dict(calls)
