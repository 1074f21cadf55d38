"""Part of stage 3 (compare): an adaptive optimizer's step on a gradient that is round-off.

Some gradients are zero in exact arithmetic, so what a run computes for them is pure round-off, and
two correct runs round them differently. An attention key bias is one: adding the same amount to every
logit of a query leaves its softmax as it is, so nothing flows back to the bias (Qwen2's k_proj bias,
BERT's key bias, the key third of GPT-2's fused c_attn bias). SGD moves such a parameter by lr x the
round-off, which is nothing. An adaptive optimizer (Adam, AdamW, Adagrad, RMSprop, Lion) divides each
element by its own running size, so it steps it by up to about lr in a direction the round-off picks:
two correct runs end up as much as 2 x lr apart per element, which a tolerance made from the
parameter's size (the dtype table's above all) calls a bug. From the next step on, the module that adds
such a bias gives outputs that differ by exactly the two biases' difference, until the softmax drops it.

Both are shown from the traces, never assumed:
- An element's gradient is *undetermined* when the reference's is within its gradient row's tolerance of
  zero (abs + rel x the gradient's RMS) and the two runs' differ there by at least half of it: its sign is
  round-off's. A post-step parameter whose values fail, whose gradient rows
  all passed up to this step and whose previous post-step value passed, is judged again with
  2 x (sum of the recorded learning rates) per undetermined element added to its absolute tolerance
  (`RoundoffStepTolerances`), without structure tests: the update's direction is round-off's.
- A forward output that fails, of a module whose bias was accepted that way at an earlier step, is
  compared again after the two runs' biases' difference (as the forward added them, before this step)
  is taken out of the candidate's output along its last dim; the tolerance is the row's own.

Only a failure of the norm test alone is judged again: a failing structure test (an update skipped on one
shard, a bias added on every TP rank) names a transform round-off does not make, and stands.
What it costs: a bug that moves only undetermined elements, by less than 2 x lr each, is not seen there;
a bug in the optimizer also moves the elements whose gradient is not round-off, where it still shows.
Replica drift is never relaxed: replicas reduce the same gradient, so they must agree. Without a
recorded learning rate (an optimizer ttrace does not see) nothing is relaxed. Not covered: a consumer
of such a module's output other than the module itself (an attention's recorded key input) still
differs by the bias; the perturbation estimate (`ttrace estimate`) measures that.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ttrace_core.canonicalize.logical_value import logical_value
from ttrace_core.compare.module_bias import bias_before
from ttrace_core.compare.results import ComparisonStatus, TensorComparison, Tolerance
from ttrace_core.errors import TtraceError
from ttrace_core.format.naming import GRADIENT_CLIPPING, LEARNING_RATE_SLOT, parameter_of
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey

STEPS_APART = 2.0
"""Each run's step of an undetermined element is at most about lr, in a direction of its own."""
UNDETERMINED = 0.5
"""An element's gradient is round-off where the runs differ by at least this share of the reference's."""
SEEN_PHASES = frozenset(("grad", "param"))
"""The phases of the rows `RoundoffSteps.seen` keeps (the engine calls it only for those: it sees every row)."""
_KEPT_SLOTS = frozenset(("grad", "value"))


@dataclass(frozen=True, slots=True)
class RoundoffStepTolerances:
    """A row's own tolerance plus `extra` per element, and no structure tests (the update's direction is
    round-off's): the provider a post-step parameter is judged again under."""

    own: Tolerance
    extra: float
    why: str

    def tolerance_for(self, key: TensorKey, dtype: str) -> Tolerance:
        own = self.own
        return dataclasses.replace(own, abs=own.abs + self.extra, params=(*own.params, ("roundoff_step", self.extra)),
                                   drift_rel=own.rel if own.drift_rel is None else own.drift_rel,
                                   source=f"{own.source}, + {self.extra:.3g} per element: {self.why}")

    def structure_tolerances(self, key: TensorKey, dtype: str, shape: tuple[int, ...],
                             update_to_value: float | None = None) -> dict[str, float]:
        return {}


def failing_by_value(row: TensorComparison) -> bool:
    """A row that failed its norm test alone: not its replicas', not a structure test (a transform round-off
    does not make, such as an update skipped on one shard or a bias added twice, stands)."""
    return row.status == ComparisonStatus.MISMATCH and row.decided_by == "mismatch" and (row.drift_ratio or 0.0) <= 1 \
        and not any(test.ratio > 1 for test in row.structure)


