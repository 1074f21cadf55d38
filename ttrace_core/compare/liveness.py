"""Did the reference train? The negative control of a comparison.

Part of stage 3 (compare), run on the reference's index once per comparison (evidence.tally_coverage).
A pass says "the candidate computes what the reference computes", which means nothing when the
reference itself did not train: against a reference whose loss never reached backward (a detached
loss) or whose learning rate was 0, a candidate with the same dead step passes too. Input: the
reference's `RunReader` and the compared steps. Output: a `Liveness`, whether the reference trained
(None when its trace holds nothing to tell) and, when it did not, why in words.

Two checks; either one is enough to refuse a pass:
- gradients: every reduced parameter gradient (phase "grad") of the compared steps is zero;
- updates: every parameter's post-step value (phase "param", slot "value") equals its value before the
  step (slot PRE_STEP_SLOT of the same step, or slot "value" of the step before). Skipped when no
  parameter has a recorded pre-step value.

Cheap: each shard's statistics (`TensorMeta.stats`, recorded with every shard) answer both checks, so
no value is read in a run that trained. Values are read only where a shard carries no statistics, and
to confirm that two shards with equal statistics hold equal values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ttrace_core.format.reader import RunReader, pre_step_key
from ttrace_core.format.schema import TensorKey, TensorMeta

@dataclass(frozen=True, slots=True)
class Liveness:
    trained: bool | None
    """False: the reference did not train in the compared steps; None: its trace holds neither gradients
    nor a parameter's values before and after a step."""
    why_not: str = ""
    """When it did not train, what shows it: "every one of its 4 parameter gradients is zero at step 0"."""


def reference_liveness(reference: RunReader, steps: list[int]) -> Liveness:
    """Whether the reference trained in `steps`: some gradient is nonzero, or some parameter moved."""
    gradients = gradient_keys(reference, steps)
    if gradients and not any(_nonzero(reference, key) for key in gradients):
        return Liveness(trained=False, why_not=f"every one of its {_num_parameters(gradients)} parameter gradients "
                                               f"is zero {_at_steps(gradients)}")
    updates = update_pairs(reference, steps)
    if updates and not any(_moved(reference, before, after) for before, after in updates):
        updated = [after for _, after in updates]
        return Liveness(trained=False, why_not=f"every one of its {_num_parameters(updated)} parameters kept its value "
                                               f"through the optimizer step {_at_steps(updated)}")
    return Liveness(trained=True if gradients or updates else None)


def gradient_keys(reader: RunReader, steps: list[int]) -> list[TensorKey]:
    """The reduced parameter gradients of `steps`."""
    wanted = set(steps)
    return [key for key in reader.index if key.step in wanted and key.phase == "grad" and key.slot == "grad"]


def update_pairs(reader: RunReader, steps: list[int]) -> list[tuple[TensorKey, TensorKey]]:
    """(pre-step key, post-step key) of every parameter of `steps` whose value before the step is recorded."""
    wanted = set(steps)
    return [(before, after) for after in reader.index
            if after.step in wanted and (before := pre_step_key(reader, after)) is not None]


def _num_parameters(keys: list[TensorKey]) -> int:
    return len({key.fqn for key in keys})


def _at_steps(keys: list[TensorKey]) -> str:
    steps = sorted({key.step for key in keys})
    return f"at step {steps[0]}" if len(steps) == 1 else f"at steps {steps}"


def _nonzero(reader: RunReader, key: TensorKey) -> bool:
    return any(not _shard_is_zero(reader, meta) for meta in reader.index[key])


def _shard_is_zero(reader: RunReader, meta: TensorMeta) -> bool:
    stats = meta.stats
    if stats is not None:  # min and max over the finite values; a NaN or Inf is no zero gradient
        return stats.min == 0.0 == stats.max and stats.num_nan == 0 and stats.num_inf == 0
    return not bool(torch.count_nonzero(reader.read(meta).float()))  # (fp8 has no count_nonzero)


def _moved(reader: RunReader, before: TensorKey, after: TensorKey) -> bool:
    """Some shard of the parameter changed. Shards that cannot be paired rank by rank (another layout)
    count as moved: only evidence that every value stayed makes the reference dead."""
    before_by_rank = {meta.rank: meta for meta in reader.index[before]}
    after_by_rank = {meta.rank: meta for meta in reader.index[after]}
    if before_by_rank.keys() != after_by_rank.keys():
        return True
    return any(not _same_shard(reader, before_by_rank[rank], after_by_rank[rank]) for rank in after_by_rank)


def _same_shard(reader: RunReader, before: TensorMeta, after: TensorMeta) -> bool:
    """Equal statistics are necessary for equal values; the values decide where both shards hold them."""
    if before.local_shape != after.local_shape or before.layout != after.layout or before.dtype != after.dtype:
        return False
    if before.stats is not None and after.stats is not None and before.stats != after.stats:
        return False
    if before.stats_only or after.stats_only:
        return before.stats is not None and before.stats == after.stats
    return torch.equal(_bits(reader.read(before)), _bits(reader.read(after)))


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The bytes of the values: equality bit for bit (a NaN that stayed is unchanged; fp8 has no torch.equal)."""
    return values.reshape(-1).view(torch.uint8)
