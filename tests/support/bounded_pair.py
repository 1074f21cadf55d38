"""A synthetic pair for comparing in bounded memory: tensors large enough to be cut into slabs, with
known faults planted, and a check that two comparisons agree row for row.

Generates (`write_pair`) a 1-rank reference and a 2-rank candidate of fp32 tensors of (rows, WIDTH,
DEPTH): even ones split over rows (S(0)), odd ones replicated; tensor 1's rank-1 replica drifts by 1e-3
and tensor 2 mismatches in one element. `same_rows` says whether two comparisons' rows agree
(statuses and indices equal, numbers within float rounding).

Used by tests/core/test_bounded_compare.py (slab by slab against whole, peak RSS under --max-memory)
and benchmarks/compare_memory.py (peak RSS per budget, results/compare_memory.{md,json}).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, write_manifest

WIDTH, DEPTH = 8, 512
"""Each tensor is (rows, WIDTH, DEPTH): rows split over the candidate's ranks, the other dims free to slab."""


def _layout(shape: tuple[int, ...], rank: int, split: bool) -> Layout:
    if not split:
        return Layout.replicated(shape)
    return Layout(global_shape=shape, mesh_shape=(2,), coordinate=(rank,), placements=("S(0)",), mesh_axis_names=("tp",))


def write_pair(root: Path, *, num_tensors: int, rows: int) -> tuple[Path, Path]:
    """A reference and a candidate of `num_tensors` fp32 tensors of (rows, WIDTH, DEPTH): even ones split
    over rows, odd ones replicated; tensor 1's rank-1 replica drifts by 1e-3, tensor 2 mismatches in one element."""
    shape = (rows, WIDTH, DEPTH)
    for role, world_size in (("reference", 1), ("candidate", 2)):
        run_dir = root / role
        write_manifest(run_dir, RunManifest(role=role, world_size=world_size, degrees={"tp": world_size},
                                            model={"tensors": num_tensors, "shape": list(shape)},
                                            mesh_shape=[world_size], mesh_axis_names=["tp"],
                                            rank_coordinates=[[r] for r in range(world_size)]))
        for rank in range(world_size):
            writer = RunWriter(run_dir, rank)
            writer.begin_step(0)
            for index in range(num_tensors):
                full = torch.randn(shape, generator=torch.Generator().manual_seed(index))
                split = role == "candidate" and index % 2 == 0
                local = full[rank * rows // 2:(rank + 1) * rows // 2].clone() if split else full
                if role == "candidate" and index == 1 and rank == 1:
                    local = local * (1 + 1e-3)
                if role == "candidate" and index == 2 and rank == 1:
                    local[0, 2, 1] += 1.0
                key = TensorKey(step=0, micro_batch=0, phase="forward", fqn=f"layers.{index}", slot="output.0")
                writer.write(TensorMeta(key=key, rank=rank, dtype="float32", local_shape=tuple(local.shape),
                                        layout=_layout(shape, rank, split), seq=index), local)
            writer.end_step()
    return root / "reference", root / "candidate"


def same_rows(a: dict, b: dict) -> bool:
    """The two comparisons agree row for row: statuses and indices equal, numbers within float rounding."""
    def close(x, y) -> bool:
        if isinstance(x, float) and isinstance(y, float):
            return x == y or abs(x - y) <= 1e-9 * max(abs(x), abs(y))
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
        return x == y
    return close(a["comparisons"], b["comparisons"])
