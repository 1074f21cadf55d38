"""Part of stage 1 (record): the step's scalars, read where the training code computes them.

Per micro-batch, the loss backward starts from and its token count (pseudo-module LOSS_FUNCTION);
per step, the gradient norm, the clip coefficient, the loss scale, the learning rate and the
number of skipped steps (pseudo-module GRADIENT_CLIPPING, phase "step"). Each capture wraps one
function for as long as the tracer lives and gives it back at close:

- `capture_backward_losses`: torch.autograd.backward (Tensor.backward calls it too); a backward
  from a one-element tensor with no explicit gradient is a loss, of the micro-batch whose module
  backwards it runs; a loss that starts several backwards per micro-batch (a chunked cross entropy,
  a loss-parallel chunk, a pipeline's last stage) is recorded once, as that micro-batch's, and one
  backward over several micro-batches as the step's (tracer.end_loss_backward);
- `capture_megatron_losses`: megatron's schedules.forward_step_calc_loss, which also says how many
  micro-batches the loss is divided by, so the activation gradients get their scale by themselves;
- `capture_torch_clipping`: torch.nn.utils' clip_grads_with_norm_, which clip_grad_norm_ calls:
  the gradients are recorded before they are scaled, and the norm and coefficient beside them, so
  the clip factor's round-off (it comes from a reduction over every gradient element) is judged
  once, at the norm, and never multiplied into every gradient;
- `capture_optimizer`: a torch optimizer's step hooks (seen through accelerate's wrapper), or else
  `capture_optimizer_step`: the step of an optimizer that is not a torch.optim.Optimizer (Megatron's
  ChainedOptimizer has no step hooks): gradients before it; after it, the grad norm and success
  flag it returns (Megatron's `(success, grad_norm, num_zeros)`), then the parameters.

Every wrapper calls the original whatever happens in the tracer: a tracing error is the tracer's
finding, never the training run's exception.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from ttrace_core.format.naming import GRADIENT_CLIPPING
from ttrace_core.integrations.patching import patch_attribute

Undo = Callable[[], None]
Tracer = Any
"""The record.tracer.Tracer these captures feed (not imported: the tracer imports this module)."""


def _float_tensor(value: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        from ttrace_core.integrations.dtensor import local_value

        value = value.full_tensor() if hasattr(value, "full_tensor") else local_value(value)
        return value.detach().reshape(()).clone()
    return torch.tensor(float(value), dtype=dtype)


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """min(max_norm / (total_norm + 1e-6), 1): what torch's and megatron's clipping multiply by."""
    return min(max_norm / (total_norm + 1e-6), 1.0)


def record_step_scalars(tracer: Tracer, *, grad_norm: Any = None, max_norm: float | None = None,
                        loss_scale: Any = None, lr: float | None = None, skipped: bool | None = None) -> None:
    """Record what the step computed; an argument left None was not computed by this optimizer."""
    if grad_norm is not None:
        norm = _float_tensor(grad_norm)
        tracer.record_scalar("step", GRADIENT_CLIPPING, "grad_norm", norm)
        if max_norm is not None and max_norm > 0 and math.isfinite(float(norm)):
            coefficient = clip_coefficient(float(max_norm), float(norm))
            tracer.record_scalar("step", GRADIENT_CLIPPING, "clip_coef", torch.tensor(coefficient, dtype=norm.dtype))
    if loss_scale is not None:
        tracer.record_scalar("step", GRADIENT_CLIPPING, "loss_scale", _float_tensor(loss_scale))
    if lr is not None:
        tracer.record_scalar("step", GRADIENT_CLIPPING, "lr", torch.tensor(float(lr), dtype=torch.float64))
    if skipped is not None:
        tracer.skipped_steps += int(skipped)
        tracer.record_scalar("step", GRADIENT_CLIPPING, "skipped_steps", torch.tensor(tracer.skipped_steps))


def record_learning_rate(tracer: Tracer, optimizer: Any) -> None:
    """The learning rate the optimizer's step uses (its first parameter group's), read next to that step."""
    tracer.guarded(lambda: record_step_scalars(tracer, lr=learning_rate(optimizer)))


def learning_rate(optimizer: Any) -> float | None:
    groups = getattr(optimizer, "param_groups", None) or []
    return groups[0].get("lr") if groups else None


# ---- the loss ---------------------------------------------------------------------------------

def _is_loss(tensors: Any, grad_tensors: Any) -> torch.Tensor | None:
    """The loss a backward starts from: one one-element tensor with no explicit gradient."""
    if isinstance(tensors, (list, tuple)):
        if len(tensors) != 1:
            return None
        tensors = tensors[0]
        grad_tensors = grad_tensors[0] if isinstance(grad_tensors, (list, tuple)) and grad_tensors else grad_tensors
    if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 and grad_tensors is None:
        return tensors
    return None


def capture_backward_losses(tracer: Tracer) -> Undo:
    """Record each micro-batch's loss from the backwards that start from it. A backward belongs to the
    micro-batch whose module backwards it runs (a pipeline's 1F1B, a chunked loss's several backwards per
    micro-batch); the pieces of one micro-batch make one loss (step_state.LossPieces)."""
    original = torch.autograd.backward

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        loss = _is_loss(tensors, grad_tensors)
        started = None if loss is None else tracer.begin_loss_backward(loss)
        try:
            return original(tensors, grad_tensors, *args, **kwargs)
        finally:
            if started is not None:
                tracer.end_loss_backward(started)

    return patch_attribute(torch.autograd, "backward", backward)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of a floating dtype; 0 for integers (their values are exact)."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def scalars_agree(first: float, second: float, dtype: torch.dtype) -> bool:
    """Whether two computations of one step scalar agree: equal up to a few roundings of their dtype."""
    if math.isnan(first) or math.isnan(second):
        return math.isnan(first) and math.isnan(second)
    return first == second or abs(first - second) <= 4 * unit_roundoff(dtype) * max(abs(first), abs(second))


def capture_megatron_losses(tracer: Tracer) -> Undo:
    """Record each micro-batch's loss and token count where megatron's schedule computes them, and set
    the activation gradients' scale to what the schedule divides the loss by (1 / micro-batches, or
    1 under calculate_per_token_loss, where the gradients are divided by the token count later)."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.forward_step_calc_loss
    signature = inspect.signature(original)

    def forward_step_calc_loss(*args, **kwargs):
        output, num_tokens = original(*args, **kwargs)
        tracer.guarded(lambda: _record_megatron_loss(tracer, signature.bind(*args, **kwargs).arguments, output, num_tokens))
        return output, num_tokens

    return patch_attribute(schedules, "forward_step_calc_loss", forward_step_calc_loss)


