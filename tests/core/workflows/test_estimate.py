"""workflows/estimate.py's deviations: a tensor whose shape a perturbed re-run changed (a routed expert given other
tokens) is set aside, never subtracted from the reference's."""

import torch
from torch import nn

from ttrace_core.format.reader import RunReader
from ttrace_core.record.tracer import Tracer
from ttrace_core.workflows.estimate import deviations


def _record(run, rows: int, scale: float) -> None:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(scale)
        model.bias.zero_()
    tracer = Tracer(run, model, role="reference")
    with tracer.step(0):
        model(torch.ones(rows, 3))
    tracer.close()


def test_a_tensor_of_another_shape_is_set_aside(tmp_path):
    _record(tmp_path / "reference", rows=3, scale=1.0)
    _record(tmp_path / "perturbed", rows=4, scale=1.001)
    reshaped = set()
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "perturbed") as perturbed:
        found = deviations(reference, perturbed, reshaped)
    assert {(k.slot) for k in reshaped} == {"input.0", "output.0"}
    weight = next(k for k in found if k.fqn == "weight")
    assert abs(found[weight].deviation - 0.001 * 6 ** 0.5) < 1e-6


def test_an_expert_the_perturbation_reshaped_takes_its_siblings_relative_deviation(tmp_path):
    from ttrace_core.compare.estimate_file import PerturbationEstimate, TensorDeviation
    from ttrace_core.workflows.estimate import _from_siblings

    model = nn.Module()
    model.experts = nn.ModuleList([nn.Linear(3, 2), nn.Linear(3, 2)])
    model.forward = lambda x: model.experts[0](x) + model.experts[1](x)
    tracer = Tracer(tmp_path / "reference", model, role="reference")
    with tracer.step(0):
        model(torch.ones(4, 3))
    tracer.close()
    with RunReader(tmp_path / "reference") as reference:
        measured = next(k for k in reference.index if k.fqn == "experts.0" and k.slot == "output.0")
        reshaped = next(k for k in reference.index if k.fqn == "experts.1" and k.slot == "output.0")
        lone = next(k for k in reference.index if k.fqn == "experts.1.weight")  # no sibling measured
        estimate = PerturbationEstimate(precision="fp32", num_samples=2, relative=1e-7, tensors={
            measured: TensorDeviation(key=measured, deviation=0.3, reference_norm=1.5, numel=8, per_sample=[0.1, 0.2]),
            reshaped: TensorDeviation(key=reshaped, deviation=9.0, reference_norm=1.0, numel=8, per_sample=[9.0])})
        # the weight of expert 1 has a sibling pattern (experts.*.weight) but nothing measured on it
        left_out = _from_siblings(estimate, {reshaped, lone}, reference)
        norm = float(torch.linalg.vector_norm(reference.read(reference.index[reshaped][0]).double()))
    entry = estimate.tensors[reshaped]  # the largest of its sibling's and its own measured draws: 9.0
    assert entry.per_sample == [9.0, 9.0] and abs(entry.deviation - 9.0 * norm) < 1e-9
    assert left_out == {lone} and lone not in estimate.tensors


def test_an_expert_sent_as_many_other_tokens_is_set_aside(tmp_path):
    """A perturbed re-run whose router sent an expert as many tokens, but other ones: its rows are not the
    reference's tokens, so no deviation is measured on them (it would be of order 1: a tolerance that hides bugs)."""
    from tests.core.canonicalize.test_token_rows import _record_routed

    _record_routed(tmp_path / "reference", [2, 0, 3])
    _record_routed(tmp_path / "perturbed", [1, 0, 3])
    _record_routed(tmp_path / "same", [2, 0, 3])
    reshaped = set()
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "perturbed") as perturbed:
        found = deviations(reference, perturbed, reshaped)
    assert {(k.fqn, k.slot) for k in reshaped} == {("expert", "input.0"), ("expert", "output.0"),
                                                   ("expert.linear", "input.0"), ("expert.linear", "output.0")}
    assert not reshaped & set(found)
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "same") as same:
        reshaped = set()
        found = deviations(reference, same, reshaped)
    assert not reshaped and all(entry.deviation == 0 for key, entry in found.items() if key.fqn.startswith("expert"))


class _Bf16Inside(nn.Module):
    """A module that computes in bfloat16 inside a float32 run (torchtitan's grouped experts: `x.bfloat16()`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.bfloat16() @ self.weight.bfloat16()).type_as(x)


def test_weights_of_a_module_that_computes_in_bf16_are_perturbed_at_bf16s_round_off(tmp_path):
    """Its outputs all lie on bfloat16's grid; its float32 neighbour's do not. A perturbation of float32's u would
    almost never move a bfloat16 value, and the module's bf16 round-off would be missing from the estimate."""
    from ttrace_core.record.generator import WeightPerturbation
    from ttrace_core.workflows.estimate import coarser_weights, grid_unit_roundoff

    model = nn.Sequential(nn.Linear(4, 8), _Bf16Inside())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(tmp_path / "run", model, role="reference", optimizer=optimizer)
    with tracer.step(0):
        model(torch.randn(16, 4, generator=torch.Generator().manual_seed(0))).square().mean().backward()
        optimizer.step()
    tracer.close()
    fp32_u = torch.finfo(torch.float32).eps / 2
    with RunReader(tmp_path / "run") as reference:
        assert coarser_weights(reference, fp32_u) == {"1.weight": 2 ** -8}
        assert coarser_weights(reference, 2 ** -8) == {}  # a bf16 run: nothing coarser than itself
    assert grid_unit_roundoff([torch.randn(100).half().float()]) == 2 ** -11
    assert grid_unit_roundoff([torch.randn(100)]) is None
    assert grid_unit_roundoff([torch.zeros(100), torch.ones(10)]) is None  # too few values to tell
    perturbation = WeightPerturbation(sample=0, relative=fp32_u, coarser={"1.weight": 2 ** -8})
    full = torch.ones(1000)
    assert perturbation.relative_of("0.weight") == fp32_u
    moved = (perturbation.apply(0, "1.weight", full) - 1).abs().max()
    assert 2 ** -9 < moved <= 2 ** -8
