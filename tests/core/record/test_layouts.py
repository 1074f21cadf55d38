"""record/layouts.py: the layout recorded for a tensor that does not describe its own, in order: declared >
DTensor output (a parallel style's output before it was made local) > the plain shard it was produced from >
a gradient's forward tensor > the whole tensor, replicated.

A table over `plain_layout` with every source set up at once, each row taking one away; the frozen records
handed out again; then what the real Tracer records on the tiny MLP, and a real DTensor output on a one-rank
gloo group. The table's DTensor is a stand-in carrying the two attributes layout_of_converted_output reads
(its global shape, and its mesh as (shape, coordinate, axis names), which mesh_description accepts), so that
a 2-rank shard needs no second process."""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import Layout, TensorKey
from ttrace_core.format.tracer_config import TracerConfig
from ttrace_core.record.declarations import Declarations, UnknownLayoutError
from ttrace_core.record.layouts import has_partial, plain_layout, replicated, with_flat_range
from ttrace_core.record.producers import ProducerLayouts
from ttrace_core.record.step_state import StepState
from ttrace_core.record.tracer import Tracer

from tests.support.tiny_mlp import mlp

MESH = ((2,), (1,), ("tp",))
"""Rank 1 of a 2-rank tensor-parallel mesh."""
LOCAL = (3, 4)


def _key(phase: str, slot: str, fqn: str = "lin", micro_batch: int = 0, call: int = 0) -> TensorKey:
    return TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot, call=call)


def _sharded(dim: int) -> Layout:
    """Rank 1's (3, 4) block of a tensor cut in two along `dim`."""
    shape = list(LOCAL)
    shape[dim] *= 2
    return Layout(global_shape=tuple(shape), mesh_shape=(2,), coordinate=(1,), placements=(f"S({dim})",),
                  mesh_axis_names=("tp",))


DECLARED, PRODUCED, FORWARD = _sharded(0), _sharded(1), Layout(global_shape=(3, 12), mesh_shape=(3,), coordinate=(1,),
                                                               placements=("S(1)",), mesh_axis_names=("cp",))
CONVERTED = Layout(global_shape=(3, 8), mesh_shape=(2,), coordinate=(1,), placements=("S(1)",), mesh_axis_names=("tp",))


@dataclass
class _ConvertedOutput:
    """What a parallel style's DTensor output shows layout_of_converted_output: its global shape and mesh."""

    shape: torch.Size
    device_mesh: tuple


def _sources(phase: str, slot: str, present: set[str]):
    """(declarations, state, producers, value) with the sources named in `present` set up for `lin` `slot`."""
    declarations, state, producers = Declarations(), StepState(step=0), ProducerLayouts()
    value = torch.randn(LOCAL)
    if "declared" in present:
        declarations.declare("lin", slot, ["S(0)"], MESH)
    if "converted" in present:
        state.converted_outputs["lin"] = [_ConvertedOutput(torch.Size((3, 8)), MESH)]
    if "produced" in present:
        producers.remember(state, _key("forward", "output.0", fqn="producer"), value, PRODUCED)
    if "forward" in present:
        state.forward_layouts[("lin", 0, 0, slot.removeprefix("grad_"))] = FORWARD
    return declarations, state, producers, value


EVERY = {"declared", "converted", "produced", "forward"}


@pytest.mark.parametrize("phase, slot, present, expected", [
    ("forward", "output.0", EVERY, DECLARED),
    ("forward", "output.0", EVERY - {"declared"}, CONVERTED),
    ("forward", "output.0", EVERY - {"declared", "converted"}, PRODUCED),
    ("forward", "output.0", {"forward"}, replicated(LOCAL)),  # a forward tensor inherits from nothing
    ("forward", "input.0", EVERY - {"declared"}, PRODUCED),  # a converted layout is an output's only
    ("backward", "grad_output.0", EVERY, DECLARED),
    ("backward", "grad_output.0", EVERY - {"declared"}, FORWARD),  # neither converted nor produced: forward only
    ("backward", "grad_input.0", EVERY - {"declared"}, FORWARD),
    ("backward", "grad_output.0", set(), replicated(LOCAL)),
    ("grad", "grad", EVERY - {"declared"}, replicated(LOCAL)),  # a parameter's gradient is no module's "grad_" slot
], ids=["declared first", "then the DTensor output", "then the producer", "forward: no inheritance",
        "input: no converted layout", "gradient: declared first", "gradient: its forward tensor's",
        "grad_input: its input's", "gradient: nothing known", "parameter gradient"])
def test_the_first_source_that_knows_the_layout_decides(phase, slot, present, expected):
    declarations, state, producers, value = _sources(phase, slot, present)
    assert plain_layout(declarations, state, _key(phase, slot), value, producers) == expected