def _record_megatron_loss(tracer: Tracer, arguments: dict, output: Any, num_tokens: Any) -> None:
    """Every pipeline stage learns the scale (its activation gradients carry it too); the last one records the loss."""
    config, num_microbatches = arguments.get("config"), arguments.get("num_microbatches") or 1
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    tracer.set_loss_scale(1.0 if per_token else 1.0 / num_microbatches)
    if arguments.get("is_last_stage") is False or arguments.get("loss_func") is None or arguments.get("collect_non_loss_data"):
        return
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        tracer.record_loss(output, num_tokens=num_tokens if isinstance(num_tokens, torch.Tensor) and num_tokens.item() else None)


def capture_megatron_aux_losses(tracer: Tracer) -> Undo:
    """Record each MoE router's auxiliary losses (load balancing, sequence or global load balancing, z-loss)
    where megatron's router logs them (router.py calls moe_utils.save_to_aux_losses_tracker with the loss
    divided by its coefficient): a step scalar "scalar.<name>" of the router that is running, per micro-batch.
    A wrong token count or an SP-sharded shape in the loss shows there, before the gradients it adds to."""
    from megatron.core.transformer.moe import router

    original = router.save_to_aux_losses_tracker

    def save_to_aux_losses_tracker(name, loss, *args, **kwargs):
        tracer.guarded(lambda: _record_aux_loss(tracer, name, loss))
        return original(name, loss, *args, **kwargs)

    return patch_attribute(router, "save_to_aux_losses_tracker", save_to_aux_losses_tracker)


