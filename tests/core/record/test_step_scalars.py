"""record/step_scalars.py and the Tracer's loss bookkeeping (step_state.LossPieces): a loss is recorded once
per micro-batch however many backwards it starts, and a step scalar computed twice is kept once."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.naming import GRADIENT_CLIPPING, LOSS_FUNCTION
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import NO_MICRO_BATCH
from ttrace_core.record.step_scalars import scalars_agree
from ttrace_core.record.step_state import LossPieces
from ttrace_core.record.tracer import Tracer, TracerConfig

NUM_MICRO_BATCHES = 2


class _Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _batch(index: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(index))


def _whole(model: _Trunk, hidden: torch.Tensor) -> None:
    """One backward from the micro-batch's loss."""
    (model.head(hidden).square().mean() / NUM_MICRO_BATCHES).backward()


def _per_chunk(model: _Trunk, hidden: torch.Tensor) -> None:
    """A chunked loss that backpropagates every chunk through the trunk (the pieces add up to the loss)."""
    for chunk in hidden.chunk(2):
        (model.head(chunk).square().sum() / hidden.shape[0] / 3 / NUM_MICRO_BATCHES).backward(retain_graph=True)


class _TrunkBackprop(torch.autograd.Function):
    """Its value is the chunks' total loss; its backward hands the chunks' gradient to the trunk's output."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return total.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


def _chunks_then_total(model: _Trunk, hidden: torch.Tensor) -> None:
    """torchtitan's ChunkedLossWrapper: each chunk backpropagates to a detached copy of the trunk's output,
    then one more backward from the chunks' sum carries their gradient through the trunk."""
    total, grads = hidden.new_zeros(()), []
    for chunk in hidden.detach().chunk(2):
        leaf = chunk.requires_grad_(True)
        piece = model.head(leaf).square().sum() / hidden.shape[0] / 3 / NUM_MICRO_BATCHES
        piece.backward()
        total, grads = total + piece.detach(), grads + [leaf.grad]
    _TrunkBackprop.apply(hidden, torch.cat(grads), total).backward()


def _record(run_dir, loss: Callable[[_Trunk, torch.Tensor], None], *, summed_over_step: bool = False,
            config: TracerConfig | None = None) -> Tracer:
    model = _Trunk()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(run_dir, model, role="reference", optimizer=optimizer, config=config)
    with tracer.step(0):
        if summed_over_step:
            sum(model.head(model(_batch(i))).square().mean() / NUM_MICRO_BATCHES for i in range(NUM_MICRO_BATCHES)).backward()
        else:
            for index in range(NUM_MICRO_BATCHES):
                loss(model, model(_batch(index)))
        optimizer.step()
    tracer.close()
    return tracer


def _losses(run_dir) -> dict[int, float]:
    with RunReader(run_dir) as reader:
        return {key.micro_batch: float(reader.read(metas[0])) for key, metas in reader.index.items()
                if key.fqn == LOSS_FUNCTION and key.slot == "scalar.loss"}


@pytest.mark.parametrize("loss", [_per_chunk, _chunks_then_total], ids=["a backward per chunk", "chunks, then their total"])
def test_a_loss_in_pieces_is_recorded_once_per_micro_batch_as_their_sum(tmp_path, loss):
    _record(tmp_path / "ref", _whole)
    _record(tmp_path / "pieces", loss)
    whole, pieces = _losses(tmp_path / "ref"), _losses(tmp_path / "pieces")
    assert sorted(pieces) == sorted(whole) == list(range(NUM_MICRO_BATCHES))
    for micro_batch, value in whole.items():
        assert pieces[micro_batch] == pytest.approx(value, rel=1e-6)
    with RunReader(tmp_path / "ref") as reference, RunReader(tmp_path / "pieces") as candidate:
        result = compare_runs(reference, candidate)
    losses = [c for c in result.comparisons if c.key.slot == "scalar.loss"]
    assert len(losses) == NUM_MICRO_BATCHES and all(losses)


def test_a_loss_is_the_micro_batch_its_backward_runs_even_when_forwards_run_ahead(tmp_path):
    """A pipeline's last stage: every forward first (GPipe), then the backwards, each its own micro-batch's."""
    model = _Trunk()
    tracer = Tracer(tmp_path, model, role="reference")
    with tracer.step(0):
        losses = [model.head(model(_batch(index))).square().mean() for index in range(NUM_MICRO_BATCHES)]
        expected = [loss.item() for loss in losses]
        for loss in losses:
            loss.backward()
    tracer.close()
    recorded = _losses(tmp_path)
    assert recorded == pytest.approx(dict(enumerate(expected)), rel=1e-6)


def test_a_loss_summed_over_the_step_is_one_step_scalar_without_data_parallelism(tmp_path):
    _record(tmp_path, _whole, summed_over_step=True)
    assert list(_losses(tmp_path)) == [NO_MICRO_BATCH]


