"""For every DTensor the tracer records, canonicalize(recorded shards) equals DTensor.full_tensor()."""

import numpy as np
import pytest
import torch

from ttrace_core.canonicalize.shards import RecordedShard, canonicalize
from ttrace_core.record.launch import run_ranks
from ttrace_core.format.schema import TensorKey
from ttrace_core.format.reader import RunReader

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("layout, min_keys", [("tp-sp", 300), ("fsdp", 40)], ids=["tp2-sp", "fsdp2"])
def test_canonical_tensor_equals_full_tensor_for_every_recorded_dtensor(tmp_path, layout, min_keys):
    run_ranks("tests.distributed.workers:record_with_full_tensors", {"out": str(tmp_path), "layout": layout}, 2, timeout_s=300)
    checked = 0
    with RunReader(tmp_path) as reader:
        for rank in range(2):
            with np.load(tmp_path / f"full_tensors.rank{rank}.npz", allow_pickle=False) as expected_tensors:
                for name in expected_tensors.files:
                    phase, mb, fqn, slot = name.split("|")
                    key = TensorKey(step=0, micro_batch=int(mb), phase=phase, fqn=fqn, slot=slot)
                    assert key in reader.index, f"{key} was seen as a DTensor but not recorded"
                    shards = [RecordedShard(m.rank, m.layout, reader.read(m)) for m in reader.index[key]]
                    full = canonicalize(shards, key).full
                    expected = torch.from_numpy(expected_tensors[name])
                    assert full.shape == expected.shape, key
                    # Partial placements are summed in float64 here and by gloo in float32.
                    torch.testing.assert_close(full, expected, rtol=1e-6, atol=1e-7, msg=str(key))
                    checked += 1
    assert checked >= min_keys
