"""What `attach_trainer` reads off a Lightning Trainer and changes under a ttrace command (record/lightning_trainer.py):
the data-parallel degrees and loss scale, the training batches dealt by batch, and the wrapper's call of the
LightningModule kept quiet. The real Trainer under DDP: tests/thirdparty/test_lightning.py."""

from types import SimpleNamespace

import pytest
import torch

from ttrace_core.record.lightning_trainer import DealtBatches, QuietOuterCall, degrees, loss_scale


def _trainer(*, sampling=None, automatic=True, accumulation=4):
    return SimpleNamespace(distributed_sampler_kwargs=sampling, accumulate_grad_batches=accumulation,
                           lightning_module=SimpleNamespace(automatic_optimization=automatic))


@pytest.mark.parametrize(("trainer", "expected"), [
    (_trainer(), (0, 1)),  # one device: no distributed sampler
    (_trainer(sampling={"num_replicas": 4, "rank": 3}), (3, 4)),
    (_trainer(sampling={"num_replicas": 2, "rank": 1}), (1, 2)),  # a model-parallel mesh's data-parallel axis
], ids=["one device", "ddp", "data-parallel axis"])
def test_data_parallel_degrees_are_what_the_strategy_tells_its_sampler(trainer, expected):
    assert degrees(trainer) == expected


def test_the_loss_scale_is_one_over_the_accumulated_batches_unless_the_user_steps_by_hand():
    assert loss_scale(_trainer(accumulation=4)) == pytest.approx(0.25)
    assert loss_scale(_trainer(accumulation=1)) == 1.0
    assert loss_scale(_trainer(automatic=False, accumulation=4)) == 1.0


def _loader(shuffle: bool, batches: int = 7):
    return torch.utils.data.DataLoader(torch.arange(batches * 2), batch_size=2, shuffle=shuffle)


def test_each_process_draws_batches_k_times_size_plus_its_rank_and_all_as_many():
    loader = _loader(shuffle=False, batches=7)
    whole = [batch.tolist() for batch in DealtBatches(loader, 0, 1, seed=0)]
    assert whole == [batch.tolist() for batch in loader]  # one process: every batch, in order
    shares = [[batch.tolist() for batch in DealtBatches(loader, rank, 2, seed=0)] for rank in (0, 1)]
    assert shares == [whole[0:6:2], whole[1:6:2]]  # the 7th batch has no partner: left out on both
    assert [len(DealtBatches(loader, rank, 2, seed=0)) for rank in (0, 1)] == [3, 3]
    assert DealtBatches(loader, 0, 2, seed=0).batch_size == 2  # the loader's own attributes


def test_an_unseeded_shuffle_is_seeded_by_the_run_and_the_epoch_whatever_the_global_rng():
    one, other = DealtBatches(_loader(shuffle=True), 0, 1, seed=3), DealtBatches(_loader(shuffle=True), 0, 1, seed=3)
    torch.manual_seed(1)
    first = [batch.tolist() for batch in one]
    torch.manual_seed(2)  # another global RNG state, as a DDP Lightning run leaves it
    assert [batch.tolist() for batch in other] == first
    assert [batch.tolist() for batch in one] != first  # the next epoch reshuffles
    assert one.loader.sampler.generator is None  # the user's sampler is given back as it was
    seeded = _loader(shuffle=True)
    seeded.sampler.generator = torch.Generator().manual_seed(5)
    expected = [batch.tolist() for batch in torch.utils.data.DataLoader(
        torch.arange(14), batch_size=2, sampler=torch.utils.data.RandomSampler(
            torch.arange(14), generator=torch.Generator().manual_seed(5)))]
    assert [batch.tolist() for batch in DealtBatches(seeded, 0, 1, seed=3)] == expected  # its own generator is kept


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.linear(x)

    def training_step(self, batch):
        return self(batch[:, :2]).sum()


class _Redirection:
    """What Lightning's `_ForwardRedirection` does: the wrapper calls the module with `forward` swapped for the method."""

    def __call__(self, wrapper, module, method_name, *args):
        original = module.forward

        def redirected(*inner):
            module.forward = original
            return getattr(module, method_name)(*inner)
        module.forward = redirected
        return wrapper(*args)


def test_the_wrappers_call_of_the_module_runs_none_of_its_hooks_and_training_steps_calls_run_them():
    model = _Model()
    wrapper = torch.nn.Sequential(model)  # a wrapper that calls the module it holds, as DDP does
    calls, backward_calls = [], []
    model.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape)))
    model.register_full_backward_hook(lambda module, grad_input, grad_output: backward_calls.append(len(grad_output)))
    batch = torch.ones(4, 3, requires_grad=True)
    QuietOuterCall(_Redirection())(wrapper, model, "training_step", batch).backward()
    assert calls == [(4, 2)] and backward_calls == [1]  # forward's call only, not the wrapper's with the whole batch
    assert "training_step" not in vars(model) and model._forward_pre_hooks  # nothing left behind
    _Redirection()(wrapper, model, "training_step", batch)
    assert calls == [(4, 2), (4, 3), (4, 2)]  # Lightning's own redirection: the module is called twice


def test_a_failing_training_step_leaves_the_modules_hooks_in_place():
    model = _Model()
    model.register_forward_hook(lambda *_: None)

    def failing(batch):
        raise ValueError("the user's bug")
    model.training_step = failing
    with pytest.raises(ValueError):
        QuietOuterCall(_Redirection())(torch.nn.Sequential(model), model, "training_step", torch.ones(1, 3))
    assert len(model._forward_hooks) == 1
