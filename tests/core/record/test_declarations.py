"""Declared layouts (record/declarations.py) and how the Tracer resolves and keeps them: the latest matching
declaration decides, however it is indexed, and a kept layout never outlives the shape or the declaration
it was resolved for."""

import pytest
import torch
from torch import nn

from ttrace_core.format.reader import RunReader
from ttrace_core.record.declarations import Declarations
from ttrace_core.record.tracer import Tracer

MESH = ((2,), (1,), ("tp",))
"""Rank 1 of a 2-rank tensor-parallel mesh."""


@pytest.mark.parametrize(("declared", "fqn", "slot", "expected"), [
    ([("block", "*", "S(0)"), ("block", "output.0", "S(1)")], "block", "output.0", ("S(1)",)),
    ([("block", "output.0", "S(1)"), ("bl*", "*", "R")], "block", "output.0", ("R",)),
    ([("bl*", "*", "R"), ("block", "output.0", "S(1)")], "block", "input.0", ("R",)),
    ([("bl*", "*", "R"), ("block", "output.0", "S(1)")], "block", "output.0", ("S(1)",)),
    ([("block", "*", "S(0)")], "block.sub", "output.0", None),
    ([("block.?", "*", "S(0)"), ("block.2", "*", "R")], "block.1", "output.0", ("S(0)",)),
    ([("block", "input.*", "S(0)")], "other", "input.0", None),
], ids=["exact name, later specific slot", "later wildcard over earlier exact name",
        "earlier wildcard where the later exact one's slot differs", "later exact name over earlier wildcard",
        "an exact name is not a prefix", "single-character wildcard", "no declaration"])
def test_the_latest_matching_declaration_decides(declared, fqn, slot, expected):
    declarations = Declarations()
    for fqn_glob, slot_glob, placement in declared:
        declarations.declare(fqn_glob, slot_glob, [placement], MESH)
    layout = declarations.layout(fqn, slot, (4, 6))
    assert (layout.placements if layout is not None else None) == expected


def test_a_new_declaration_replaces_a_resolved_layout():
    declarations = Declarations()
    declarations.declare("block", "*", ["S(0)"], MESH)
    assert declarations.layout("block", "output.0", (4, 6)).global_shape == (8, 6)
    declarations.declare("block", "output.0", ["S(1)"], MESH)
    assert declarations.layout("block", "output.0", (4, 6)).global_shape == (4, 12)
    assert declarations.layout("block", "input.0", (4, 6)).global_shape == (8, 6)


def _rows_first_dim_sharded_if_three(local_shape: tuple[int, ...]) -> str:
    return "S(0)" if local_shape[0] == 3 else "R"


def _recorded_layouts(run_dir) -> dict[tuple, tuple]:
    """(step, micro-batch, phase, slot) -> (local shape, placements, global shape) of module "0"."""
    with RunReader(run_dir) as reader:
        return {(k.step, k.micro_batch, k.phase, k.slot): (m.local_shape, m.layout.placements, m.layout.global_shape)
                for k, metas in reader.index.items() if k.fqn == "0" for m in metas}


def test_a_resolved_layout_follows_the_shape_and_the_latest_declaration(tmp_path):
    """Layouts are resolved once per (module, slot, local shape) and kept: the same module called with
    another shape in the same step, and a declaration made between steps, must each give the layout
    in effect, and a gradient still inherits the layout of its own call's forward tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    tracer = Tracer(tmp_path, model, role="candidate")
    tracer.declare("0", "input.0", [_rows_first_dim_sharded_if_three], MESH)
    for step, declare_before in ((0, None), (1, "S(1)")):
        if declare_before is not None:
            tracer.declare("0", "input.0", [declare_before], MESH)
        with tracer.step(step):
            for num_rows in (3, 5):
                model(torch.randn(num_rows, 4, requires_grad=True)).sum().backward()
    tracer.close()
    recorded = _recorded_layouts(tmp_path)
    assert recorded == {
        (0, 0, "forward", "input.0"): ((3, 4), ("S(0)",), (6, 4)),
        (0, 1, "forward", "input.0"): ((5, 4), ("R",), (5, 4)),
        (0, 0, "forward", "output.0"): ((3, 4), (), (3, 4)),
        (0, 1, "forward", "output.0"): ((5, 4), (), (5, 4)),
        (0, 0, "backward", "grad_output.0"): ((3, 4), (), (3, 4)),
        (0, 1, "backward", "grad_output.0"): ((5, 4), (), (5, 4)),
        (0, 0, "backward", "grad_input.0"): ((3, 4), ("S(0)",), (6, 4)),
        (0, 1, "backward", "grad_input.0"): ((5, 4), ("R",), (5, 4)),
        (1, 0, "forward", "input.0"): ((3, 4), ("S(1)",), (3, 8)),
        (1, 1, "forward", "input.0"): ((5, 4), ("S(1)",), (5, 8)),
        (1, 0, "forward", "output.0"): ((3, 4), (), (3, 4)),
        (1, 1, "forward", "output.0"): ((5, 4), (), (5, 4)),
        (1, 0, "backward", "grad_output.0"): ((3, 4), (), (3, 4)),
        (1, 1, "backward", "grad_output.0"): ((5, 4), (), (5, 4)),
        (1, 0, "backward", "grad_input.0"): ((3, 4), ("S(1)",), (3, 8)),
        (1, 1, "backward", "grad_input.0"): ((5, 4), ("S(1)",), (5, 8)),
    }


def test_layouts_shared_across_modules_name_each_module_in_their_findings():
    """A layout is resolved once per shape and placements for every module (Declarations._fitted):
    two modules get the same layout, and a placement that fits neither is refused naming each its own."""
    from ttrace_core.record.declarations import UnknownLayoutError

    declarations = Declarations()
    for fqn in ("layers.0", "layers.1"):
        declarations.declare(fqn, "*", ["S(1)"], MESH)
    assert declarations.layout("layers.0", "output.0", (4, 6)) is declarations.layout("layers.1", "output.0", (4, 6))
    for fqn in ("layers.0", "layers.1"):
        with pytest.raises(UnknownLayoutError, match=rf"^{fqn} input.0: declared placements \['S\(1\)'\]"):
            declarations.layout(fqn, "input.0", (4,))
