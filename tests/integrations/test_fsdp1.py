"""integrations/fsdp1.py: FSDP1 (FullyShardedDataParallel) runs, their parameters mapped from flat ranges.

Real 2-rank FSDP1 runs (blocks and root wrapped; use_orig_params=True and torch's default False) against a 1-rank
reference, what one rank sees of each mode, and the agreement on constants that weight drawing needs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.cli_support import record_script, ttrace_command
from ttrace_core.format.schema import Layout
from ttrace_core.integrations import fsdp1
from ttrace_core.record.generator import agreed_constants

FSDP1_SCRIPT = '''
import sys
import torch, torch.distributed as dist, ttrace_core as ttrace
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab=26, dim=12, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        # (the root's 674 elements halved: rank 0 holds one element of head.weight, which looks constant alone)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


world = 1
if "--fsdp1" in sys.argv:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
torch.manual_seed(0)
model = Model()
if "--checkpoint" in sys.argv:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
    model.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
if "--fsdp1" in sys.argv:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    units = {CheckpointWrapper} if "--checkpoint" in sys.argv else {Block}
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(units), use_orig_params="--flat" not in sys.argv,
                 device_id=torch.device("cpu"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
rank = dist.get_rank() if dist.is_initialized() else 0
current = {"step": 0}
if "--module-bug" in sys.argv and rank == 1:  # from step 1 on, rank 1's blocks.1.fc2 scales its output
    fc2 = next(m for n, m in model.named_modules() if "blocks.1." in n and n.endswith(".fc2"))
    fc2.register_forward_hook(lambda module, inputs, output: output * 1.01 if current["step"] == 1 else output)
session = ttrace.attach(model, optimizer, loss_scale=world / 4)
for step in range(2):
    current["step"] = step
    with session.step(step):
        optimizer.zero_grad()
        for local in range(4 // world):
            tokens = torch.randint(0, 26, (2, 9), generator=torch.Generator().manual_seed(100 * step + local * world + rank))
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            (loss * world / 4).backward()
        if "--bug" in sys.argv and step == 1 and rank == 1:
            # rank 1's range of one weight's reduced gradient is wrong (as a reduce-scatter that scaled it twice)
            bias = dict(model.named_parameters())["_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.fc1.bias"]
            bias.grad.mul_(1.01)
        optimizer.step()
dist.destroy_process_group() if dist.is_initialized() else None
'''


def _pieces(run, step: int, fqn: str) -> dict[int, tuple[int, int]]:
    """rank -> the flat range of parameter `fqn`'s value after step `step` it recorded."""
    from ttrace_core.format.reader import RunReader

    with RunReader(run) as reader:
        return {meta.rank: meta.layout.flat_range for key, metas in reader.index.items()
                if (key.step, key.phase, key.fqn, key.slot) == (step, "param", fqn, "value") for meta in metas}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp1")
    script = root / "train.py"
    script.write_text(FSDP1_SCRIPT)
    record_script(script, root / "ref", 1)
    return root, script


@pytest.mark.distributed
def test_an_fsdp1_run_maps_its_flat_ranges_and_a_wrong_range_is_found_there(runs):
    """use_orig_params=True: every tensor of step 0 passes against the 1-rank reference (weights drawn in full and
    cut to each rank's range, gradients and updated values assembled from the ranges, every rank's copy
    recorded), and in step 1 only the parameter whose gradient range rank 1 got wrong fails (its gradient, and
    its update), at the elements of that range."""
    root, script = runs
    record_script(script, root / "cand", 2, "--fsdp1", "--bug")
    report = root / "compare.json"
    done = ttrace_command("compare", "ref", "cand", "--json", str(report), cwd=root)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(report.read_text())
    rows = result["comparisons"]
    failing = [row for row in rows if row["status"] != "pass"]
    name = "blocks.1.fc1.bias"  # a block's 936 elements halved: rank 0 holds [0, 12) of it, rank 1 the rest
    assert {(r["key"]["step"], r["key"]["phase"], r["key"]["fqn"], r["key"]["slot"]) for r in failing} <= \
        {(1, "grad", name, "grad"), (1, "param", name, "value")}
    wrong = next(r for r in failing if r["key"]["phase"] == "grad")
    assert wrong["num_mismatched"] == 24 and 12 <= wrong["max_abs_index"][0] < 36  # rank 1's range, whole and only
    compared = {(r["key"]["phase"], r["key"]["fqn"], r["key"]["slot"]) for r in rows if r["key"]["step"] == 0}
    assert {("grad", p, "grad") for p in PARAMETERS} | {("param", p, "value") for p in PARAMETERS} <= compared
    assert _pieces(root / "cand", 1, name) == {0: (0, 12), 1: (12, 36)}
    # (head.weight is drawn right only if the ranks agree that rank 0's one element of it is no constant)
    assert _pieces(root / "cand", 1, "head.weight") == {0: (0, 1), 1: (1, 312)}
    coverage = result["coverage"]
    assert coverage["copies_present"] == coverage["copies_expected"] and coverage["missing_in_candidate"] == 0


