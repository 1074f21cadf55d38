"""Statistics reused within a step for the same bytes (record/summaries.py): a reused record's statistics
are the ones taking them again would give, bit for bit, and anything that may have changed the values (an
in-place op, a write around autograd that keeps the version counter, another step, a freed storage) takes
them again."""

import pytest
import torch
from torch import nn

from ttrace_core.format.reader import RunReader
from ttrace_core.format.writer import stats_from_tensor
from ttrace_core.record.summaries import MIN_REUSED_ELEMENTS, StepSummaries
from ttrace_core.record.tracer import Tracer, TracerConfig


def _activation() -> torch.Tensor:
    return torch.randn(64, 128, generator=torch.Generator().manual_seed(0))


def _alias(value: torch.Tensor) -> torch.Tensor:
    """Another tensor object over the same bytes, viewed the same way (what a full backward hook hands on)."""
    return value.view(value.shape)


def _in_place(value: torch.Tensor) -> torch.Tensor:
    value.mul_(2)  # bumps the version counter
    return value


def _around_autograd(value: torch.Tensor) -> torch.Tensor:
    value.data.add_(1)  # keeps the version counter, as an in-place collective does (dist.all_reduce)
    return value


def _strided(value: torch.Tensor) -> torch.Tensor:
    return value.t()  # the same storage viewed another way: other strides


@pytest.mark.parametrize(("second", "reused"), [
    (lambda value: value, True),
    (_alias, True),
    (_in_place, False),
    (_around_autograd, False),
    (_strided, False),
], ids=["the same tensor again", "an alias of the same bytes", "changed in place", "changed around autograd",
        "another view of the storage"])
def test_statistics_are_reused_only_for_the_same_unchanged_bytes(second, reused):
    summaries = StepSummaries()
    value = _activation()
    assert summaries.stats(value, reusable=True) == stats_from_tensor(value)
    again = second(value)
    assert summaries.stats(again, reusable=True) == stats_from_tensor(again)
    assert summaries.num_reused == int(reused)


def test_a_change_around_autograd_is_caught_by_the_sum_not_the_version():
    summaries = StepSummaries()
    value = _activation()
    before = summaries.stats(value, reusable=True)
    version = value._version
    value.data.mul_(-1)
    assert value._version == version
    assert summaries.stats(value, reusable=True).sum == pytest.approx(-before.sum)
    assert summaries.num_reused == 0


@pytest.mark.parametrize(("value", "reusable"), [
    (_activation(), False),
    (_activation().bfloat16(), True),
    (torch.randn(MIN_REUSED_ELEMENTS - 1), True),
], ids=["a parameter or gradient", "half precision", "a small tensor"])
def test_statistics_are_taken_again_where_reuse_does_not_apply(value, reusable):
    summaries = StepSummaries()
    for _ in range(2):
        assert summaries.stats(value, reusable=reusable) == stats_from_tensor(value)
    assert summaries.num_reused == 0


def test_statistics_with_nan_or_inf_are_taken_again():
    summaries = StepSummaries()
    value = _activation()
    value[3, 5] = float("nan")
    for _ in range(2):
        assert summaries.stats(value, reusable=True).num_nan == 1
    assert summaries.num_reused == 0


def test_a_new_step_takes_them_again():
    summaries = StepSummaries()
    value = _activation()
    summaries.stats(value, reusable=True)
    summaries.clear()
    summaries.stats(value, reusable=True)
    assert summaries.num_reused == 0


def test_a_freed_storage_is_never_matched():
    summaries = StepSummaries()
    value = _activation()
    summaries.stats(value, reusable=True)
    del value
    (entry,) = summaries._taken.values()
    assert entry[1].expired()  # its address and version may now be another tensor's: the entry cannot match


class _ReducedInPlace(nn.Module):
    """A module whose output is changed in place, around autograd, before the next module reads it: a
    tensor-parallel all-reduce of a partial sum (`dist.all_reduce` keeps the version counter), here `.data`."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(128, 128), nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.first(x)
        partial.data.mul_(2)
        return self.second(partial)


@pytest.mark.parametrize("stats_only", [True, False], ids=["stats-only", "full"])
def test_a_module_output_changed_before_the_next_module_reads_it_is_recorded_as_read(tmp_path, stats_only):
    torch.manual_seed(0)
    model = _ReducedInPlace()
    tracer = Tracer(tmp_path, model, role="candidate", config=TracerConfig(stats_only=stats_only))
    x = torch.randn(64, 128, requires_grad=True)
    with tracer.step(0):
        model(x).sum().backward()
    tracer.close()
    expected_input = model.first(x).detach() * 2
    with RunReader(tmp_path) as reader:
        metas = {(k.fqn, k.slot): m for k, ms in reader.index.items() if k.phase == "forward" for m in ms}
        output, read = metas[("first", "output.0")], metas[("second", "input.0")]
        assert read.stats == stats_from_tensor(expected_input)
        assert output.stats != read.stats
        if not stats_only:
            assert torch.equal(reader.read(read), expected_input)


def test_an_activation_recorded_twice_in_a_step_is_summarized_once(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    tracer = Tracer(tmp_path, model, role="candidate", config=TracerConfig(stats_only=True))
    with tracer.step(0):
        model(torch.randn(64, 128, requires_grad=True)).sum().backward()
    tracer.close()
    assert tracer._summaries.num_reused >= 1  # "0" output.0 is "1" input.0 (and its gradient, in backward)
    with RunReader(tmp_path) as reader:
        metas = {(k.phase, k.fqn, k.slot): m for k, ms in reader.index.items() for m in ms}
    assert metas[("forward", "0", "output.0")].stats == metas[("forward", "1", "input.0")].stats