def test_without_step_state_only_a_declaration_is_read():
    declarations, state, producers, value = _sources("forward", "output.0", EVERY - {"declared"})
    assert plain_layout(declarations, None, _key("forward", "output.0"), value, producers) == replicated(LOCAL)
    assert plain_layout(declarations, state, _key("forward", "output.0"), value, None) == CONVERTED


def test_the_producer_is_matched_by_the_value_the_module_saw_not_the_recorded_copy():
    declarations, state, producers, value = _sources("forward", "input.0", {"produced"})
    copy = value.clone()  # not the producer's storage
    assert plain_layout(declarations, state, _key("forward", "input.0"), copy, producers) == replicated(LOCAL)
    assert plain_layout(declarations, state, _key("forward", "input.0"), copy, producers, value) == PRODUCED


@pytest.mark.parametrize("outputs, slot, expected", [
    ([None, _ConvertedOutput(torch.Size((3, 8)), MESH)], "output.1", CONVERTED),
    ([None, _ConvertedOutput(torch.Size((3, 8)), MESH)], "output.0", replicated(LOCAL)),
    ([_ConvertedOutput(torch.Size((3, 8)), MESH)], "output.1", replicated(LOCAL)),
    ([], "output.0", replicated(LOCAL)),
    ([_ConvertedOutput(torch.Size((3, 4)), MESH)], "output.0",
     Layout(global_shape=LOCAL, mesh_shape=(2,), coordinate=(1,), placements=("R",), mesh_axis_names=("tp",))),
    ([_ConvertedOutput(torch.Size((6, 8)), MESH)], "output.0", replicated(LOCAL)),
], ids=["its own output", "a plain output beside it", "past the outputs seen", "no DTensor output",
        "same shape: replicated on the mesh", "two dims differ: unknown"])
def test_a_converted_output_is_looked_up_by_its_output_index(outputs, slot, expected):
    state = StepState(step=0)
    state.converted_outputs["lin"] = outputs
    assert plain_layout(Declarations(), state, _key("forward", slot), torch.randn(LOCAL)) == expected


def test_a_gradient_inherits_only_a_forward_layout_of_its_own_rank_count_and_call():
    state = StepState(step=0)
    state.forward_layouts[("lin", 0, 1, "output.0")] = FORWARD
    grad = torch.randn(LOCAL)
    assert plain_layout(Declarations(), state, _key("backward", "grad_output.0", call=1), grad) == FORWARD
    assert plain_layout(Declarations(), state, _key("backward", "grad_output.0", call=0), grad) == replicated(LOCAL)
    assert plain_layout(Declarations(), state, _key("backward", "grad_output.0", micro_batch=1, call=1), grad) == \
        replicated(LOCAL)
    flat = torch.randn(12)  # a gradient of another rank count than its forward tensor cannot be laid out like it
    assert plain_layout(Declarations(), state, _key("backward", "grad_output.0", call=1), flat) == replicated((12,))


@pytest.mark.parametrize("forward, gradient", [
    (("P(sum)",), ("R",)), (("P(avg)",), ("P(sum)",)), (("S(0)", "P(sum)"), ("S(0)", "R")),
    (("R", "S(1)"), ("R", "S(1)")), (("SS(0,2)", "S(0)"), ("SS(0,2)", "S(0)")),
], ids=["partial sum: replicated", "partial mean: a sum of 1/n shares", "per axis", "no partial: as is",
        "strided: as is"])
def test_the_gradient_of_a_partial_tensor_is_its_dual(forward, gradient):
    """Each rank's share y_i of y = sum_i y_i gets the whole of dL/dy (torchtitan's tensor-parallel grouped experts:
    each expert's output is declared P(sum), and its grad_output taken as P(sum) read as twice the reference's)."""
    state = StepState(step=0)
    mesh_shape = (2,) * len(forward)
    layout = Layout(global_shape=LOCAL, mesh_shape=mesh_shape, coordinate=(1,) * len(forward), placements=forward,
                    mesh_axis_names=tuple(f"axis{i}" for i in range(len(forward))))
    state.forward_layouts[("lin", 0, 0, "output.0")] = layout
    recorded = plain_layout(Declarations(), state, _key("backward", "grad_output.0"), torch.randn(LOCAL))
    assert recorded.placements == gradient
    assert recorded == Layout(**{**_fields(layout), "placements": gradient})


