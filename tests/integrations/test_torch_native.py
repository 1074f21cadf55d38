"""integrations/torch_native.py: what a plain PyTorch model says about its run, in one process (the
DTensor meshes of real gloo ranks are tests/distributed/)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ttrace_core.integrations.torch_native import (
    compiled_modules, computed_precision, data_parallel_of, manifest_from_model, micro_batches_of_group,
    without_fabric_wrapper,
)


@pytest.mark.parametrize("declared, outputs, expected", [
    ("fp32", {}, "fp32"),
    ("fp32", {"bfloat16": 10, "float32": 2}, "bf16"),
    ("fp32", {"float16": 3}, "fp16"),
    ("bf16", {"float32": 5}, "bf16"),
    ("fp32", {"float32": 4, "bfloat16": 1}, "fp32"),
    ("fp32", {"int64": 9}, "fp32"),
    ("fp64", {"float32": 1}, "fp32"),
], ids=["no-outputs", "autocast-bf16", "fp16", "finer-outputs-keep-declared", "mostly-fp32", "integer-outputs",
        "fp64-params-fp32-compute"])
def test_computed_precision_is_the_coarser_of_declared_and_observed(declared, outputs, expected):
    assert computed_precision(declared, outputs) == expected


def test_a_plain_model_is_data_parallel_rank_0_of_1_unless_told():
    model = nn.Linear(2, 2)
    assert data_parallel_of(model, None) == (0, 1)
    assert data_parallel_of(model, (3, 4)) == (3, 4)


def test_the_manifest_of_a_plain_model_names_its_parameters_and_precision():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    manifest = manifest_from_model(model, "reference", 1)
    assert manifest.precision == "bf16" and manifest.world_size == 1 and manifest.degrees == {}
    assert manifest.model["parameters"] == {"0.bias": [3], "0.weight": [3, 4], "1.bias": [2], "1.weight": [2, 3]}


def test_a_compiled_model_names_the_modules_it_hides_without_the_wrapper():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    assert compiled_modules(model) == []
    assert compiled_modules(torch.compile(model)) == ["0", "1", "1.0"]


def test_without_a_group_a_rank_dispatches_only_its_own_micro_batch():
    assert micro_batches_of_group(5, None) == (5,)


def test_what_lightning_fabric_set_up_is_traced_as_the_model_inside_it():
    import lightning

    model = nn.Sequential(nn.Linear(2, 2))
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_module(model)
    assert type(wrapped).__name__ == "_FabricModule"
    assert {name for name, _ in wrapped.named_modules()} != {name for name, _ in model.named_modules()}
    assert without_fabric_wrapper(wrapped) is model  # on one device its forward module is the model itself
    assert without_fabric_wrapper(model) is model
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)  # no process group needed
    assert without_fabric_wrapper(ddp) is ddp


def test_compiled_submodules_hide_themselves_and_what_is_inside():
    """torch.compile of a block put in its place, or block.compile() in place (torchtitan, fullgraph=True): their own
    hooks would run inside the compiled code, so the block and its modules are hidden, the rest traced; a root
    compiled in place hides the root too (nothing compiles until a call)."""
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))

    swapped = model()
    swapped[1] = torch.compile(swapped[1], backend="eager", fullgraph=True)
    assert compiled_modules(swapped) == ["1", "1.0", "1.1"]
    in_place = model()
    in_place[1].compile(backend="eager", fullgraph=True)
    assert compiled_modules(in_place) == ["1", "1.0", "1.1"]
    root = model()
    root.compile(backend="eager")
    assert compiled_modules(root) == ["", "0", "1", "1.0", "1.1", "2"]
    assert compiled_modules(model()) == []
