"""Small hand-written trace pairs for tests of the table, the api and the dashboard.

`write_pair(root)` records a 1-rank reference and a 2-rank candidate (mesh axis "tp") of two
micro-batches, with one tensor of every kind of outcome, and returns (reference_dir, candidate_dir):

| tensor (forward, layers.N.*) | candidate | verdict |
| --- | --- | --- |
| layers.0.lin / output.0 | rows S(0), exact | pass |
| layers.0.act / output.0 | rows S(0), rank 1's rows + 1.0 | mismatch, rank 1's shard carries it |
| layers.1.norm / output.0 | replicated, rank 1 off by 1e-3 | replica_drift |
| layers.1.lin / output.0 | NaN on rank 0 | nonfinite |
| layers.1.out / output.0 | not recorded | missing |
| grad / layers.0.lin.weight | exact | pass |
"""

from __future__ import annotations

from pathlib import Path

import torch

from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, write_manifest

MODEL = {"num_layers": 2, "hidden": 8}


def _values() -> dict[TensorKey, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    values = {}
    for micro_batch in (0, 1):
        for seq, fqn in enumerate(("layers.0.lin", "layers.0.act", "layers.1.norm", "layers.1.lin", "layers.1.out")):
            key = TensorKey(step=0, micro_batch=micro_batch, phase="forward", fqn=fqn, slot="output.0")
            values[key] = torch.randn(8, 6, generator=generator)
    values[TensorKey(step=0, micro_batch=-1, phase="grad", fqn="layers.0.lin.weight", slot="grad")] = torch.randn(6, 6, generator=generator)
    return values


def _sharded_rows(key: TensorKey) -> bool:
    return key.fqn in ("layers.0.lin", "layers.0.act")


def _candidate_local(key: TensorKey, full: torch.Tensor, rank: int) -> torch.Tensor | None:
    if key.fqn == "layers.1.out":
        return None
    local = full[rank * 4:(rank + 1) * 4].clone() if _sharded_rows(key) else full.clone()
    if key.fqn == "layers.0.act" and rank == 1:
        local += 1.0
    if key.fqn == "layers.1.norm" and rank == 1:
        local *= 1 + 1e-3
    if key.fqn == "layers.1.lin" and rank == 0:
        local[0, 0] = float("nan")
    return local


def _layout(key: TensorKey, full: torch.Tensor, rank: int, world_size: int) -> Layout:
    if world_size == 1 or not _sharded_rows(key):
        return Layout.replicated(tuple(full.shape))
    return Layout(global_shape=tuple(full.shape), mesh_shape=(2,), coordinate=(rank,), placements=("S(0)",),
                  mesh_axis_names=("tp",))


def write_run(run_dir: Path, *, role: str, world_size: int) -> Path:
    write_manifest(run_dir, RunManifest(role=role, world_size=world_size, degrees={"tp": world_size}, model=MODEL,
                                        mesh_shape=[world_size], mesh_axis_names=["tp"],
                                        rank_coordinates=[[r] for r in range(world_size)]))
    for rank in range(world_size):
        writer = RunWriter(run_dir, rank)
        writer.begin_step(0)
        for seq, (key, full) in enumerate(_values().items()):
            local = full if role == "reference" else _candidate_local(key, full, rank)
            if local is None:
                continue
            meta = TensorMeta(key=key, rank=rank, dtype="float32", local_shape=tuple(local.shape),
                              layout=_layout(key, full, rank, world_size), seq=seq)
            writer.write(meta, local)
        writer.end_step()
    return run_dir


def write_pair(root: Path) -> tuple[Path, Path]:
    return write_run(root / "reference", role="reference", world_size=1), \
        write_run(root / "candidate", role="candidate", world_size=2)