def test_the_gradient_of_a_forward_tensor_left_out_is_left_out_too():
    state = StepState(step=0)
    state.forward_layouts[("lin", 0, 0, "output.0")] = FORWARD
    state.unmapped_forward.add(("lin", 0, 0, "output.0"))
    with pytest.raises(UnknownLayoutError) as raised:
        plain_layout(Declarations(), state, _key("backward", "grad_output.0"), torch.randn(LOCAL))
    assert str(raised.value) == ("lin grad_output.0: not recorded, it is the gradient of output.0, whose layout is "
                                 "unknown (see that tensor's finding)")
    declarations = Declarations()
    declarations.declare("lin", "grad_output.0", ["S(0)"], MESH)  # a declaration still wins
    assert plain_layout(declarations, state, _key("backward", "grad_output.0"), torch.randn(LOCAL)) == DECLARED


def test_layout_records_are_built_once_and_handed_out_again():
    assert replicated((3, 4)) is replicated((3, 4)) and replicated((3, 4)) == Layout(global_shape=(3, 4))
    ranged = with_flat_range(DECLARED, (2, 5))
    assert ranged is with_flat_range(_sharded(0), (2, 5)) and ranged.flat_range == (2, 5)
    assert DECLARED.flat_range is None and ranged == Layout(**{**_fields(DECLARED), "flat_range": (2, 5)})


def _fields(layout: Layout) -> dict:
    return {name: getattr(layout, name) for name in Layout.__slots__}


@pytest.mark.parametrize("placements, partial", [
    ((), False), (("R",), False), (("S(0)", "R"), False), (("P(sum)",), True), (("S(1)", "P(avg)"), True),
])
def test_has_partial(placements, partial):
    assert has_partial(placements) is partial


def _recorded_layouts(run_dir) -> dict[tuple[str, str, str], tuple]:
    with RunReader(run_dir) as reader:
        return {(k.phase, k.fqn, k.slot): (m.layout.global_shape, m.layout.placements)
                for k, ms in reader.index.items() for m in ms if k.micro_batch == 0 or k.phase == "grad"}


def test_what_the_tracer_records_on_the_tiny_mlp(tmp_path):
    """"0" Linear(4, 8) declared S(1) on rank 1 of 2: its output is a (3, 8) block of (3, 16). "1" GELU and
    "2" Linear(8, 2) are handed that shard; "2"'s output is its own, whole."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = TracerConfig(exclude=("",), slots=("input", "output", "grad_output", "grad_input", "grad"))
    tracer = Tracer(tmp_path, model, role="candidate", optimizer=optimizer, config=config)
    tracer.declare("0", "output.0", ["S(1)"], MESH)
    with tracer.step(0):
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).square().mean().backward()
        optimizer.step()
    tracer.close()
    shard, whole = ((3, 16), ("S(1)",)), ((3, 2), ())
    assert _recorded_layouts(tmp_path) == {
        ("forward", "0", "input.0"): ((3, 4), ()),
        ("forward", "0", "output.0"): shard,  # declared
        ("forward", "1", "input.0"): shard,  # the same storage as its producer's
        ("forward", "1", "output.0"): shard,  # a shape-preserving module passes its shard on
        ("forward", "2", "input.0"): shard,
        ("forward", "2", "output.0"): whole,  # not its input's shape: nothing known, replicated
        ("backward", "2", "grad_output.0"): whole,
        ("backward", "2", "grad_input.0"): shard,  # laid out like its input
        ("backward", "1", "grad_output.0"): shard,
        ("backward", "1", "grad_input.0"): shard,
        ("backward", "0", "grad_output.0"): shard,
        ("grad", "0.weight", "grad"): ((8, 4), ()), ("grad", "0.bias", "grad"): ((8,), ()),
        ("grad", "2.weight", "grad"): ((2, 8), ()), ("grad", "2.bias", "grad"): ((2,), ()),
    }


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_parallel_styles_local_output_is_recorded_with_its_dtensors_mesh(one_rank_group, tmp_path):
    """ColwiseParallel returns its output as a local tensor; the layout recorded is the DTensor's it came from
    (on one rank: replicated on a 1-rank "tp" mesh, not the mesh-less default), and its gradient inherits it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = nn.Sequential(nn.Linear(4, 8), nn.GELU())
    parallelize_module(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), {"0": ColwiseParallel()})
    tracer = Tracer(tmp_path / "run", model, role="candidate", config=TracerConfig(slots=("output", "grad_output")))
    with tracer.step(0):
        model(torch.randn(3, 4)).sum().backward()
    tracer.close()
    with RunReader(tmp_path / "run") as reader:
        layouts = {(k.fqn, k.slot): (m.layout.mesh_shape, m.layout.placements, m.layout.mesh_axis_names)
                   for k, ms in reader.index.items() for m in ms if k.fqn in ("0", "1")}
    on_mesh = ((1,), ("R",), ("tp",))
    assert layouts == {("0", "output.0"): on_mesh, ("0", "grad_output.0"): on_mesh,
                       ("1", "output.0"): ((), (), ()), ("1", "grad_output.0"): ((), (), ())}
