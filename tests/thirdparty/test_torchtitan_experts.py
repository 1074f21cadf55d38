"""torchtitan's grouped experts traced by token (integrations/torchtitan.py ExpertTokens), in one process.

torchtitan's own RoutedExperts (LocalTokenDispatcher + GroupedExperts) computes 4 experts in one call on tokens
sorted by expert; the tracer must record each expert's rows as `inner_experts.<e>`, per micro-batch, in
token order: exactly the tokens the router sent to that expert, whatever the dispatcher's order. The
expert-parallel all-to-all path is measured in benchmarks/thirdparty_torchtitan.py (moe ep2)."""

import pytest
import torch
from torch import nn

import torchtitan  # noqa: F401 - imported, not skipped: this tier runs in CI
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from ttrace_core.format.reader import RunReader
from ttrace_core.record.adapters import TorchAdapter, TracerSelection
from ttrace_core.record.tracer import Tracer

pytestmark = pytest.mark.slow  # a third-party trainer
DIM, HIDDEN, EXPERTS, TOP_K = 8, 16, 4, 2


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.routed_experts = RoutedExperts(RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K)))
        for param in self.routed_experts.parameters():
            nn.init.normal_(param, std=0.1)

    def forward(self, x_BLD: torch.Tensor, expert_ids_BLK: torch.Tensor) -> torch.Tensor:
        scores_BLK = torch.full(expert_ids_BLK.shape, 0.5)
        counts_E = torch.bincount(expert_ids_BLK.flatten(), minlength=EXPERTS)
        return self.routed_experts(x_BLD, scores_BLK, expert_ids_BLK, counts_E)


def test_each_grouped_expert_is_recorded_with_its_own_tokens_in_token_order(tmp_path):
    torch.manual_seed(0)
    model = _Moe()
    adapter = TorchAdapter(model, "reference", 1, TracerSelection(include=("*",), exclude=(), loss_scale=1.0,
                                                                 data_parallel=None))
    tracer = Tracer(tmp_path / "run", model, role="reference", config=adapter.config)
    adapter.declare(tracer, None)
    x_BLD = torch.randn(2, 3, DIM, requires_grad=True)
    expert_ids_BLK = torch.tensor([[[1, 3], [0, 1], [2, 1]], [[3, 0], [1, 2], [0, 3]]])
    with tracer.step(0):
        model(x_BLD, expert_ids_BLK).sum().backward()
    tracer.close()
    with RunReader(tmp_path / "run") as reader:
        inputs = {key.fqn: reader.read(metas[0]) for key, metas in reader.index.items()
                  if key.slot == "input.0" and key.phase == "forward" and ".inner_experts." in key.fqn}
        grads = {key.fqn for key in reader.index if key.phase == "backward" and ".inner_experts." in key.fqn}
    tokens = x_BLD.detach().reshape(-1, DIM)
    for expert in range(EXPERTS):
        chosen = [t for t in range(6) if expert in expert_ids_BLK.reshape(6, TOP_K)[t].tolist()]
        assert torch.equal(inputs[f"routed_experts.inner_experts.{expert}"], tokens[chosen]), expert
    assert grads == {f"routed_experts.inner_experts.{e}" for e in range(EXPERTS)}
