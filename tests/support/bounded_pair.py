"""A synthetic pair for comparing in bounded memory: tensors large enough to be cut into slabs, with
known faults planted, and a check that two comparisons agree row for row.

Generates (`write_pair`) a 1-rank reference and a 2-rank candidate of fp32 tensors of (rows, WIDTH,
DEPTH): even ones split over rows (S(0)), odd ones replicated; tensor 1's rank-1 replica drifts by 1e-3
and tensor 2 mismatches in one element. `same_rows` says whether two comparisons' rows agree
(statuses and indices equal, numbers within float rounding).

Used by tests/core/compare/test_bounded.py (slab by slab against whole, peak RSS under --max-memory)
and, as a child process (benchmarks/harness.py), by benchmarks/compare_memory.py (peak RSS per budget,
results/compare_memory.{md,json}):

    python -m tests.support.bounded_pair write ROOT --tensors 12 --rows 1024 --out pair.json
    python -m tests.support.bounded_pair same-rows WHOLE.json OTHER.json ... --out same.json
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the pair, or say which comparisons agree with the first.")
    commands = parser.add_subparsers(dest="command", required=True)
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--out", type=Path, required=True, help="where the JSON records go")
    write = commands.add_parser("write", parents=[out], help="write a pair under ROOT; out: its run directories")
    write.add_argument("root", type=Path)
    write.add_argument("--tensors", type=int, required=True)
    write.add_argument("--rows", type=int, required=True)
    same = commands.add_parser("same-rows", parents=[out], help="out: for each OTHER, whether it agrees with WHOLE row for row")
    same.add_argument("whole", type=Path)
    same.add_argument("others", type=Path, nargs="*")
    args = parser.parse_args()
    if args.command == "write":
        reference, candidate = write_pair(args.root, num_tensors=args.tensors, rows=args.rows)
        records = {"reference": str(reference), "candidate": str(candidate),
                   "numel_per_tensor": args.rows * WIDTH * DEPTH}
    else:
        whole = json.loads(args.whole.read_text())
        records = [same_rows(json.loads(other.read_text()), whole) for other in args.others]
    args.out.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