@dataclass(slots=True)
class RoundoffSteps:
    """What a comparison has seen so far of parameters' gradients and post-step values (rows come in execution
    order: a step's gradients before its post-step values, those before the next step's forward), and the
    rows to judge again."""

    reference: RunReader
    candidate: RunReader
    rows: dict[tuple[str, int, str], TensorComparison] = field(default_factory=dict)
    """(phase, step, fqn) -> the row of each parameter gradient and post-step value seen so far."""
    accepted: dict[str, int] = field(default_factory=dict)
    """Parameter -> the first step its post-step value passed under `allowance`."""
    relaxed: list[TensorKey] = field(default_factory=list)
    """Post-step parameters that passed under `allowance`."""
    shifted: list[TensorKey] = field(default_factory=list)
    """Forward outputs that passed with `bias_shift` taken out."""
    _lrs: dict[int, float | None] = field(default_factory=dict)
    _undetermined: dict[tuple[int, str], torch.Tensor | None] = field(default_factory=dict)

    def seen(self, row: TensorComparison) -> None:
        """Called with every row of SEEN_PHASES, in order (as little as possible: the many rows of a model)."""
        key = row.key
        if key.slot in _KEPT_SLOTS:
            self.rows[(key.phase, key.step, key.fqn)] = row

    def accept(self, row: TensorComparison) -> None:
        """A row that passed once judged again (`allowance`, `bias_shift`)."""
        if row.key.phase == "param":
            self.relaxed.append(row.key)
            self.accepted.setdefault(row.key.fqn, row.key.step)
        else:
            self.shifted.append(row.key)

    def _passed(self, phase: str, step: int, fqn: str) -> bool | None:
        row = self.rows.get((phase, step, fqn))
        return None if row is None else row.passed

    def allowance(self, row: TensorComparison) -> RoundoffStepTolerances | None:
        """The tolerances to judge a failing post-step parameter again under, when its gradient has undetermined
        elements (module docstring); else None."""
        key = row.key
        if key.phase != "param" or key.slot != "value" or not failing_by_value(row) or not row.numel:
            return None
        steps = [step for step in range(key.step + 1) if ("grad", step, key.fqn) in self.rows]
        if key.step not in steps or not all(self._passed("grad", step, key.fqn) for step in steps) \
                or self._passed("param", key.step - 1, key.fqn) is False:
            return None
        lrs = [self.learning_rate(step) for step in steps]
        masks = [self.undetermined(step, key.fqn) for step in steps]
        if any(lr is None for lr in lrs) or any(mask is None or mask.shape != masks[0].shape for mask in masks):
            return None
        undetermined = int(torch.stack(masks).any(dim=0).sum())
        if not undetermined:
            return None
        extra = STEPS_APART * sum(lrs) * math.sqrt(undetermined / row.numel)
        return RoundoffStepTolerances(row.tolerance, extra, why=(
            f"{STEPS_APART:g} x lr on the {undetermined} elements whose gradient is round-off (the runs' gradients "
            f"differ there by at least {UNDETERMINED:.0%} of it), which an adaptive optimizer steps by up to lr "
            "in a direction of its own"))

    def bias_shift(self, row: TensorComparison) -> torch.Tensor | None:
        """For a failing forward output of a module whose bias was accepted under `allowance` at an earlier step: the
        candidate's bias minus the reference's as this step's forward added them (flat float64); else None."""
        key = row.key
        if key.phase != "forward" or not key.slot.startswith("output") or not failing_by_value(row):
            return None
        bias = parameter_of(key.fqn, "bias")
        if self.accepted.get(bias, key.step) >= key.step:
            return None
        mine, theirs = bias_before(self.candidate, key.step, bias), bias_before(self.reference, key.step, bias)
        if mine is None or theirs is None or mine.shape != theirs.shape:
            return None
        return (mine - theirs).reshape(-1)

    def learning_rate(self, step: int) -> float | None:
        """The reference's recorded learning rate of `step` (finite and positive), or None."""
        if step not in self._lrs:
            self._lrs[step] = _recorded_lr(self.reference, step)
        return self._lrs[step]

    def undetermined(self, step: int, fqn: str) -> torch.Tensor | None:
        """Where the reference's gradient of `fqn` at `step` is within its row's tolerance per element of zero
        and the candidate's differs from it by at least UNDETERMINED of it (a flat bool tensor), or None when
        either is unreadable or not finite."""
        gradient = self.rows.get(("grad", step, fqn))
        if gradient is None or not gradient.passed or gradient.tolerance is None or not gradient.numel \
                or gradient.reference_norm is None:
            return None
        noise = gradient.tolerance.abs + gradient.tolerance.rel * gradient.reference_norm / math.sqrt(gradient.numel)
        if (step, fqn) not in self._undetermined:
            key = TensorKey(step=step, micro_batch=NO_MICRO_BATCH, phase="grad", fqn=fqn, slot="grad")
            found = None
            try:
                mine, theirs = (_values(reader, key) for reader in (self.candidate, self.reference))
                if mine is not None and theirs is not None and mine.shape == theirs.shape:
                    apart = (mine - theirs).abs()
                    size = theirs.abs()
                    found = (apart > 0) & (apart >= UNDETERMINED * size) & (size <= noise)
            except TtraceError:
                found = None
            self._undetermined[(step, fqn)] = found
        return self._undetermined[(step, fqn)]

    def notes(self) -> list[str]:
        """What the comparison says of the rows judged again (module docstring)."""
        said = []
        if self.relaxed:
            said.append(f"{len(self.relaxed)} post-step parameters with gradient elements that are round-off (e.g. "
                        f"{self.relaxed[0]}) were judged with 2 x lr on those elements: an adaptive optimizer steps "
                        "them by up to lr in a direction the round-off picks (docs/tolerances.md)")
        if self.shifted:
            said.append(f"{len(self.shifted)} forward outputs (e.g. {self.shifted[0]}) were compared after taking out "
                        "the difference of their module's bias, accepted as such a step (docs/tolerances.md)")
        return said


def _values(reader: RunReader, key: TensorKey) -> torch.Tensor | None:
    """`key`'s logical values, flat, when recorded with values and finite."""
    metas = reader.index.get(key)
    if not metas or metas[0].stats_only:
        return None
    values = logical_value(reader, key).reshape(-1)
    return values if bool(torch.isfinite(values).all()) else None


def _recorded_lr(reader: RunReader, step: int) -> float | None:
    key = TensorKey(step=step, micro_batch=NO_MICRO_BATCH, phase="step", fqn=GRADIENT_CLIPPING, slot=LEARNING_RATE_SLOT)
    try:
        values = _values(reader, key)
    except TtraceError:
        return None
    if values is None or values.numel() != 1:
        return None
    lr = float(values[0])
    return lr if lr > 0 else None
