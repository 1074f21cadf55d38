"""canonicalize(recorded shards) equals DTensor's own full_tensor(), on real gloo ranks."""

import pytest

from ttrace_core.record.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size", [2, 4], ids=["1d-mesh-2-ranks", "2d-mesh-4-ranks"])
def test_canonicalize_equals_full_tensor(world_size):
    run_ranks("tests.distributed.workers:check_dtensor_canonicalize", {}, world_size, timeout_s=240)
