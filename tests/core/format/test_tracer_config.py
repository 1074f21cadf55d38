"""format/tracer_config.py: TracerConfig refuses, at construction, a configuration the Tracer could not honour,
with one message per field that names the value given and what to give instead; `slots` selects among every
kind of SLOT_FAMILIES (the tiny MLP recorded with and without step scalars)."""

import pytest

from tests.support.tiny_mlp import record_step
from ttrace_core.format.naming import slot_family
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import SLOT_FAMILIES
from ttrace_core.format.tracer_config import TracerConfig


@pytest.mark.parametrize("fields, message", [
    ({"slots": ("output", "outputs", "grads")},
     f"TracerConfig.slots has unknown kinds ['grads', 'outputs']; choose from {SLOT_FAMILIES}"),
    ({"data_parallel_rank": 2, "data_parallel_size": 2}, "data_parallel_rank 2 is outside data_parallel_size 2"),
    ({"data_parallel_rank": -1}, "data_parallel_rank -1 is outside data_parallel_size 1"),
    ({"data_parallel_size": 0}, "data_parallel_rank 0 is outside data_parallel_size 0"),
    ({"writer_queue_bytes": -1},
     "TracerConfig.writer_queue_bytes is -1; give 0 (no writer thread) or a byte count"),
    ({"model_chunks": -2}, "TracerConfig.model_chunks is -2; give 0 (one model) or the chunk count"),
    ({"loss_scale": 0}, "loss_scale 0 would zero every gradient; pass the factor the loss is multiplied by"),
    ({"loss_scale": 0.0}, "loss_scale 0 would zero every gradient; pass the factor the loss is multiplied by"),
], ids=["unknown slots, sorted", "dp rank past the size", "negative dp rank", "dp size 0", "negative queue",
        "negative chunks", "loss scale 0", "loss scale 0.0"])
def test_an_invalid_field_is_refused_with_its_message(fields, message):
    with pytest.raises(ValueError) as raised:
        TracerConfig(**fields)
    assert str(raised.value) == message


def test_the_first_invalid_field_in_declaration_order_is_the_one_named():
    with pytest.raises(ValueError, match=r"^TracerConfig\.slots has unknown kinds \['x'\]"):
        TracerConfig(slots=("x",), data_parallel_rank=5, writer_queue_bytes=-1, model_chunks=-1, loss_scale=0)
    with pytest.raises(ValueError, match="^data_parallel_rank 5"):
        TracerConfig(data_parallel_rank=5, writer_queue_bytes=-1, model_chunks=-1, loss_scale=0)


@pytest.mark.parametrize("fields", [
    {},
    {"slots": SLOT_FAMILIES},
    {"slots": ()},
    {"slots": ("grad", "value")},
    {"data_parallel_rank": 3, "data_parallel_size": 4},
    {"writer_queue_bytes": 0},
    {"writer_queue_bytes": 1 << 20},
    {"model_chunks": 0},
    {"model_chunks": 2},
    {"loss_scale": 0.125},
], ids=["defaults", "every kind", "no kind", "some kinds", "last dp rank", "no writer thread", "a writer queue",
        "one model", "two chunks", "a loss scale"])
def test_a_valid_configuration_is_kept_as_given(fields):
    config = TracerConfig(**fields)
    assert all(getattr(config, name) == value for name, value in fields.items())


def test_the_defaults_record_everything_once_per_step_on_the_training_thread():
    config = TracerConfig()
    assert (config.include, config.exclude, config.exclude_activations, config.forward_only) == (("*",), (), (), ())
    assert config.slots == SLOT_FAMILIES and config.steps is None and not config.stats_only
    assert (config.writer_queue_bytes, config.loss_scale, config.grad_attr) == (0, 1.0, "grad")
    assert (config.data_parallel_rank, config.data_parallel_size, config.rename, config.model_chunks) == (0, 1, (), 0)


def test_fields_are_given_by_name_only():
    with pytest.raises(TypeError):
        TracerConfig(("*",))  # type: ignore[misc]


def test_slots_select_every_kind_the_tracer_records_step_scalars_included(tmp_path):
    """`slots` names the kinds of SLOT_FAMILIES, "scalar" among them: left out, the loss and the learning rate
    are not recorded either."""
    every = record_step(tmp_path / "every", role="reference")
    some = record_step(tmp_path / "some", role="reference", config=TracerConfig(slots=("output", "grad")))
    with RunReader(every) as all_kinds, RunReader(some) as two_kinds:
        assert {k.slot for k in all_kinds.keys() if slot_family(k.slot) == "scalar"} == {"scalar.loss", "scalar.lr"}
        assert {slot_family(k.slot) for k in two_kinds.keys()} == {"output", "grad"}
