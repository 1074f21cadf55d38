"""Part of stage 3 (compare): the error of each shard against that shard's values.

Round-off spreads over a tensor's shards; a bug often sits in one of them (one rank's shard never
refreshed, one rank's slice gathered from the wrong place). The `shard` statistic is the largest
relative error ||D_s|| / ||E_s|| over the shards s the candidate held, D = A - E. A bug confined to
one of p equal shards is sqrt(p) times larger there than over the whole tensor, and the finding
names the ranks that held it.

The estimate's single-rank re-runs have no shards, so each draw measures the statistic over every
equal partition the tensor has (2, 4 and 8 blocks along each dim), the largest block: how unevenly
round-off can fall on any shard a layout could cut. The compare side measures it over the
candidate's own shards (`candidate_shards`, from the recorded layouts: sharding is data).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ttrace_core.canonicalize.placements import local_blocks
from ttrace_core.errors import LayoutError
from ttrace_core.format.schema import TensorMeta

EQUAL_PARTS = (2, 4, 8)
Region = tuple[tuple[int, int], ...]
"""(start, length) per dim of one block of the logical tensor."""


def largest_block_error(diff: torch.Tensor, expected: torch.Tensor) -> float | None:
    """max over every equal partition (EQUAL_PARTS blocks along each dim) and its blocks of ||D_b|| / ||E_b||;
    None for a tensor no partition cuts (blocks of a zero reference are left out)."""
    largest = None
    for dim, size in enumerate(expected.shape):
        for parts in EQUAL_PARTS:
            if size < parts or size % parts:
                continue
            others = [d for d in range(expected.dim() + 1) if d != dim]
            errors = diff.unflatten(dim, (parts, -1)).square().sum(dim=others)
            values = expected.unflatten(dim, (parts, -1)).square().sum(dim=others)
            nonzero = values > 0
            if bool(nonzero.any()):
                block = float((errors[nonzero] / values[nonzero]).max().sqrt())
                largest = block if largest is None else max(largest, block)
    return largest


def candidate_shards(metas: Sequence[TensorMeta]) -> dict[tuple[Region, ...], tuple[int, ...]]:
    """The distinct shards of a logical tensor the candidate recorded -> the ranks holding each (replicas share
    one); {} when there is one shard, a partial placement, or a layout that is not a set of blocks.

    A distributed optimizer's flat ranges (`Layout.flat_range`) do not cut shards here: the ranks holding
    pieces of one block are named together, as the block's. Its pieces are ranges of any length, down to a
    few elements, where the estimate measured round-off only over equal partitions of 2 to 8 blocks: a
    piece's error judged against that tolerance would fail clean runs."""
    shards: dict[tuple[Region, ...], list[int]] = {}
    for meta in metas:
        if any(placement.startswith("P") for placement in meta.layout.placements):
            return {}
        try:
            regions = tuple(global_region for global_region, _ in local_blocks(meta.layout))
        except LayoutError:
            return {}
        if any(length == 0 for region in regions for _, length in region):
            continue  # an empty shard (torch.chunk's tail) holds nothing to judge
        shards.setdefault(regions, []).append(meta.rank)
    return {regions: tuple(sorted(ranks)) for regions, ranks in shards.items()} if len(shards) > 1 else {}


def shard_error(diff: torch.Tensor, expected: torch.Tensor, regions: tuple[Region, ...]) -> float | None:
    """||D_s|| / ||E_s|| over the blocks of one shard; None when its reference is zero."""
    error_sq = value_sq = 0.0
    for region in regions:
        index = tuple(slice(start, start + length) for start, length in region)
        error_sq += float(diff[index].square().sum())
        value_sq += float(expected[index].square().sum())
    return math.sqrt(error_sq / value_sq) if value_sq > 0 else None


def worst_shard(diff: torch.Tensor, expected: torch.Tensor, shards: dict[tuple[Region, ...], tuple[int, ...]]
                ) -> tuple[float, tuple[int, ...], float] | None:
    """(the largest shard error, the ranks of that shard, the largest error among the other shards)."""
    errors = sorted(((error, ranks) for regions, ranks in shards.items()
                     if (error := shard_error(diff, expected, regions)) is not None), reverse=True)
    if len(errors) < 2:
        return None
    return errors[0][0], errors[0][1], errors[1][0]
