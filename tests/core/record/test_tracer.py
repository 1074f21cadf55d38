import contextlib

import pytest
import numpy as np
import torch
from torch import nn

from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.reader import RunReader
from ttrace_core.record.tracer import Tracer, TracerConfig

from tests.support.tiny_mlp import mlp as _model, train_step as _train_step


def _record(run_dir, config: TracerConfig | None = None, *, steps: int = 1, scale: float | None = None) -> nn.Module:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(run_dir, model, role="reference", optimizer=optimizer, config=config)
    for step in range(steps):
        with tracer.step(step):
            _train_step(model, optimizer, scale=scale)
    tracer.close()
    return model


def test_hooks_do_not_change_what_the_model_computes(tmp_path):
    traced = _record(tmp_path)
    plain = _model()
    _train_step(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    for (name, a), (_, b) in zip(traced.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name


def test_records_every_kind_in_execution_order(tmp_path):
    _record(tmp_path)
    with RunReader(tmp_path) as reader:
        keys = set(reader.keys())
        slots = {(k.phase, k.micro_batch, k.fqn, k.slot) for k in keys}
        assert ("forward", 1, "0", "input.0") in slots and ("forward", 0, "2", "output.0") in slots
        assert ("backward", 1, "2", "grad_output.0") in slots and ("backward", 0, "0", "grad_input.0") in slots
        assert ("grad", -1, "2.bias", "grad") in slots and ("param", -1, "0.weight", "value") in slots
        forward_first = min(m.seq for k in keys if k.phase == "forward" and k.micro_batch == 0 for m in reader.index[k])
        backward_first = min(m.seq for k in keys if k.phase == "backward" and k.micro_batch == 0 for m in reader.index[k])
        assert forward_first < backward_first


def test_recorded_gradient_is_the_accumulated_one(tmp_path):
    model = _record(tmp_path, TracerConfig(slots=("grad", "value")))
    with RunReader(tmp_path) as reader:
        (meta,) = [m for k, ms in reader.index.items() if k.fqn == "0.weight" and k.phase == "param" and k.slot == "value" for m in ms]
        assert torch.equal(reader.read(meta), model[0].weight.detach())


def test_data_parallel_rank_maps_local_to_global_micro_batches(tmp_path):
    _record(tmp_path, TracerConfig(data_parallel_rank=1, data_parallel_size=2))
    with RunReader(tmp_path) as reader:
        assert {k.micro_batch for k in reader.keys() if k.phase in ("forward", "backward")} == {1, 3}


def test_selection_by_glob_and_kind(tmp_path):
    _record(tmp_path, TracerConfig(include=("2",), slots=("output", "grad")))
    with RunReader(tmp_path) as reader:
        assert {(k.fqn, k.slot) for k in reader.keys()} == {("2", "output.0"), ("2.weight", "grad"), ("2.bias", "grad")}


def test_unselected_steps_are_not_recorded(tmp_path):
    _record(tmp_path, TracerConfig(steps=(1,)), steps=2)
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [1]


def test_loss_scale_is_undone_when_comparing(tmp_path):
    _record(tmp_path / "ref", TracerConfig(loss_scale=0.5))
    _record(tmp_path / "cand", TracerConfig(loss_scale=1.0), scale=1.0)
    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "cand") as cand:
        result = compare_runs(ref, cand)
    backward = [c for c in result.comparisons if c.key.phase == "backward"]
    assert backward and all(backward)
    # the parameters really were updated differently: grads are twice as large
    assert not all(c for c in result.comparisons if c.key.phase == "grad")


def test_stats_only_stores_no_values_and_still_compares_norms(tmp_path):
    _record(tmp_path / "ref")
    _record(tmp_path / "stats", TracerConfig(stats_only=True))
    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "stats") as cand:
        assert all(m.stats_only and m.stats.numel > 0 for ms in cand.index.values() for m in ms)
        result = compare_runs(ref, cand)
    assert result and all(c.stats_only for c in result.comparisons)
    assert sum(p.stat().st_size for p in (tmp_path / "stats").iterdir()) < sum(p.stat().st_size for p in (tmp_path / "ref").iterdir())