def test_a_loss_summed_over_the_step_under_data_parallelism_is_a_finding_not_a_wrong_key(tmp_path):
    tracer = _record(tmp_path, _whole, summed_over_step=True,
                     config=TracerConfig(data_parallel_rank=1, data_parallel_size=2))
    assert _losses(tmp_path) == {} and tracer.num_findings == 1
    with RunReader(tmp_path) as reader:
        (finding,) = reader.findings
    assert finding.fqn == LOSS_FUNCTION and "micro-batches [1, 3]" in finding.message


@pytest.mark.parametrize("pieces, expected", [
    ([1.0, 2.0], 3.0),
    ([1.0, 2.0, 3.0], 3.0),           # the third is the sum of the first two: it covers them
    ([1.0, 2.0, 3.0, 0.5], 3.5),
    ([0.0, 0.0], 0.0),
    ([0.25], 0.25),
], ids=["two pieces", "pieces then total", "a piece after a total", "zeros", "one piece"])
def test_loss_pieces(pieces, expected):
    loss = LossPieces(seq=0, dtype=torch.float32)
    for piece in pieces:
        loss.add(piece, 2.0**-24)
    assert loss.total == expected


def _clip_twice(run_dir, second_norm_factor: float | None, role: str = "reference") -> Tracer:
    """Clipping once per parameter group with one total norm (transformers' Trainer on mixed device meshes);
    `second_norm_factor` None: once, over every parameter (clip_grad_norm_)."""
    model = _Trunk()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(run_dir, model, role=role, optimizer=optimizer)
    with tracer.step(0):
        model.head(model(_batch(0))).square().mean().backward()
        if second_norm_factor is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            torch.nn.utils.clip_grads_with_norm_(list(model.body.parameters()), 0.01, total)
            torch.nn.utils.clip_grads_with_norm_(list(model.head.parameters()), 0.01, total * second_norm_factor)
        optimizer.step()
    tracer.close()
    return tracer


def test_clipping_per_parameter_group_passes_against_clipping_once(tmp_path):
    _clip_twice(tmp_path / "ref", None)
    _clip_twice(tmp_path / "cand", 1.0, role="candidate")
    with RunReader(tmp_path / "ref") as reference, RunReader(tmp_path / "cand") as candidate:
        result = compare_runs(reference, candidate)
    assert result.passed and {"scalar.grad_norm", "scalar.clip_coef"} <= {c.key.slot for c in result.comparisons}


def test_a_step_scalar_computed_twice_alike_is_recorded_once(tmp_path):
    tracer = _clip_twice(tmp_path, 1.0)
    assert tracer.num_findings == 0
    with RunReader(tmp_path) as reader:
        norms = [m for k, ms in reader.index.items() if k.fqn == GRADIENT_CLIPPING for m in ms if k.slot == "scalar.grad_norm"]
    assert len(norms) == 1


def test_a_step_scalar_computed_twice_differently_is_a_finding_naming_both_values(tmp_path):
    tracer = _clip_twice(tmp_path, 2.0)
    with RunReader(tmp_path) as reader:
        messages = [f.message for f in reader.findings]
    assert tracer.num_findings == 2  # the norm and the clip coefficient
    assert any("scalar.grad_norm" in m and "computed twice" in m for m in messages)


@pytest.mark.parametrize("first, second, dtype, agree", [
    (1.0, 1.0, torch.float32, True),
    (1.0, 1.0 + 2**-23, torch.float32, True),
    (1.0, 1.001, torch.float32, False),
    (float("nan"), float("nan"), torch.float32, True),
    (3.0, 4.0, torch.int64, False),
], ids=["equal", "one ulp", "apart", "both nan", "counts"])
def test_scalars_agree(first, second, dtype, agree):
    assert scalars_agree(first, second, dtype) is agree


def test_an_aux_loss_is_the_running_routers_scalar_of_its_micro_batch(tmp_path):
    """megatron's router logs its aux losses while its forward runs (step_scalars.capture_megatron_aux_losses):
    they are recorded as that router's step scalars, per micro-batch."""
    from ttrace_core.record.step_scalars import _record_aux_loss

    class Router(nn.Module):
        def __init__(self, tracer_box: list) -> None:
            super().__init__()
            self.gate = nn.Linear(4, 2)
            self.tracer_box = tracer_box

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = self.gate(x)
            _record_aux_loss(self.tracer_box[0], "load_balancing_loss", logits.square().mean())
            return logits

    box: list = []
    model = nn.Sequential()
    model.add_module("mlp", nn.Module())
    model.mlp.add_module("router", Router(box))
    model.forward = lambda x: model.mlp.router(x)  # the root is called once per micro-batch
    tracer = Tracer(tmp_path / "run", model, role="candidate")
    box.append(tracer)
    inputs = [torch.randn(3, 4), torch.randn(3, 4)]
    with tracer.step(0):
        for x in inputs:
            model(x)
    tracer.close()
    with RunReader(tmp_path / "run") as reader:
        recorded = {key.micro_batch: float(reader.read(metas[0])) for key, metas in reader.index.items()
                    if key.slot == "scalar.load_balancing_loss" and key.fqn == "mlp.router"}
    with torch.no_grad():
        expected = {m: float(model.mlp.router.gate(x).square().mean()) for m, x in enumerate(inputs)}
    assert recorded == pytest.approx(expected)
