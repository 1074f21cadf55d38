"""canonicalize/logical_value.py: one logical tensor of a recorded run, read through a RunReader.

On tests/synthetic_runs.py's pair (a 1-rank reference, a 2-rank candidate whose tensors are row shards or
replicas, with known differences), the candidate's shards assemble into the reference's tensor where they
agree and show exactly where they do not; on the tiny MLP recorded with a loss scale, the logical value
undoes it."""

import pytest
import torch

from tests.support.tiny_mlp import record_step
from tests.synthetic_runs import write_pair
from ttrace_core.canonicalize.logical_value import canonical_tensor, logical_value
from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.errors import LayoutError
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TensorKey
from ttrace_core.format.tracer_config import TracerConfig

def _key(fqn: str, micro_batch: int = 0) -> TensorKey:
    return TensorKey(step=0, micro_batch=micro_batch, phase="forward", fqn=fqn, slot="output.0")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def whole(pair) -> dict[TensorKey, torch.Tensor]:
    """The pair's logical tensors, as the 1-rank reference recorded each: whole, on one rank."""
    with RunReader(pair[0]) as reference:
        return {key: reference.read(metas[0]) for key, metas in reference.index.items()}


@pytest.mark.parametrize("micro_batch", [0, 1])
def test_row_shards_assemble_into_the_reference_tensor(pair, whole, micro_batch):
    reference, candidate = pair
    key = _key("layers.0.lin", micro_batch)
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        assembled = canonical_tensor(cand, cand.index[key], key)
        assert assembled.num_shards == 2 and assembled.replica_drift is None
        assert torch.equal(assembled.full, whole[key])
        assert torch.equal(canonical_tensor(ref, ref.index[key], key).full, whole[key])
        assert logical_value(cand, key).dtype == torch.float64
        assert torch.equal(logical_value(cand, key), logical_value(ref, key))
        assert torch.equal(logical_value(ref, key), whole[key].double())


def test_a_wrong_shard_shows_in_its_rows_only(pair, whole):
    _, candidate = pair
    key = _key("layers.0.act")
    with RunReader(candidate) as cand:
        difference = logical_value(cand, key) - whole[key].double()
    assert torch.equal(difference[:4], torch.zeros(4, 6, dtype=torch.float64))
    assert torch.allclose(difference[4:], torch.ones(4, 6, dtype=torch.float64))


def test_replicas_that_differ_give_the_first_ranks_values_and_name_the_drift(pair, whole):
    _, candidate = pair
    key = _key("layers.1.norm")
    with RunReader(candidate) as cand:
        assembled = canonical_tensor(cand, cand.index[key], key)
    assert assembled.num_shards == 2 and torch.equal(assembled.full, whole[key])
    drift = assembled.replica_drift
    assert isinstance(drift, ReplicaDrift) and drift.ranks == (0, 1)
    assert drift.relative_diff == pytest.approx(1e-3, rel=1e-4)


def test_only_the_shards_given_are_read(pair, whole):
    _, candidate = pair
    key = _key("layers.0.lin")
    with RunReader(candidate) as cand:
        metas = cand.index[key]
        with pytest.raises(LayoutError):
            canonical_tensor(cand, metas[:1], key)  # rank 0's rows alone do not cover the tensor
        replica = _key("layers.1.norm")
        one = canonical_tensor(cand, cand.index[replica][1:], replica)
    assert one.num_shards == 1 and one.replica_drift is None
    assert torch.equal(one.full, whole[replica] * (1 + 1e-3))


def test_the_recordings_loss_scale_is_undone(tmp_path):
    """The loss multiplied by 0.5 and recorded with loss_scale 0.5: its activation gradients are stored halved
    (scale 0.5 in their records) and their logical values equal the unscaled run's, exactly (a power of two)."""
    plain = record_step(tmp_path / "plain", role="reference")
    scaled = record_step(tmp_path / "scaled", role="candidate", loss_factor=0.5, config=TracerConfig(loss_scale=0.5))
    with RunReader(plain) as unscaled, RunReader(scaled) as halved:
        backward = [key for key in unscaled.index if key.phase == "backward"]
        assert backward and set(backward) <= set(halved.index)
        for key in backward:
            (meta,) = halved.index[key]
            assert meta.scale == 0.5
            assert torch.equal(halved.read(meta).double(), logical_value(unscaled, key) * 0.5)
            assert torch.equal(logical_value(halved, key), logical_value(unscaled, key))
        forward = next(key for key in unscaled.index if key.phase == "forward" and key.slot == "output.0")
        assert halved.index[forward][0].scale == 1.0
        assert torch.equal(logical_value(halved, forward), logical_value(unscaled, forward))
