import pytest
import torch

from ttrace_core.errors import TtraceError
from ttrace_core.record.module_replay import call_arguments, recorded_calls
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, write_manifest


def test_arguments_keep_their_positions_and_names_and_floats_require_grad():
    ids, hidden = torch.tensor([1, 2]), torch.ones(2, 3)
    args, kwargs = call_arguments({"1": hidden, "0": ids, "attention_mask": torch.zeros(2, dtype=torch.bool)})
    assert args[0] is ids and torch.equal(args[1], hidden) and args[1].requires_grad and not hidden.requires_grad
    assert list(kwargs) == ["attention_mask"] and not kwargs["attention_mask"].requires_grad


def test_a_gap_in_positional_inputs_cannot_be_called():
    with pytest.raises(TtraceError, match="not contiguous"):
        call_arguments({"0": torch.ones(1), "2": torch.ones(1)})


def _record_inputs(run_dir) -> None:
    write_manifest(run_dir, RunManifest(role="candidate", world_size=2))
    for rank in (0, 1):
        writer = RunWriter(run_dir, rank)
        writer.begin_step(0)
        for seq, (micro_batch, slot) in enumerate([(1, "input.0"), (0, "input.0"), (0, "input.mask"), (1, "output.0")]):
            value = torch.full((2,), float(10 * rank + micro_batch))
            key = TensorKey(step=0, micro_batch=micro_batch, phase="forward", fqn="layer", slot=slot)
            writer.write(TensorMeta(key=key, rank=rank, dtype="float32", local_shape=(2,),
                                    layout=Layout.replicated((2,)), seq=seq), value)
        writer.end_step()


def test_recorded_calls_are_this_ranks_inputs_in_micro_batch_order(tmp_path):
    _record_inputs(tmp_path)
    calls = recorded_calls(tmp_path, 1, 0, "layer")
    assert [micro_batch for micro_batch, _ in calls] == [0, 1]
    assert sorted(calls[0][1]) == ["0", "mask"] and sorted(calls[1][1]) == ["0"]
    assert calls[0][1]["0"].tolist() == [10.0, 10.0] and calls[1][1]["0"].tolist() == [11.0, 11.0]  # rank 1's values
    assert recorded_calls(tmp_path, 0, 0, "other") == []
