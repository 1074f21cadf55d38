"""What `attach_trainer` reads off a Hugging Face Trainer (record/hf_trainer.py, record/trainer_attach.py), and the optimizer wrapper the tracer
sees through (step_scalars.hookable_optimizer). The real Trainer under DDP: tests/thirdparty/test_hf_trainer.py."""

from types import SimpleNamespace

import pytest
import torch

from ttrace_core.record.hf_trainer import degrees, loss_scale
from ttrace_core.record.trainer_attach import attach_trainer
from ttrace_core.record.step_scalars import hookable_optimizer


def _trainer(*, processes=4, index=3, tp=1, cp=1, accumulation=4, current=None, accepts_loss_kwargs=True,
             scaled_for_accumulation=None, compute_loss_func=None):
    return SimpleNamespace(
        accelerator=SimpleNamespace(num_processes=processes, process_index=index),
        args=SimpleNamespace(gradient_accumulation_steps=accumulation),
        get_tp_size=lambda: tp, get_cp_size=lambda: cp, get_sp_size=lambda: 1,
        model_accepts_loss_kwargs=accepts_loss_kwargs, loss_is_scaled_for_ga=scaled_for_accumulation,
        compute_loss_func=compute_loss_func, current_gradient_accumulation_steps=current)


@pytest.mark.parametrize(("trainer", "expected"), [
    (_trainer(), (3, 4)),
    (_trainer(processes=1, index=0), (0, 1)),
    (_trainer(tp=2), (1, 2)),  # ranks 2 and 3 share one batch: the second data-parallel rank of two
    (_trainer(tp=2, cp=2, index=2), (0, 1)),
], ids=["ddp", "one process", "tp shares a batch", "tp x cp share a batch"])
def test_data_parallel_degrees_count_ranks_that_share_a_batch_once(trainer, expected):
    assert degrees(trainer) == expected


@pytest.mark.parametrize(("trainer", "expected"), [
    (_trainer(), 4.0),  # normalized by the step's token count, then multiplied by the data-parallel size
    (_trainer(tp=2), 2.0),
    (_trainer(processes=1, index=0), 1.0),
    (_trainer(accepts_loss_kwargs=False), 0.25),  # a per-batch mean, divided by the accumulation steps
    (_trainer(accepts_loss_kwargs=False, current=3), 1 / 3),  # the last step of an epoch may accumulate fewer
    (_trainer(accepts_loss_kwargs=False, compute_loss_func=len), 4.0),
    (_trainer(scaled_for_accumulation=False), 0.25),  # the user's own compute_loss says which
], ids=["tokens, ddp", "tokens, tp", "tokens, one process", "mean", "mean, short step", "loss function", "said"])
def test_the_loss_scale_is_what_the_trainer_multiplies_the_models_loss_by(trainer, expected):
    assert loss_scale(trainer) == pytest.approx(expected)


def test_what_the_trainer_says_itself_cannot_be_passed():
    with pytest.raises(TypeError, match="loss_scale"):
        attach_trainer(SimpleNamespace(add_callback=lambda callback: None), loss_scale=2.0)


def test_outside_a_ttrace_command_the_callback_does_nothing():
    added = []
    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(add_callback=added.append, model_wrapped=model,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **vars(_trainer(processes=1, index=0)))
    tracing = attach_trainer(trainer)
    (callback,) = added
    for event in ("on_train_begin", "on_step_begin", "on_step_end", "on_train_end"):
        getattr(callback, event)(None, SimpleNamespace(global_step=0), None)
    assert tracing.session is not None and not tracing.session.active
    first = tracing.session
    callback.on_train_begin(None, SimpleNamespace(global_step=2), None)  # a second train(): no second attach
    assert tracing.session is first


class _Wrapper(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: a torch Optimizer by class, without running its __init__."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_the_tracer_hooks_the_optimizer_inside_a_wrapper_that_has_no_hooks_of_its_own():
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert hookable_optimizer(_Wrapper(_Wrapper(inner))) is inner
    assert hookable_optimizer(inner) is inner
    megatron_like = SimpleNamespace(step=lambda: None)  # not a torch Optimizer: its step is wrapped instead
    assert hookable_optimizer(megatron_like) is megatron_like


class _Unhookable(torch.optim.SGD):
    """An optimizer whose step hooks cannot be registered (a wrapper's own broken registry)."""

    def register_step_post_hook(self, hook):
        raise AttributeError("no hooks here")


def test_an_optimizer_that_refuses_step_hooks_has_its_step_wrapped_and_the_training_goes_on(tmp_path):
    from ttrace_core.format.reader import RunReader
    from ttrace_core.record.tracer import Tracer

    model = torch.nn.Linear(2, 2)
    optimizer = _Unhookable(model.parameters(), lr=0.1)
    tracer = Tracer(tmp_path, model, role="reference", optimizer=optimizer)
    with tracer.step(0):
        model(torch.ones(3, 2)).sum().backward()
        optimizer.step()
    tracer.close()
    assert not optimizer._optimizer_step_pre_hooks  # the pre-hook registered first was taken back
    with RunReader(tmp_path) as reader:
        phases = {(key.phase, key.slot) for key in reader.index}
    assert {("grad", "grad"), ("param", "value")} <= phases
