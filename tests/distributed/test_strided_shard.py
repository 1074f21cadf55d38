"""DTensor's _StridedShard (FSDP2 fully_shard over a tensor-parallel model) on real gloo ranks.

One spawn of 4 ranks on a (dp=2, tp=2) mesh checks, for DTensors distributed with _StridedShard
placements (even and uneven) and for every parameter and gradient of a ColwiseParallel /
RowwiseParallel MLP under fully_shard: canonicalize() over the 4 local shards equals full_tensor()
bit for bit (and the tensor given to distribute_tensor, or the single-device model), and shard()
of it gives back each rank's local tensor bit for bit.
"""

import pytest

from ttrace_core.record.launch import run_ranks

pytestmark = pytest.mark.distributed


def test_strided_shard_canonicalize_and_shard_equal_dtensor():
    run_ranks("tests.distributed.strided_shard_workers:check_strided_shard", {}, 4, timeout_s=240)
