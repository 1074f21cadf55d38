"""Activations that are DTensors sharded over a data-parallel mesh axis (torchtitan's full_dtensor mode) are
recorded as each rank's own micro-batch (record/tracer.py `_dtensor_layout`), so they compare with a
one-rank reference that runs every micro-batch."""

import pytest

from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.reader import RunReader
from ttrace_core.record.launch import run_ranks

pytestmark = pytest.mark.distributed


def test_activations_sharded_over_data_parallelism_are_each_ranks_micro_batch(tmp_path):
    for name, world_size in (("ref", 1), ("cand", 2)):
        run_ranks("tests.distributed.workers:record_dtensor_activations_over_dp", {"out": str(tmp_path / name)},
                  world_size, timeout_s=180)
    with RunReader(tmp_path / "ref") as reference, RunReader(tmp_path / "cand") as candidate:
        outputs = [m for k, ms in candidate.index.items() if k.phase == "forward" and k.slot == "output.0" for m in ms]
        result = compare_runs(reference, candidate)
    assert outputs and all(m.layout.mesh_shape == () and m.layout.global_shape[0] == 3 for m in outputs)
    activations = [c for c in result.comparisons if c.key.phase in ("forward", "backward")]
    assert len({c.key.micro_batch for c in activations}) == 4
    assert result.passed, result.first_divergence
