"""Comparisons in worker processes: `ttrace compare --workers N` spawns N local gloo workers, and
`ttrace compare --distributed` makes every rank of a torchrun launch one. Each worker compares its
part of the tensors (compare/partition.py); rank 0 writes the comparison table, which the parent reads.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from ttrace_core.compare import table
from ttrace_core.compare.results import RunComparison
from ttrace_core.compare.settings import CompareSettings
from ttrace_core.record.launch import run_ranks
from ttrace_core.service.comparisons import comparison_table


def compare_worker(config: dict) -> None:
    """A spawned worker of `ttrace compare --workers N` (launch.run_ranks): compare, and on rank 0
    write the comparison table (the cache, and a copy where the parent reads it)."""
    dist.init_process_group("gloo")
    try:
        settings = CompareSettings(**config["settings"])
        result = comparison_table(config["reference"], config["candidate"], settings, rebuild=config["rebuild"],
                                  partitioned=True)
        if dist.get_rank() == 0:  # the cache's own format: infinite ratios survive, unlike in strict JSON
            table.write_table(Path(config["out"]), result.frame, result.provenance)
    finally:
        dist.destroy_process_group()


def run_workers(reference: str, candidate: str, settings: CompareSettings, *, workers: int, rebuild: bool) -> RunComparison:
    """`ttrace compare --workers N`: N local gloo workers; the parent reads rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="ttrace-compare-") as folder:
        out = Path(folder) / "comparison.parquet"
        run_ranks("ttrace_core.service.compare_workers:compare_worker",
                  {"reference": os.fspath(reference), "candidate": os.fspath(candidate), "settings": asdict(settings),
                   "rebuild": rebuild, "out": str(out)}, workers, timeout_s=24 * 3600)
        return table.comparison_from_table(*table.read_table(out))


def compare_distributed(reference: str, candidate: str, settings: CompareSettings, *, rebuild: bool) -> RunComparison | None:
    """`ttrace compare --distributed`, run by every rank of a torchrun launch: each compares its part;
    rank 0 gets the result, the others None."""
    dist.init_process_group("gloo")
    try:
        result = comparison_table(reference, candidate, settings, rebuild=rebuild, partitioned=True)
        return table.comparison_from_table(result.frame, result.provenance) if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()