def test_stats_only_keeps_the_values_of_partial_sums(tmp_path):
    """Statistics of a partial sum cannot be combined into the whole tensor's, so it keeps its values."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(tmp_path, model, role="candidate", optimizer=optimizer, config=TracerConfig(stats_only=True))
    tracer.declare("2", "output.0", ["P(sum)"], ((1,), (0,), ("tp",)))
    with tracer.step(0):
        _train_step(model, optimizer)
    tracer.close()
    with RunReader(tmp_path) as reader:
        kept = {(k.fqn, k.slot) for k, ms in reader.index.items() for m in ms if not m.stats_only}
        assert kept == {("2", "output.0")}
        # its gradient is replicated (each share of a sum gets the whole gradient): statistics suffice
        grad = next(k for k in reader.index if (k.fqn, k.slot) == ("2", "grad_output.0"))
        assert reader.index[grad][0].layout.placements == ("R",)
        key = next(k for k in reader.index if (k.fqn, k.slot) == ("2", "output.0"))
        assert reader.read(reader.index[key][0]).shape == (3, 2)


def test_stats_only_tensors_share_one_dataset_of_records_per_step_file(tmp_path):
    """One dataset per stats-only tensor cost more than recording it; their records are rows of the step's
    tensor index, as every tensor's are."""
    import h5py

    from ttrace_core.errors import TraceFormatError
    from ttrace_core.format.shard_reads import read_shards
    from ttrace_core.format.tensor_index import TENSOR_INDEX

    _record(tmp_path / "ref")
    _record(tmp_path / "stats", TracerConfig(stats_only=True))
    step_file = tmp_path / "stats" / "rank_00000.step_000000.h5"
    with h5py.File(step_file) as handle:
        datasets = []
        handle.visititems(lambda name, node: datasets.append(name) if isinstance(node, h5py.Dataset) else None)
        assert datasets == [TENSOR_INDEX]
    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "stats") as cand:
        assert cand.keys() and set(cand.keys()) == set(ref.keys()) and not cand.inventory_gaps
        key = next(k for k in cand.keys() if k.phase == "forward")
        expected = ref.read(ref.index[key][0])
        (meta,) = cand.index[key]
        assert meta.stats.numel == expected.numel() and meta.stats.sum == pytest.approx(float(expected.sum()), rel=1e-6)
    (shard,) = read_shards(tmp_path / "stats", key, 1)  # what the dashboard's tensor page reads
    assert shard == (meta, None)
    with h5py.File(step_file, "r+") as handle:
        text = bytes(handle[TENSOR_INDEX][()]).replace(b'"stats_only":true', b'"stats_only":"yes"', 1)
        del handle[TENSOR_INDEX]
        handle[TENSOR_INDEX] = np.frombuffer(text, dtype=np.uint8)
    with pytest.raises(TraceFormatError, match=rf"{TENSOR_INDEX} line 1: tensor metadata is malformed .*stats_only"):
        RunReader(tmp_path / "stats")


def test_exception_in_a_step_leaves_it_partial_with_its_findings(tmp_path):
    model = _model()
    tracer = Tracer(tmp_path, model, role="candidate")
    tracer.declare("0", "input.0", ["S(2)"], ((2,), (0,), ("tp",)))  # the 2-D input has no dim 2: a finding per step
    tracer.add_finding("2", "output.0", "its layout cannot be inferred; declare it")  # outside a step: kept for step 0
    with tracer.step(0):
        model(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="boom"), tracer.step(1):
        model(torch.randn(2, 4))
        raise RuntimeError("boom")
    tracer.close()
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0]
        assert reader.partial_steps[1] == "ranks [0] did not finish step 1 (rank 0 stopped on RuntimeError: boom)"
        assert [(f.step, f.slot) for f in reader.findings] == [(0, "output.0"), (0, "input.0"), (1, "input.0")]
        assert reader.findings[0].message == "2 output.0: its layout cannot be inferred; declare it"


