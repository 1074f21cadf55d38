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
