"""Compare partitioned over workers: the ranks of an initialized gloo process group each compare a
part (service/comparisons.py starts them: `ttrace compare --workers N`, or `--distributed` under torchrun).

Each worker compares every N-th tensor of the plan (execution order, round robin) without the
exact-inputs rule, then every worker receives every row (as JSON over gloo: no pickle) and runs
the ordered pass of `compare_runs`, which re-compares only the tensors that rule applies to. The
result is therefore the same table one worker computes, row for row.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ttrace_core.compare.engine import compare_key, compare_runs, read_ahead
from ttrace_core.compare.plan import plan_comparison
from ttrace_core.compare.results import RunComparison, TensorComparison
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.tolerances import ToleranceProvider


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
    rows = [compare_key(key, reference, candidate, plan, None, assembled).to_dict()
            for key, assembled in read_ahead(mine, reference, candidate, plan)]
    precomputed = {}
    for payload in all_gather_bytes(json.dumps(rows).encode()):
        for data in json.loads(payload):
            row = TensorComparison.from_dict(data)
            precomputed[row.key] = row
    return compare_runs(reference, candidate, tolerances, precomputed=precomputed, **options)
