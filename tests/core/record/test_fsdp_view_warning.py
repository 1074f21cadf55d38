"""FSDP2 warns when a wrapped module returns a view (torch 2.13+). The tracer's full backward hooks turn the
output of every hooked module into such a view, so a model ending in a traced module warned under `ttrace
record` only (issue 41, point 17). The tracer quiets exactly those views; a view the script makes itself
still warns. One process, a one-rank gloo group: fully_shard needs a process group, not several ranks."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ttrace_core.record.module_hooks import FSDP_VIEW_WARNING
from ttrace_core.record.tracer import Tracer


class EndsInTracedModule(nn.Module):
    """The user script's shape: the forward returns a traced submodule's output as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class ReturnsItsOwnView(EndsInTracedModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.norm(self.fc(x)) * 2).view(-1, 4)  # a view the script makes: FSDP's warning is due


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp_view_warnings(model_class: type[nn.Module], run_dir) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = model_class()
    fully_shard(model)
    tracer = Tracer(run_dir, model, role="reference")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracer.step(0):
                model(torch.randn(2, 4)).sum().backward()
    finally:
        tracer.close()
    return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


def test_the_tracers_own_views_do_not_make_fsdp2_warn(one_rank_group, tmp_path):
    assert _fsdp_view_warnings(EndsInTracedModule, tmp_path / "ends") == []


def test_a_view_the_script_returns_still_warns(one_rank_group, tmp_path):
    found = _fsdp_view_warnings(ReturnsItsOwnView, tmp_path / "own")
    assert len(found) == 1 and "FSDPReturnsItsOwnView" in found[0]
    assert FSDP_VIEW_WARNING.startswith("FSDP2-wrapped module")