@pytest.mark.parametrize("limit", ["disk", "file-size"])
def test_a_full_disk_stops_the_recording_not_the_training(tmp_path, monkeypatch, capsys, limit):
    """Past ENOSPC, HDF5 fails inside deallocators and can crash the process (measured: a segfault), so
    the writer refuses the write that would not fit while the step file can still be closed; the tracer
    then leaves that step partial, records nothing more, says so in one line, and the training goes on."""
    import os
    import resource
    from types import SimpleNamespace

    from ttrace_core.format import writer as trace_writer

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(tmp_path, model, role="candidate", optimizer=optimizer)
    with tracer.step(0):
        _train_step(model, optimizer)
    if limit == "disk":
        monkeypatch.setattr(trace_writer.os, "statvfs", lambda path: SimpleNamespace(f_bavail=1, f_frsize=4096))
    else:
        monkeypatch.setattr(trace_writer.resource, "getrlimit", lambda which: (trace_writer.WRITE_HEADROOM, resource.RLIM_INFINITY))
    for step in (1, 2):
        with tracer.step(step):
            _train_step(model, optimizer)
    monkeypatch.undo()
    with tracer.step(3):  # room again: the recording stays stopped for the rest of the run
        _train_step(model, optimizer)
    tracer.close()
    plain = _model()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(4):
        _train_step(plain, plain_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))  # training went on
    (line,) = capsys.readouterr().err.splitlines()
    reason = "No space left on device" if limit == "disk" else "File too large: the file-size limit is"
    assert line.startswith(f"ttrace: {tmp_path}: cannot write step 1 of rank 0 ({reason}")
    assert "recording stopped for the rest of the run and training goes on" in line and "record again" in line
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0] and list(reader.partial_steps) == [1] and reader.index
        assert f"rank 0 stopped on OSError: [Errno {28 if limit == 'disk' else 27}]" in reader.partial_steps[1]
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "rank_00000.step_000000.h5", "rank_00000.step_000001.h5.partial"]


def test_config_validation():
    with pytest.raises(ValueError, match="unknown kinds"):
        TracerConfig(slots=("outputs",))
    with pytest.raises(ValueError, match="outside data_parallel_size"):
        TracerConfig(data_parallel_rank=2, data_parallel_size=2)


