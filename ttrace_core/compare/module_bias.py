"""Part of stage 3 (compare): the bias of the module whose output a tensor is, for the bias statistic.

A module's forward output `<fqn> / output.i` is offset by `<fqn>.bias` (a Linear's, a LayerNorm's) when
the module adds it. The bias is read as the run held it before the step (its value.initial, or the
previous step's post-step value), so the statistic sees the very vector the forward added.
"""

from __future__ import annotations

import torch

from ttrace_core.canonicalize.logical_value import logical_value
from ttrace_core.format.reader import RunReader, pre_step_key
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey


def module_bias(reader: RunReader, key: TensorKey) -> torch.Tensor | None:
    """The float64 bias of the module `key` is a forward output of, before this step; None when the key is
    not a forward output, the module has no recorded bias, or its values were not recorded."""
    if key.phase != "forward" or not key.slot.startswith("output"):
        return None
    post_step = TensorKey(step=key.step, micro_batch=NO_MICRO_BATCH, phase="param", fqn=f"{key.fqn}.bias", slot="value")
    before = pre_step_key(reader, post_step)
    if before is None or reader.index[before][0].stats_only:
        return None
    values = logical_value(reader, before)
    return values if bool(torch.isfinite(values).all()) else None
