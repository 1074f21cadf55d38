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


def test_an_fsdp1_model_is_named_and_its_run_says_it_cannot_be_compared(tmp_path):
    """FSDP1's parameters are flat shards ttrace does not map: attach says so in one finding (at record time, on
    stderr), and compare's refusal of the run quotes it instead of leaving only the shapes that differ."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ttrace_core.compare.evidence import check_comparable
    from ttrace_core.errors import ConfigMismatchError
    from ttrace_core.format.reader import RunReader
    from ttrace_core.integrations.torch_native import FSDP1_UNMAPPED, fsdp1_modules
    from ttrace_core.record.adapters import TorchAdapter, TracerSelection
    from ttrace_core.record.tracer import Tracer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        assert fsdp1_modules(plain) == []
        reference = Tracer(tmp_path / "ref", plain, role="reference", manifest=manifest_from_model(plain, "reference", 1))
        with reference.step(0):
            plain(torch.randn(2, 4))
        reference.close()
        model = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), use_orig_params=True,
                                         device_id=torch.device("cpu"))
        assert fsdp1_modules(model) == [""]
        adapter = TorchAdapter(model, "candidate", 1, TracerSelection(("*",), (), 1.0, None))
        manifest = adapter.manifest()
        manifest.model["parameters"]["0.weight"] = [0]  # what a rank holding no element of it records under FSDP1
        candidate = Tracer(tmp_path / "cand", adapter.traced, role="candidate", manifest=manifest)
        adapter.declare(candidate, None)
        with candidate.step(0):
            model(torch.randn(2, 4))
        candidate.close()
    finally:
        dist.destroy_process_group()
    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "cand") as cand:
        assert [(f.fqn, f.message) for f in cand.findings] == [("", f"<root>: {FSDP1_UNMAPPED}")]
        with pytest.raises(ConfigMismatchError) as refused:
            check_comparable(ref, cand)
    assert str(refused.value).endswith(f"; its tracer said: <root>: {FSDP1_UNMAPPED}")


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