class _Renamed(nn.Module):
    """The same computation as _model(), with other module names (as on a pipeline stage)."""

    def __init__(self) -> None:
        super().__init__()
        reference = _model()
        self.blocks = nn.ModuleList([reference[0], reference[1], reference[2]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_rename_maps_local_names_to_the_reference_names(tmp_path):
    _record(tmp_path / "ref", TracerConfig(exclude=("",)))
    model = _Renamed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rename = (("blocks.0", "0"), ("blocks.1", "1"), ("blocks.2", "2"))
    tracer = Tracer(tmp_path / "cand", model, role="candidate", optimizer=optimizer,
                    config=TracerConfig(exclude=("", "blocks"), rename=rename))
    with tracer.step(0):
        _train_step(model, optimizer)
    tracer.close()
    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "cand") as cand:
        result = compare_runs(ref, cand)
    assert result and {c.key.fqn for c in result.comparisons} >= {"0", "2", "0.weight", "2.bias"}


def test_rename_matches_whole_name_components(tmp_path):
    tracer = Tracer(tmp_path, _model(), role="candidate", config=TracerConfig(rename=(("layers.1", "layers.3"),)))
    assert tracer.global_fqn("layers.1.attn") == "layers.3.attn"
    assert tracer.global_fqn("layers.10.attn") == "layers.10.attn"
    assert tracer.global_fqn("layers.1._checkpoint_wrapped_module.attn") == "layers.3.attn"  # wrappers dropped
    tracer.close()


def test_other_ranks_step_files_do_not_make_rank_0_refuse(tmp_path):
    """Rank 1 may open its first step file before rank 0 constructs its tracer: that is not an old trace."""
    (tmp_path / "rank_00001.step_000000.h5.partial").write_bytes(b"")
    Tracer(tmp_path, _model(), role="candidate").close()
    assert (tmp_path / "manifest.json").exists()


def test_calls_within_a_micro_batch_and_checkpoint_recomputation(tmp_path):
    """A head called twice per micro-batch is recorded per call; a checkpointed block's forward,
    recomputed during backward, is recorded once, under the model's own names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(4, 4), checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))), nn.Linear(4, 2)
    model = nn.ModuleDict({"body": body, "head": head})
    model.forward = lambda x: body(x)  # the root's call is the micro-batch clock
    tracer = Tracer(tmp_path, model, role="reference")
    with tracer.step(0):
        for _ in range(2):
            hidden = model(torch.randn(3, 4))
            sum(head(chunk).square().sum() for chunk in hidden.chunk(2)).backward()
    tracer.close()
    with RunReader(tmp_path) as reader:
        keys = set(reader.index)
    outputs = {(k.fqn, k.micro_batch, k.call) for k in keys if k.phase == "forward" and k.slot == "output.0"}
    assert {(f, mb, c) for f, mb, c in outputs if f == "head"} == {("head", mb, c) for mb in (0, 1) for c in (0, 1)}
    assert {(f, mb, c) for f, mb, c in outputs if f.startswith("body.1")} == \
        {(f, mb, 0) for f in ("body.1", "body.1.0", "body.1.1") for mb in (0, 1)}
    grads = {(k.fqn, k.micro_batch, k.call) for k in keys if k.phase == "backward" and k.slot == "grad_output.0"}
    assert {g for g in grads if g[0] == "head"} == {("head", mb, c) for mb in (0, 1) for c in (0, 1)}
    assert not any("_checkpoint_wrapped_module" in k.fqn for k in keys)


class _DictOut(nn.Module):
    """Returns a dict: torch cannot fire a full backward hook for it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> dict:
        return {"hidden": self.lin(x)}


class _HandsBackAFunction(nn.Module):
    """Like megatron's bias-dropout-add: the computation runs after the module returns."""

    def forward(self, scale: float):
        return lambda x: x * scale


class _BlindSpotModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.bda, self.head, self.skipped = _DictOut(), _HandsBackAFunction(), nn.Linear(8, 2), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.skipped(self.encoder(x)["hidden"])
        return self.head(self.bda(2.0)(hidden))


def test_modules_the_trace_cannot_see_into_are_blind_spots_and_their_output_gradients_still_recorded(tmp_path):
    torch.manual_seed(0)
    model = _BlindSpotModel()
    config = TracerConfig(exclude=("skipped",), forward_only=("head",))
    tracer = Tracer(tmp_path, model, role="reference", config=config)
    with tracer.step(0):
        inputs = torch.randn(3, 4)
        model(inputs).square().sum().backward()
    tracer.close()
    with RunReader(tmp_path) as reader:
        spots = reader.manifest.blind_spots
        assert set(spots) == {"skipped", "head", "encoder", "bda"}
        assert "exclude" in spots["skipped"] and "forward_only" in spots["head"]
        assert "returns dict" in spots["encoder"] and "returns a function" in spots["bda"]
        slots = {(k.phase, k.fqn, k.slot) for k in reader.index}
        # head and encoder have no backward hook, yet their output gradients are recorded (tensor hooks)
        assert ("backward", "head", "grad_output.0") in slots and ("backward", "encoder", "grad_output.0") in slots
        assert ("backward", "head", "grad_input.0") not in slots and ("backward", "encoder", "grad_input.0") not in slots
        (head_grad,) = reader.index[next(k for k in reader.index if (k.fqn, k.slot) == ("head", "grad_output.0"))]
        output = model.head(model.encoder(inputs)["hidden"] * 2.0)
        assert torch.allclose(reader.read(head_grad), 2 * output.detach())


class _Sink(torch.autograd.Function):
    """What DDP passes a model's outputs through (its _DDPSink): gradients are not materialized, so an output the
    loss does not use gets None, and a hook on that output is called with None."""

    @staticmethod
    def forward(ctx, first, second):
        ctx.set_materialize_grads(False)
        return first.clone(), second.clone()

    @staticmethod
    def backward(ctx, first, second):
        return first, second


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict:
        hidden = self.linear(x)
        return {"loss": hidden.square().mean(), "logits": hidden * 2.0}


def test_an_output_hook_handed_no_gradient_records_nothing_and_no_finding(tmp_path):
    """A dict-returning model's outputs are watched by tensor hooks; behind DDP's sink the output no loss uses gets
    None (the Hugging Face Trainer's logits in a bf16 run under DDP): nothing flowed, so nothing is recorded, and the
    tracer does not fail on it."""
    torch.manual_seed(0)
    model = _TwoOutputs()
    tracer = Tracer(tmp_path, model, role="reference")
    with tracer.step(0):
        outputs = model(torch.randn(3, 4))
        loss, _ = _Sink.apply(outputs["loss"], outputs["logits"])
        loss.backward()
    tracer.close()
    with RunReader(tmp_path) as reader:
        slots = {(k.fqn, k.slot) for k in reader.index if k.phase == "backward"}
        assert ("", "grad_output.0") in slots and ("", "grad_output.1") not in slots
        assert not [finding for finding in reader.findings if "tracer failed" in finding.message]


def test_an_evaluation_paused_in_the_middle_of_a_step_is_no_micro_batch_of_it(tmp_path):
    """A trainer may evaluate between two micro-batches of one step (Lightning's val_check_interval): while paused,
    its forwards are not recorded and do not count as micro-batches; the step's second micro-batch is micro-batch 1."""
    torch.manual_seed(0)
    model = _TwoOutputs()
    tracer = Tracer(tmp_path, model, role="reference")
    with tracer.step(0):
        model(torch.randn(3, 4))["loss"].backward()
        with tracer.paused(), torch.no_grad():
            model(torch.randn(5, 4))
        model(torch.randn(3, 4))["loss"].backward()
    tracer.close()
    with RunReader(tmp_path) as reader:
        forwards = [k for k in reader.index if k.phase == "forward" and k.fqn == "" and k.slot == "input.0"]
        assert sorted(k.micro_batch for k in forwards) == [0, 1]
        assert all(meta.local_shape == (3, 4) for k in forwards for meta in reader.index[k])


class _Scaled(nn.Module):
    def forward(self, hidden: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return hidden * scale


class _ScaledModel(nn.Module):
    """A linear layer, then a module whose second input is a 1-D vector (megatron's masked softmax has one)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)
        self.block = _Scaled()
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.block(self.linear(inputs), self.scale)


def _train_scaled(run_dir=None, *, role: str = "reference", declare: bool = False, steps: int = 2) -> list[float]:
    """The losses of a few steps, traced into `run_dir` (untraced without one)."""
    model = _ScaledModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(run_dir, model, role=role, optimizer=optimizer) if run_dir is not None else None
    if declare:
        tracer.declare("block", "input.1", ["S(1)"], ((2,), (0,), ("tp",)))
    losses = []
    for step in range(steps):
        with tracer.step(step) if tracer is not None else contextlib.nullcontext():
            optimizer.zero_grad()
            loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    if tracer is not None:
        tracer.close()
    return losses


def test_a_declared_placement_that_does_not_fit_is_a_finding_and_the_training_goes_on(tmp_path):
    """A 1-D input declared S(1): recording it cannot map its values, so it is left out with a finding
    (and so is its gradient, whose layout would be inherited from it); nothing else changes."""
    import json

    from tests.conftest import run_ttrace

    assert _train_scaled(tmp_path / "ref") == _train_scaled() == \
        _train_scaled(tmp_path / "cand", role="candidate", declare=True)
    with RunReader(tmp_path / "cand") as reader:
        left_out = sorted({(f.step, f.key.slot) for f in reader.findings})
        assert left_out == [(0, "grad_input.1"), (0, "input.1"), (1, "grad_input.1"), (1, "input.1")]
        finding = next(f for f in reader.findings if f.key.slot == "input.1")
        assert finding.message.startswith("block input.1: declared placements ['S(1)'] on mesh [2] do not fit its local "
                                          "shape [4] (a placement on dim 1 names a dim a 1-dim tensor does not have)")
        assert finding.message.endswith("declare the layout it has with session.declare(fqn, slot, placements, mesh)")
        recorded = {k.slot for k in reader.keys() if k.fqn == "block"}
        assert recorded == {"input.0", "output.0", "grad_output.0", "grad_input.0"}
    compare = run_ttrace("compare", str(tmp_path / "ref"), str(tmp_path / "cand"), "--json", str(tmp_path / "out.json"))
    assert compare.returncode == 1, compare.stderr
    assert f"finding: unrecorded: candidate: {finding.message} (2 times: ranks [0], steps [0, 1])" in compare.stdout
    assert "FAILED (incomplete)" in compare.stdout
    coverage = json.loads((tmp_path / "out.json").read_text())["coverage"]
    assert coverage["unrecorded"] == 4 and coverage["tensors_expected"] == coverage["compared_elementwise"] + 4
    inspect = run_ttrace("inspect", str(tmp_path / "cand"), check_codes=(0,))
    assert f"finding: {finding.message} (2 times" in inspect.stdout


@pytest.mark.parametrize(("target", "slot"), [("stats_from_tensor", "output.0"), ("hookable_output", "")],
                         ids=["inside record", "in a forward hook"])
def test_an_error_inside_the_tracer_is_a_finding_and_the_training_goes_on(tmp_path, monkeypatch, target, slot):
    import ttrace_core.record.module_hooks as hooks_module
    import ttrace_core.record.summaries as summaries_module

    module = hooks_module if target == "hookable_output" else summaries_module
    original = getattr(module, target)

    def failing(value, *args):
        if target == "hookable_output" or (value.dim() == 2 and value.shape[1] == 2):  # the last layer's output
            raise RuntimeError("boom")
        return original(value, *args)

    monkeypatch.setattr(module, target, failing)
    traced = _record(tmp_path)
    plain = _model()
    _train_step(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(traced.parameters(), plain.parameters()))
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0] and ("forward", "2", "input.0") in {(k.phase, k.fqn, k.slot) for k in reader.keys()}
        found = {(f.fqn, f.slot) for f in reader.findings if "the tracer failed (RuntimeError: boom at" in f.message}
    assert ("2", slot) in found


@pytest.mark.parametrize(("placement", "local_shape", "reason"), [
    ("S(1)", (4,), "a placement on dim 1 names a dim a 1-dim tensor does not have"),
    ("SB(0,2)", (5, 3), "they would give this rank a block of shape [4, 3]"),
], ids=["a dim the tensor lacks", "blocks that do not divide"])
def test_a_declared_placement_that_does_not_fit_names_the_placement_and_the_shape(placement, local_shape, reason):
    from ttrace_core.record.declarations import Declarations, UnknownLayoutError

    declarations = Declarations()
    declarations.declare("block", "input.*", [placement], ((2,), (1,), ("tp",)))
    with pytest.raises(UnknownLayoutError) as raised:
        declarations.layout("block", "input.1", local_shape)
    assert str(raised.value) == (
        f"block input.1: declared placements ['{placement}'] on mesh [2] do not fit its local shape {list(local_shape)} "
        f"({reason}), so it is not recorded; declare the layout it has with session.declare(fqn, slot, placements, mesh)")


@pytest.mark.parametrize("autocast, expected", [(False, "fp32"), (True, "bf16")], ids=["fp32", "autocast bf16"])
def test_the_manifest_says_the_precision_the_first_step_computed_in(tmp_path, autocast, expected):
    """fp32 parameters computing in bf16 (autocast, FSDP2's MixedPrecisionPolicy, torchtitan's default) carry
    bf16 round-off into their fp32 gradients: the manifest says bf16, so the dtype table judges them by it."""
    import json

    from ttrace_core.format.schema import RunManifest

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(tmp_path, model, role="reference", optimizer=optimizer, manifest=RunManifest(role="reference", world_size=1))
    for step in range(2):
        with tracer.step(step), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _train_step(model, optimizer)
    tracer.close()
    assert json.loads((tmp_path / "manifest.json").read_text())["precision"] == expected


class _Stack(nn.Module):
    """Layers in a ModuleList, then (on the last chunk) one head applied twice: two calls per micro-batch."""

    def __init__(self, num_layers: int, head: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(num_layers))
        self.head = nn.Linear(4, 4) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x if self.head is None else self.head(self.head(x))


def _interleaved_order(num_micro_batches: int) -> list[tuple[str, int, int]]:
    """(F or B, chunk, micro-batch) as megatron's interleaved 1F1B runs 2 chunks in groups of 2 micro-batches:
    chunk 0 runs micro-batch 1's forward before chunk 1 runs micro-batch 0's."""
    order = []
    for first in range(0, num_micro_batches, 2):
        a, b = first, first + 1
        order += [("F", 0, a), ("F", 0, b), ("F", 1, a), ("B", 1, a), ("F", 1, b), ("B", 0, a), ("B", 1, b), ("B", 0, b)]
    return order


def _micro_batch_input(index: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(index))


def test_model_chunks_keep_one_micro_batch_clock_each_under_the_interleaved_order(tmp_path):
    """Two chunks run in megatron's interleaved order carry the reference's micro-batch ids and call indices,
    under the reference's layer names: a clock shared by both roots would call chunk 1's first forward
    micro-batch 2, and counting each module's own calls would call the head's second call the next micro-batch."""
    num_micro_batches = 4
    torch.manual_seed(0)
    reference = _Stack(4, head=True)
    tracer = Tracer(tmp_path / "ref", reference, role="reference", config=TracerConfig(exclude=("",)))
    with tracer.step(0):
        for index in range(num_micro_batches):
            (reference(_micro_batch_input(index)).square().mean() / num_micro_batches).backward()
        tracer.record_gradients()
    tracer.close()

    chunks = nn.ModuleList([_Stack(2, head=False), _Stack(2, head=True)])
    with torch.no_grad():
        for local in range(4):
            chunks[local // 2].layers[local % 2].load_state_dict(reference.layers[local].state_dict())
        chunks[1].head.load_state_dict(reference.head.state_dict())
    rename = (("0.layers.0", "layers.0"), ("0.layers.1", "layers.1"), ("1.layers.0", "layers.2"), ("1.layers.1", "layers.3"),
              ("0", ""), ("1", ""))
    tracer = Tracer(tmp_path / "cand", chunks, role="candidate",
                    config=TracerConfig(exclude=("",), rename=rename, model_chunks=2))
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}
    with tracer.step(0):
        for kind, chunk, index in _interleaved_order(num_micro_batches):
            if kind == "F" and chunk == 0:
                outputs[0, index] = chunks[0](_micro_batch_input(index))
            elif kind == "F":
                inputs[index] = outputs[0, index].detach().requires_grad_(True)
                outputs[1, index] = chunks[1](inputs[index])
            elif chunk == 1:
                (outputs[1, index].square().mean() / num_micro_batches).backward()
            else:
                outputs[0, index].backward(inputs[index].grad)
        tracer.record_gradients()
    tracer.close()

    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "cand") as cand:
        result = compare_runs(ref, cand)
        reference_keys, candidate_keys = set(ref.keys()), set(cand.keys())
    assert result, [c for c in result.comparisons if not c][:3]
    assert candidate_keys == reference_keys and len(result.comparisons) == len(reference_keys)
    heads = {(k.micro_batch, k.call) for k in candidate_keys if k.fqn == "head" and k.slot == "output.0"}
    assert heads == {(index, call) for index in range(num_micro_batches) for call in (0, 1)}
    assert {k.micro_batch for k in candidate_keys if k.fqn == "layers.2" and k.phase == "backward"} == set(range(num_micro_batches))
    grads = {k.fqn for k in candidate_keys if k.phase == "grad"}
    assert grads == {f"layers.{i}.{p}" for i in range(4) for p in ("weight", "bias")} | {"head.weight", "head.bias"}


def test_an_optimizer_stepping_twice_in_one_step_keeps_the_first_and_says_so(tmp_path):
    """A loop that steps the optimizer once per micro-batch inside one `step` bracket (an accelerate loop whose
    process group was not set up, so its accumulation never holds a step back): the parameters after the first
    step are kept and a finding says what happened and what to do; the trace stays readable (it used to list every
    parameter twice in its index, and compare refused the whole file as damaged)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(tmp_path, model, role="reference", optimizer=optimizer)
    with tracer.step(0):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        after_first = model[0].weight.detach().clone()
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
    tracer.close()
    assert not torch.equal(after_first, model[0].weight.detach())
    with RunReader(tmp_path) as reader:
        (meta,) = reader.index[next(k for k in reader.index if k.phase == "param" and k.fqn == "0.weight" and k.slot == "value")]
        assert torch.equal(reader.read(meta), after_first)
        (line,) = {f.message for f in reader.findings if f.key is None or f.key.phase == "param"}
    assert line == ("optimizer step: the optimizer stepped again in step 0; the parameters after its first step are "
                    "kept. A ttrace step is one optimizer step: open `step(i)` around each (under gradient "
                    "accumulation, step the optimizer once per accumulated step)")


def test_a_tensor_recorded_twice_in_a_step_keeps_the_first_and_the_trace_reads(tmp_path):
    """Whatever records a key a second time in one step (an integration's hook firing twice), the step file lists it
    once: the first record stands and a finding (without a key: the tensor is in the trace) says so."""
    model = _model()
    tracer = Tracer(tmp_path, model, role="reference")
    with tracer.step(0):
        key = tracer.key("forward", "0", "output.0", 0)
        tracer.record(key, torch.ones(2))
        tracer.record(key, torch.zeros(2))
    tracer.close()
    with RunReader(tmp_path) as reader:
        (meta,) = reader.index[key]
        assert torch.equal(reader.read(meta), torch.ones(2))
        assert [(f.fqn, f.slot, f.key, f.message) for f in reader.findings] == [
            ("0", "output.0", None, "0 output.0: recorded again in step 0 (micro-batch 0, call 0); the first record is kept")]


class _Checkpointed(nn.Module):
    """A linear layer, a block run through torch.utils.checkpoint (or not), a head."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.head = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        hidden = self.inp(x)
        hidden = self.block(hidden) if self.reentrant is None else checkpoint(self.block, hidden, use_reentrant=self.reentrant)
        return self.head(hidden)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_checkpointed_block_records_its_backward_as_without_checkpointing(tmp_path, reentrant):
    """A reentrant checkpoint (torch.utils.checkpoint's use_reentrant=True, megatron's recompute) runs its first
    forward with autograd off and the backward after a second forward inside the backward: the modules inside it
    used to record no gradient at all (128 of 426 tensors missing in a DDP run of such a script)."""
    for name, how in (("reference", None), ("candidate", reentrant)):
        model = _Checkpointed(how)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tracer = Tracer(tmp_path / name, model, role=name, optimizer=optimizer)
        with tracer.step(0):
            for micro_batch in range(2):
                model(torch.randn(3, 4, generator=torch.Generator().manual_seed(micro_batch))).square().mean().backward()
            optimizer.step()
        tracer.close()
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "candidate") as candidate:
        assert set(candidate.index) == set(reference.index)
        assert {("block.0", 0), ("block.0", 1), ("block", 1)} <= {
            (k.fqn, k.micro_batch) for k in candidate.index if k.phase == "backward" and k.slot == "grad_input.0"}
        result = compare_runs(reference, candidate)
    assert result.comparisons and all(row.passed for row in result.comparisons)