def _record_aux_loss(tracer: Tracer, name: str, loss: Any) -> None:
    state = tracer.state
    if state is None or not tracer.recording() or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return
    running = [fqn for fqn, pending in state.pending_forward.items() if pending and pending[-1] is not None
               and fqn.rsplit(".", 1)[-1] == "router"]
    if len(running) == 1:
        micro_batch, _ = state.pending_forward[running[0]][-1]
        tracer.record_scalar("forward", running[0], name, loss.detach(), micro_batch)


# ---- clipping and the optimizer step -----------------------------------------------------------

def capture_torch_clipping(tracer: Tracer) -> Undo:
    """Record gradients, norm and coefficient where torch's clipping scales the gradients."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    original = clip_grad._clip_grads_with_norm_

    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        tracer.record_gradients()
        tracer.guarded(lambda: record_step_scalars(tracer, grad_norm=total_norm, max_norm=float(max_norm)))
        return original(parameters, max_norm, total_norm, foreach)

    undo_module = patch_attribute(clip_grad, "_clip_grads_with_norm_", clip_grads_with_norm_)
    undo_public = patch_attribute(utils, "clip_grads_with_norm_", clip_grads_with_norm_)

    def undo() -> None:
        undo_public()
        undo_module()

    return undo


def capture_optimizer(tracer: Tracer, optimizer: Any) -> Undo:
    """Watch the optimizer's step: a torch optimizer through its step hooks (gradients before, the learning rate
    and the parameters after); any other (Megatron's), or one that refuses the hooks, by wrapping its step. A
    wrapper that subclasses torch's Optimizer without its state (accelerate's AcceleratedOptimizer, which the
    Hugging Face Trainer hands on) is seen through to the optimizer it steps."""
    optimizer = hookable_optimizer(optimizer)
    if not hasattr(optimizer, "register_step_pre_hook"):
        return capture_optimizer_step(tracer, optimizer)

    def after_step(*_) -> None:
        record_learning_rate(tracer, optimizer)
        tracer.record_parameters()
    handles = []
    try:
        handles.append(optimizer.register_step_pre_hook(lambda *_: tracer.record_gradients()))
        handles.append(optimizer.register_step_post_hook(after_step))
    except Exception:  # noqa: BLE001 - hooks it cannot take (another wrapper's): its step is wrapped instead
        for handle in handles:
            handle.remove()
        return capture_optimizer_step(tracer, optimizer)

    def undo() -> None:
        for handle in handles:
            handle.remove()
    return undo


def hookable_optimizer(optimizer: Any) -> Any:
    """The optimizer whose step hooks fire: `optimizer` itself, or, for a wrapper that subclasses
    torch.optim.Optimizer without running its __init__ (no hook registries of its own) and steps an inner
    `.optimizer`, that inner one (followed as deep as it goes). Anything else is returned as it is."""
    seen = set()
    while (isinstance(optimizer, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" not in vars(optimizer)
           and id(optimizer) not in seen and getattr(optimizer, "optimizer", None) is not None):
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def capture_optimizer_step(tracer: Tracer, optimizer: Any) -> Undo:
    """Wrap the optimizer's step: gradients before it; after it, its grad norm (what it clipped with),
    clip coefficient, loss scale, learning rate and skipped-step count, then the parameters."""
    original = optimizer.step

    def step(*args, **kwargs):
        tracer.record_gradients()
        result = original(*args, **kwargs)
        tracer.guarded(lambda: _record_step_result(tracer, optimizer, result))
        tracer.record_parameters()
        return result

    return patch_attribute(optimizer, "step", step)


def _record_step_result(tracer: Tracer, optimizer: Any, result: Any) -> None:
    succeeded, grad_norm = (result[0], result[1]) if isinstance(result, tuple) and len(result) >= 2 else (result, None)
    config = getattr(optimizer, "config", None)
    max_norm = getattr(config, "clip_grad", None)
    scale = optimizer.get_loss_scale() if hasattr(optimizer, "get_loss_scale") else None
    record_step_scalars(tracer, grad_norm=grad_norm, max_norm=max_norm, loss_scale=scale,
                        lr=learning_rate(optimizer), skipped=not succeeded if isinstance(succeeded, bool) else None)


TORCH_CAPTURES = (capture_backward_losses, capture_torch_clipping)
"""What a PyTorch-native run computes its step's scalars with; the Tracer's default."""
