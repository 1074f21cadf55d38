"""Compare partitioned over workers: `ttrace compare --workers N` on one machine, or every rank of
`torchrun ... -m ttrace_core compare` over several.

Each worker compares every N-th tensor of the plan (execution order, round robin) without the
exact-inputs rule, then every worker receives every row (as JSON over gloo: no pickle) and runs
the ordered pass of `compare_runs`, which re-compares only the tensors that rule applies to. The
result is therefore the same table one worker computes, row for row.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ttrace_core.compare import RunComparison, TensorComparison, compare_key, compare_runs, plan_comparison
from ttrace_core.store import RunReader
from ttrace_core.tolerances import ToleranceProvider


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every worker's `payload`, in rank order, on every worker."""
    world = dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(sizes).item())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else padded[:0]
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [bytes(tensor[:int(n.item())].numpy()) for tensor, n in zip(gathered, sizes)]


def compare_partitioned(reference: RunReader, candidate: RunReader, tolerances: ToleranceProvider, **options) -> RunComparison:
    """compare_runs over the workers of the initialized process group; every worker gets the whole result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _, plan = plan_comparison(reference, candidate, tolerances, ignore_dtype=options.get("ignore_dtype", False),
                              exact_inputs_k=options.get("exact_inputs_k"), partial=options.get("partial", False),
                              max_bytes=options.get("max_bytes"))
    mine = plan.to_compare[rank::world]
    rows = [compare_key(key, reference, candidate, plan).to_dict() for key in mine]
    precomputed = {}
    for payload in all_gather_bytes(json.dumps(rows).encode()):
        for data in json.loads(payload):
            row = TensorComparison.from_dict(data)
            precomputed[row.key] = row
    return compare_runs(reference, candidate, tolerances, precomputed=precomputed, **options)


def compare_worker(config: dict) -> None:
    """A spawned worker of `ttrace compare --workers N` (launch.run_ranks): compare, and on rank 0
    write the comparison table (the cache, and a copy where the parent reads it)."""
    from ttrace_core.api import CompareSettings, comparison_table
    from ttrace_core import table

    dist.init_process_group("gloo")
    try:
        settings = CompareSettings(**config["settings"])
        result = comparison_table(config["reference"], config["candidate"], settings, rebuild=config["rebuild"])
        if dist.get_rank() == 0:  # the cache's own format: infinite ratios survive, unlike in strict JSON
            table.write_table(Path(config["out"]), result.frame, result.provenance)
    finally:
        dist.destroy_process_group()


def run_workers(reference: str, candidate: str, settings, *, workers: int, rebuild: bool) -> RunComparison:
    """`ttrace compare --workers N`: N local gloo workers; the parent reads rank 0's result."""
    from dataclasses import asdict

    from ttrace_core.launch import run_ranks

    from ttrace_core import table

    with tempfile.TemporaryDirectory(prefix="ttrace-compare-") as folder:
        out = Path(folder) / "comparison.parquet"
        run_ranks("ttrace_core.partition:compare_worker",
                  {"reference": os.fspath(reference), "candidate": os.fspath(candidate), "settings": asdict(settings),
                   "rebuild": rebuild, "out": str(out)}, workers, timeout_s=24 * 3600)
        return table.comparison_from_table(*table.read_table(out))