@pytest.mark.distributed
def test_an_fsdp1_run_with_flat_parameters_maps_them_and_localize_names_a_wrong_module(runs):
    """use_orig_params=False (torch's default): the model's parameters are FlatParameters, and the parameters they
    hold are drawn, recorded and compared in their place, with the same ranges: step 0 passes whole. Each block
    is checkpointed inside FSDP1 (the wrapper puts the FlatParameter's own name below itself; the parameters are
    named from the module FSDP1 wraps). In step 1 rank 1's blocks.1.fc2 scales its output, and localize's
    replay names that module."""
    root, script = runs
    record_script(script, root / "flat", 2, "--fsdp1", "--flat", "--checkpoint", "--module-bug")
    report = root / "flat.json"
    done = ttrace_command("compare", "ref", "flat", "--json", str(report), cwd=root)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(report.read_text())["comparisons"]
    first = [r for r in rows if r["key"]["step"] == 0]
    assert first and all(r["status"] == "pass" for r in first)
    compared = {(r["key"]["phase"], r["key"]["fqn"], r["key"]["slot"]) for r in first}
    assert {("grad", p, "grad") for p in PARAMETERS} | {("param", p, "value") for p in PARAMETERS} <= compared
    assert not any("flat_param" in r["key"]["fqn"] for r in rows)
    assert _pieces(root / "flat", 1, "blocks.1.fc1.bias") == {0: (0, 12), 1: (12, 36)}
    assert _pieces(root / "flat", 1, "head.weight") == {0: (0, 1), 1: (1, 312)}
    localized = ttrace_command("localize", "ref", "flat", "--json", str(root / "localize.json"), cwd=root)
    assert localized.returncode == 1, localized.stdout[-3000:] + localized.stderr[-3000:]
    assert json.loads((root / "localize.json").read_text())["culprits"] == ["blocks.1.fc2"]


PARAMETERS = {f"blocks.{i}.{p}" for i in range(2) for p in ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias",
                                                             "fc2.weight", "fc2.bias")} | \
    {"embed.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"}


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wrapped(use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    return FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), use_orig_params=use_orig_params,
                                    device_id=torch.device("cpu"))


def test_on_one_rank_flat_parameters_stand_for_views_of_the_parameters_they_hold(one_rank):
    """use_orig_params=False: the FlatParameter's local values hold every parameter whole on one rank, and
    named_parameters gives each in its place, a view: writing it writes the FlatParameter (as weight drawing
    does); its gradient is the same range of the FlatParameter's."""
    from ttrace_core.integrations.torch_native import manifest_from_model

    model = _wrapped(use_orig_params=False)
    assert [name for name, _ in model.named_parameters()] == ["_fsdp_wrapped_module._flat_param"]
    held = fsdp1.held_layouts(model)
    assert held == {"_fsdp_wrapped_module.0.weight": Layout(global_shape=(8, 4), flat_range=(0, 32)),
                    "_fsdp_wrapped_module.0.bias": Layout(global_shape=(8,), flat_range=(0, 8)),
                    "_fsdp_wrapped_module.1.weight": Layout(global_shape=(2, 8), flat_range=(0, 16)),
                    "_fsdp_wrapped_module.1.bias": Layout(global_shape=(2,), flat_range=(0, 2))}
    flat = next(model.parameters())
    flat.grad = torch.arange(flat.numel(), dtype=flat.dtype)
    named = {name: (value, grad) for name, value, grad in fsdp1.named_parameters(model)}
    assert list(named) == list(held)
    value, grad = named["_fsdp_wrapped_module.0.bias"]
    assert value.shape == (8,) and grad.tolist() == list(range(32, 40))
    with torch.no_grad():
        value.fill_(7.0)
    assert flat.detach()[32:40].tolist() == [7.0] * 8
    assert manifest_from_model(model, "candidate", 1, held=held).model["parameters"] == \
        {"0.weight": [8, 4], "0.bias": [8], "1.weight": [2, 8], "1.bias": [2]}


def test_on_one_rank_fsdp1_holds_every_parameter_whole(one_rank):
    """One rank is NO_SHARD to FSDP1 (it switches by itself): each parameter keeps its shape, no flat range is
    declared, and the data-parallel group is FSDP1's process group (the 2-rank test above has the ranges)."""
    from ttrace_core.integrations.torch_native import data_parallel_of, manifest_from_model

    model = _wrapped(use_orig_params=True)
    assert fsdp1.held_layouts(model) == {}
    assert [name for name, _ in fsdp1.fsdp1_modules(model)] == [""]
    assert manifest_from_model(model, "candidate", 1).model["parameters"] == \
        {"0.weight": [8, 4], "0.bias": [8], "1.weight": [2, 8], "1.bias": [2]}
    assert data_parallel_of(model, None) == (0, 1)


def test_constants_are_agreed_among_ranks(monkeypatch):
    """A rank whose range of a random weight is one element cannot tell it is not a constant, and a rank
    holding nothing of a parameter says nothing: the ranks agree (one all_gather_object)."""
    model = nn.Module()
    model.ones, model.single, model.nothing = (nn.Parameter(torch.ones(3)), nn.Parameter(torch.tensor([0.25])),
                                               nn.Parameter(torch.empty(0)))
    model.mixed = nn.Parameter(torch.tensor([0.5, 0.5]))
    held = {name: Layout(global_shape=(4,), flat_range=(0, 1)) for name in ("ones", "single", "nothing", "mixed")}
    other_rank = ({"ones": 1.0, "single": None, "nothing": None, "mixed": 0.75}, {"ones", "single", "mixed"})

    def all_gather_object(out, local):
        out[0], out[1] = local, other_rank

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert agreed_constants(model, held) == {"ones": 1.0, "single": None, "nothing": None, "mixed": None}
    other_rank[0]["nothing"] = 2.0
    other_rank[1].add("nothing")
    assert agreed_constants(model, held)["nothing"] == 2.0
