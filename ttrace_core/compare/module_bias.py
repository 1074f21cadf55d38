"""Part of stage 3 (compare): the bias of the module whose output a tensor is, for the bias statistic.

A module's forward output `<fqn> / output.i` is offset by `<fqn>.bias` (a Linear's, a LayerNorm's; the
root module's is `bias`) when the module adds it. The bias is read as the run held it before the step
(its value.initial, or the previous step's post-step value), so the statistic sees the very vector the
forward added.
"""

from __future__ import annotations

import torch

from ttrace_core.canonicalize.logical_value import logical_value
from ttrace_core.format.naming import parameter_of
from ttrace_core.format.reader import RunReader, pre_step_key
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey


def module_bias(reader: RunReader, key: TensorKey) -> torch.Tensor | None:
    """The float64 bias of the module `key` is a forward output of, before this step, with the direction of its
    last update taken out; None when the key is not a forward output, the module has no recorded bias, or its
    values were not recorded.

    Past the first step a bias is partly its last update, and every run's optimizer rounds that update its own
    way (a gradient reduced in another order, an Adam step that amplifies it), so the whole model's step-1
    error leans along it: a clean TP2 fp32 run's final LayerNorm output sat at 0.58 of the bias test's line,
    along a bias that was its one zero-initialized update. A bias applied the wrong number of times still
    shows in full along the rest (its projection on b_perp is b_perp itself: k is unchanged)."""
    bias = parameter_of(key.fqn, "bias")
    before = bias_before(reader, key.step, bias) if key.phase == "forward" and key.slot.startswith("output") else None
    if before is None:
        return None
    earlier = bias_before(reader, key.step - 1, bias) if key.step > 0 else None
    if earlier is None or earlier.shape != before.shape:
        return before
    update = (before - earlier).flatten()
    update_sq = float(torch.dot(update, update))
    if update_sq == 0.0:
        return before
    return before - (float(torch.dot(before.flatten(), update)) / update_sq) * update.reshape(before.shape)


def bias_before(reader: RunReader, step: int, fqn: str) -> torch.Tensor | None:
    """The float64 values of parameter `fqn` as `step`'s forward used them (finite), or None when not recorded."""
    post_step = TensorKey(step=step, micro_batch=NO_MICRO_BATCH, phase="param", fqn=fqn, slot="value")
    before = pre_step_key(reader, post_step)
    if before is None or reader.index[before][0].stats_only:
        return None
    values = logical_value(reader, before)
    return values if bool(torch.isfinite(values).all()) else None
