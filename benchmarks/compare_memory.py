"""Compare in bounded memory: peak RSS of `ttrace compare` with and without `--max-memory`, on a
trace several times larger than the budget.

Writes a synthetic pair (a 1-rank reference, a 2-rank candidate whose tensors are split over rows
S(0) or replicated, one mismatching and one with replica drift), then runs `ttrace compare` in a
fresh process for each budget and reads its peak RSS (ru_maxrss). The fixed margin is the peak of
the same command on a pair of tiny tensors: the interpreter, torch, h5py and the run's index.
Also prints the bytes per element an unbounded comparison takes (bounded.BYTES_PER_ELEMENT).

Writes results/compare_memory.{md,json}.

    python benchmarks/compare_memory.py [--tensors 12] [--rows 256] [--work /var/tmp/ttrace-compare-memory]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from compare_throughput import measured_compare

RESULTS = Path(__file__).parent / "results"
WIDTH, DEPTH = 8, 512
"""Each tensor is (rows, WIDTH, DEPTH): rows split over the candidate's ranks, the other dims free to slab."""


def _layout(shape: tuple[int, ...], rank: int, split: bool):
    from ttrace_core.format.schema import Layout

    if not split:
        return Layout.replicated(shape)
    return Layout(global_shape=shape, mesh_shape=(2,), coordinate=(rank,), placements=("S(0)",), mesh_axis_names=("tp",))


def write_pair(root: Path, *, num_tensors: int, rows: int) -> tuple[Path, Path]:
    """A reference and a candidate of `num_tensors` fp32 tensors of (rows, WIDTH, DEPTH): even ones split
    over rows, odd ones replicated; tensor 1's rank-1 replica drifts by 1e-3, tensor 2 mismatches in one element."""
    from ttrace_core.format.schema import RunManifest, TensorKey, TensorMeta
    from ttrace_core.format.writer import RunWriter, write_manifest

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


def measure(work: Path, *, num_tensors: int, rows: int, budgets: list[str]) -> dict:
    from ttrace_core.cli.main import byte_size

    shutil.rmtree(work, ignore_errors=True)
    tiny = write_pair(work / "tiny", num_tensors=num_tensors, rows=2)
    big = write_pair(work / "big", num_tensors=num_tensors, rows=rows)
    trace_bytes = sum(p.stat().st_size for run in big for p in run.glob("*.h5"))
    margin, _, _ = measured_compare(*tiny, work / "tiny.json")
    rows_out = []
    for budget in [None, *budgets]:
        extra = () if budget is None else ("--max-memory", budget)
        out = work / f"compare-{budget or 'unbounded'}.json"
        peak, seconds, _ = measured_compare(*big, out, *extra)
        rows_out.append({"max_memory": budget, "max_memory_bytes": budget and byte_size(budget), "peak_rss": peak,
                         "seconds": seconds,
                         "over_margin": peak - margin, "table": json.loads(out.read_text())})
    numel = rows * WIDTH * DEPTH
    return {"trace_bytes": trace_bytes, "margin": margin, "numel_per_tensor": numel, "num_tensors": num_tensors,
            "bytes_per_element_unbounded": rows_out[0]["over_margin"] / numel, "rows": rows_out}


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


def render(measured: dict) -> str:
    mib = 2**20
    unbounded = measured["rows"][0]
    lines = [f"# Compare in bounded memory ({measured['num_tensors']} fp32 tensors of "
             f"{measured['numel_per_tensor'] * 4 / mib:.0f} MiB; a 1-rank reference and a 2-rank candidate)", "",
             f"Trace size of both runs: {measured['trace_bytes'] / mib:.0f} MiB. Fixed margin (the same command on "
             f"tiny tensors: interpreter, torch, h5py, the index): {measured['margin'] / mib:.0f} MiB. An unbounded "
             f"comparison takes {measured['bytes_per_element_unbounded']:.0f} bytes per element of its largest tensor.", "",
             "| --max-memory | peak RSS (MiB) | above the margin (MiB) | within budget + margin? | table equal to unbounded? | seconds |",
             "|---|---|---|---|---|---|"]
    for row in measured["rows"]:
        budget = row["max_memory_bytes"]
        within = "-" if budget is None else ("yes" if row["over_margin"] <= budget else "**no**")
        equal = "-" if row is unbounded else ("yes" if same_rows(row["table"], unbounded["table"]) else "**no**")
        lines.append(f"| {row['max_memory'] or 'none'} | {row['peak_rss'] / mib:.0f} | {row['over_margin'] / mib:.0f} "
                     f"| {within} | {equal} | {row['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=12)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--budgets", nargs="*", default=["32M", "64M", "128M"])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-compare-memory"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    measured = measure(args.work, num_tensors=args.tensors, rows=args.rows, budgets=args.budgets)
    text = render(measured)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "compare_memory.md").write_text(text)
    for row in measured["rows"]:
        row.pop("table")
    (args.results / "compare_memory.json").write_text(json.dumps(measured, indent=1))
    print(text)


if __name__ == "__main__":
    main()
