"""integrations/fsdp1.py: FSDP1 (FullyShardedDataParallel) runs, their parameters mapped from flat ranges.

A real 2-rank FSDP1 run (blocks and root wrapped, use_orig_params=True) against a 1-rank reference, a run whose
parameters cannot be mapped (use_orig_params=False), and the agreement on constants that weight drawing needs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.cli_support import record_script, ttrace_command
from ttrace_core.format.schema import Layout
from ttrace_core.integrations import fsdp1

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
if "--fsdp1" in sys.argv:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
rank = dist.get_rank() if dist.is_initialized() else 0
session = ttrace.attach(model, optimizer, loss_scale=world / 4)
for step in range(2):
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


@pytest.mark.distributed
def test_an_fsdp1_run_maps_its_flat_ranges_and_a_wrong_range_is_found_there(tmp_path):
    """Every tensor of step 0 passes against the 1-rank reference (weights drawn in full and cut to each rank's
    range, gradients and updated values assembled from the ranges, every rank's copy recorded), and in step 1
    only the weight whose gradient range rank 1 got wrong fails (its gradient, and its update), at an element
    of that range."""
    script = tmp_path / "train.py"
    script.write_text(FSDP1_SCRIPT)
    record_script(script, tmp_path / "ref", 1)
    record_script(script, tmp_path / "cand", 2, "--fsdp1", "--bug")
    report = tmp_path / "compare.json"
    done = ttrace_command("compare", "ref", "cand", "--json", str(report), cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(report.read_text())
    rows = result["comparisons"]
    failing = [row for row in rows if row["status"] != "pass"]
    name = "blocks.1.fc1.bias"  # a block's 936 elements halved: rank 0 holds [0, 12) of it, rank 1 the rest
    assert {(r["key"]["step"], r["key"]["phase"], r["key"]["fqn"], r["key"]["slot"]) for r in failing} <= \
        {(1, "grad", name, "grad"), (1, "param", name, "value")}
    wrong = next(r for r in failing if r["key"]["phase"] == "grad")
    compared = {(r["key"]["phase"], r["key"]["fqn"], r["key"]["slot"]) for r in rows if r["key"]["step"] == 0}
    parameters = {f"blocks.{i}.{p}" for i in range(2) for p in ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias",
                                                                "fc2.weight", "fc2.bias")} | {"embed.weight", "norm.weight",
                                                                                            "norm.bias", "head.weight",
                                                                                            "head.bias"}
    assert {("grad", p, "grad") for p in parameters} | {("param", p, "value") for p in parameters} <= compared
    from ttrace_core.format.reader import RunReader
    with RunReader(tmp_path / "cand") as cand:
        pieces = {meta.rank: meta.layout for key, metas in cand.index.items()
                  if key.step == 1 and key.phase == "param" and key.fqn == name and key.slot == "value" for meta in metas}
        head = {meta.rank: meta.layout.flat_range for meta in cand.index[next(
            key for key in cand.index if key.phase == "param" and key.fqn == "head.weight")]}
    assert head == {0: (0, 1), 1: (1, 312)}  # (drawn right only if the ranks agree it is no constant)
    assert pieces[0].global_shape == pieces[1].global_shape == (36,)
    assert pieces[0].flat_range == (0, 12) and pieces[1].flat_range == (12, 36)
    assert wrong["num_mismatched"] == 24 and 12 <= wrong["max_abs_index"][0] < 36  # rank 1's range, whole and only
    coverage = result["coverage"]
    assert coverage["copies_present"] == coverage["copies_expected"] and coverage["missing_in_candidate"] == 0


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


def test_without_use_orig_params_the_run_says_it_cannot_be_compared(tmp_path, one_rank):
    """Parameters that are FlatParameters are not the user's: attach says so in one finding (at record time, on
    stderr), and compare's refusal of the run quotes it instead of leaving only the names that differ."""
    from ttrace_core.compare.evidence import check_comparable
    from ttrace_core.errors import ConfigMismatchError
    from ttrace_core.format.reader import RunReader
    from ttrace_core.integrations.torch_native import manifest_from_model
    from ttrace_core.record.adapters import TorchAdapter, TracerSelection
    from ttrace_core.record.tracer import Tracer

    plain = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    assert fsdp1.fsdp1_modules(plain) == [] and fsdp1.unmapped(plain) is None
    reference = Tracer(tmp_path / "ref", plain, role="reference", manifest=manifest_from_model(plain, "reference", 1))
    with reference.step(0):
        plain(torch.randn(2, 4))
    reference.close()
    model = _wrapped(use_orig_params=False)
    assert fsdp1.unmapped(model) == "" and fsdp1.held_layouts(model) == {}
    adapter = TorchAdapter(model, "candidate", 1, TracerSelection(("*",), (), 1.0, None))
    candidate = Tracer(tmp_path / "cand", adapter.traced, role="candidate", manifest=adapter.manifest())
    adapter.declare(candidate, None)
    with candidate.step(0):
        model(torch.randn(2, 4))
    candidate.close()
    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "cand") as cand:
        assert [(f.fqn, f.message) for f in cand.findings] == [("", f"<root>: {fsdp1.FSDP1_UNMAPPED}")]
        with pytest.raises(ConfigMismatchError) as refused:
            check_comparable(ref, cand)
    assert str(refused.value).endswith(f"; its tracer said: <root>: {fsdp1.FSDP1_UNMAPPED}")


def test_on_one_rank_fsdp1_holds_every_parameter_whole(one_rank):
    """One rank is NO_SHARD to FSDP1 (it switches by itself): each parameter keeps its shape, no flat range is
    declared, and the data-parallel group is FSDP1's process group (the 2-rank test above has the ranges)."""
    from ttrace_core.integrations.torch_native import data_parallel_of, manifest_from_model

    model = _wrapped(use_orig_params=True)
    assert fsdp1.held_layouts(model) == {} and fsdp1.unmapped(model) is None
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
    other_rank = {"ones": 1.0, "single": "varies", "nothing": "empty", "mixed": 0.75}

    def all_gather_object(out, local):
        out[0], out[1] = local, other_rank

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert fsdp1.agreed_constants(model, held) == {"ones": 1.0, "single": None, "nothing": None, "mixed": None}
    other_rank["nothing"] = 2.0
    assert fsdp1.agreed_constants(model, held)["nothing"] == 2.0
