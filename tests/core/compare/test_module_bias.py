"""compare/module_bias.py: the bias a module's forward output was offset by, as the run held it before the
step (its value.initial, else the previous step's post-step value), with the direction of its last update
taken out past the first step; None where there is no such bias to read. Small runs written with the real
writer and read back."""

from __future__ import annotations

import pytest
import torch

from ttrace_core.compare.module_bias import module_bias
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import NO_MICRO_BATCH, PRE_STEP_SLOT, Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, stats_from_tensor, write_manifest


def _output(fqn: str, step: int, slot: str = "output.0", phase: str = "forward") -> TensorKey:
    return TensorKey(step=step, micro_batch=0, phase=phase, fqn=fqn, slot=slot)


def _param(fqn: str, step: int, slot: str = "value") -> TensorKey:
    return TensorKey(step=step, micro_batch=NO_MICRO_BATCH, phase="param", fqn=fqn, slot=slot)


def _write(run_dir, steps: dict[int, dict[TensorKey, torch.Tensor | None]], world_size: int = 1,
           layouts: dict[TensorKey, list[Layout]] | None = None) -> RunReader:
    """Each step's tensors (None: recorded stats-only) on every rank; `layouts`: a key's layout per rank
    (its value then the rank's shard: rows cut evenly), else replicated."""
    write_manifest(run_dir, RunManifest(role="reference", world_size=world_size))
    for rank in range(world_size):
        writer = RunWriter(run_dir, rank)
        for step, tensors in steps.items():
            writer.begin_step(step)
            for seq, (key, value) in enumerate(tensors.items()):
                full = torch.zeros(3) if value is None else value
                layout = (layouts or {}).get(key, [Layout.replicated(tuple(full.shape))] * world_size)[rank]
                local = full.chunk(world_size)[rank] if layout.placements else full
                writer.write(TensorMeta(key=key, rank=rank, dtype="float32", local_shape=tuple(local.shape), layout=layout,
                                        seq=seq, stats=stats_from_tensor(local), stats_only=value is None),
                             None if value is None else local)
            writer.end_step()
    return RunReader(run_dir)


B0 = torch.tensor([1.0, 2.0, 2.0])
UPDATE = torch.tensor([0.0, 0.0, 3.0])
B1 = B0 + UPDATE
"""A bias and its first update: at step 1 the forward adds B1 = [1, 2, 5], whose part along the update is
(B1 . u / u . u) u = (15 / 9) [0, 0, 3] = [0, 0, 5], so [1, 2, 0] is left."""


@pytest.fixture
def reader(tmp_path):
    """Two steps of a linear "fc" (forward output, bias value.initial at step 0 and post-step values), its
    step-1 bias untouched by step 1, and "norm", whose bias is recorded stats-only."""
    steps = {
        0: {_output("fc", 0): torch.ones(3), _param("fc.bias", 0, PRE_STEP_SLOT): B0, _param("fc.bias", 0): B1,
            _output("norm", 0): torch.ones(3), _param("norm.bias", 0, PRE_STEP_SLOT): None},
        1: {_output("fc", 1): torch.ones(3), _param("fc.bias", 1): B1,
            _output("fc", 1, "input.0"): torch.ones(3), _output("fc", 1, "grad_output.0", "backward"): torch.ones(3)},
        2: {_output("fc", 2): torch.ones(3)},
    }
    with _write(tmp_path, steps) as reader:
        yield reader


def test_at_the_first_step_the_bias_is_its_initial_value_in_float64(reader):
    bias = module_bias(reader, _output("fc", 0))
    assert bias.dtype == torch.float64 and torch.equal(bias, B0.double())


def test_past_the_first_step_the_direction_of_the_last_update_is_taken_out(reader):
    """Step 1's forward added step 0's post-step bias B1; its update since value.initial is along [0, 0, 3]."""
    bias = module_bias(reader, _output("fc", 1))
    assert torch.allclose(bias, torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert abs(float(torch.dot(bias, UPDATE.double()))) < 1e-14  # nothing of it is left along the update


def test_a_bias_that_did_not_move_is_kept_whole(reader):
    """Step 2's forward added step 1's post-step bias, which equals step 0's: the update is zero."""
    assert torch.equal(module_bias(reader, _output("fc", 2)), B1.double())


@pytest.mark.parametrize("key", [_output("fc", 1, "input.0"), _output("fc", 1, "grad_output.0", "backward"),
                                 _param("fc.bias", 1), _output("norm", 0), _output("other", 0)],
                         ids=["an-input", "backward", "a-parameter", "stats-only-bias", "no-bias-recorded"])
def test_no_bias_where_the_key_is_no_forward_output_or_the_bias_has_no_values(reader, key):
    assert module_bias(reader, key) is None


def test_a_bias_of_another_shape_before_it_is_kept_whole(tmp_path):
    """(A run whose bias changed shape in step 0, from 3 elements to 2: no update to take out at step 1.)"""
    steps = {0: {_param("fc.bias", 0, PRE_STEP_SLOT): torch.tensor([1.0, 1.0, 1.0]),
                 _param("fc.bias", 0): torch.tensor([1.0, 2.0])},
             1: {_output("fc", 1): torch.ones(2)}}
    with _write(tmp_path, steps) as reader:
        assert torch.equal(module_bias(reader, _output("fc", 1)), torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_a_bias_holding_nan_or_inf_is_none(tmp_path):
    steps = {0: {_output("fc", 0): torch.ones(3), _param("fc.bias", 0, PRE_STEP_SLOT): torch.tensor([1.0, float("inf"), 0.0]),
                 _output("ln", 0): torch.ones(3), _param("ln.bias", 0, PRE_STEP_SLOT): torch.tensor([float("nan"), 0.0, 0.0])}}
    with _write(tmp_path, steps) as reader:
        assert module_bias(reader, _output("fc", 0)) is None and module_bias(reader, _output("ln", 0)) is None


def test_a_sharded_bias_is_read_as_the_whole_vector(tmp_path):
    """A column-parallel linear's bias is cut over the TP ranks: the statistic needs the logical bias."""
    bias = torch.tensor([1.0, 2.0, 3.0, 4.0])
    key = _param("fc.bias", 0, PRE_STEP_SLOT)
    layouts = {key: [Layout(global_shape=(4,), mesh_shape=(2,), coordinate=(rank,), placements=("S(0)",),
                            mesh_axis_names=("tp",)) for rank in range(2)]}
    steps = {0: {_output("fc", 0): torch.ones(4), key: bias}}
    with _write(tmp_path, steps, world_size=2, layouts=layouts) as reader:
        assert [meta.local_shape for meta in reader.index[key]] == [(2,), (2,)]
        assert torch.equal(module_bias(reader, _output("fc", 0)), bias.double())


def test_the_root_modules_bias_is_its_parameter_bias(tmp_path):
    """A model that is itself a Linear: its forward output is the root's ("") and its bias parameter is named
    "bias" (naming.owner_of("bias") is the root)."""
    steps = {0: {_output("", 0): torch.ones(3), _param("bias", 0, PRE_STEP_SLOT): B0}}
    with _write(tmp_path, steps) as reader:
        assert torch.equal(module_bias(reader, _output("", 0)), B0.double())
