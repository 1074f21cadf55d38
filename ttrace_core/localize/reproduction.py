"""Does a rewriting replay reproduce the candidate it replays? Checked before localize blames anything.

A replay feeds every module the reference's values. Where the candidate's own recorded values
were already bitwise the reference's (every source of a tensor exact, the rule of compare/exact_inputs.py),
rewriting changes nothing, so the replay must compute exactly what the candidate recorded. If it
does not, the replay is not running the candidate's code in the candidate's environment (a patch
left out, another library version, another thread count), and its verdicts would be about some
other program: localize then blames nothing and prints the environment differences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ttrace_core.compare.engine import RunComparison, compare_tensor
from ttrace_core.compare.exact_inputs import ExactInputs
from ttrace_core.compare.results import ComparisonStatus
from ttrace_core.format.fingerprint import environment_fingerprint, fingerprint_differences
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.tolerances import DEFAULT_EXACT_INPUTS_K, DtypeTolerances, Tolerance, exact_inputs_tolerance

MAX_LISTED = 5


@dataclass(kw_only=True, slots=True)
class Reproduction:
    reproduced: bool | None
    """None when no tensor could be checked (no module of the candidate had exact inputs)."""
    num_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    """"<tensor>: ratio r" of the first tensors that the replay did not reproduce."""
    differences: list[str] = field(default_factory=list)
    """Environment differences between the candidate's recording and the replay."""


@dataclass(frozen=True, slots=True)
class _OwnArithmetic:
    """The tolerance of a tensor computed twice from the same exact inputs: k * sqrt(world size) * eps."""

    precision: str
    world_size: int

    def tolerance_for(self, key, dtype: str) -> Tolerance:
        base = DtypeTolerances(precision=self.precision).tolerance_for(key, dtype)
        return exact_inputs_tolerance(base, self.precision, dtype, DEFAULT_EXACT_INPUTS_K, self.world_size)


def reproducible_keys(original: RunComparison, step: int) -> list:
    """The candidate's tensors of `step` whose every source was exact: a faithful replay recomputes them bitwise."""
    exact = ExactInputs(c.key for c in original.comparisons)
    for c in original.comparisons:
        exact.mark(c.key, c.exact)
    return [c.key for c in original.comparisons if c.key.step == step and exact.applies(c.key)]


def _sources_compared(keys: list, original: RunComparison, candidate: RunReader, step: int) -> list:
    """`keys` without those computed from a tensor the candidate recorded but the comparison did not hold (a
    reference of another implementation has no counterpart for it, docs/porting.md): exact or not, unknown."""
    compared = {c.key for c in original.comparisons}
    uncompared = [k for k in candidate.index if k.step == step and k.phase in ("forward", "backward") and k not in compared]
    if not uncompared:
        return keys
    exact = ExactInputs([*compared, *uncompared])
    for c in original.comparisons:
        exact.mark(c.key, c.exact)
    return [key for key in keys if exact.applies(key)]


def check_reproduction(original: RunComparison, candidate: RunReader, replay: RunReader, step: int) -> Reproduction:
    keys = [key for key in reproducible_keys(original, step) if key in candidate.index and key in replay.index]
    keys = _sources_compared(keys, original, candidate, step)
    tolerances = _OwnArithmetic(candidate.manifest.precision, candidate.manifest.world_size)
    mismatches = []
    for key in keys:
        result = compare_tensor(key, candidate, replay, tolerances)
        if not result and not (result.status == ComparisonStatus.REPLICA_DRIFT
                               and _same_shards(key, candidate, replay, tolerances)):
            ratio = "-" if result.ratio is None else f"{result.ratio:.3g}"
            mismatches.append(f"{key}: ratio {ratio} ({result.status})")
    differences = fingerprint_differences(candidate.manifest.environment, replay.manifest.environment or
                                          environment_fingerprint(candidate.manifest.world_size))
    return Reproduction(reproduced=None if not keys else not mismatches, num_checked=len(keys),
                        mismatches=mismatches[:MAX_LISTED], differences=differences)


def _same_shards(key, candidate: RunReader, replay: RunReader, tolerances: _OwnArithmetic) -> bool:
    """Whether the replay holds every rank's copy of `key` as the candidate recorded it. A candidate whose
    replicas disagree (an unreduced gradient: the bug itself) makes the replay's disagree the same way:
    that is the candidate reproduced, not a difference, so it is judged copy by copy."""
    replayed = {meta.rank: meta for meta in replay.index[key]}
    recorded = candidate.index[key]
    if {meta.rank for meta in recorded} != set(replayed):
        return False
    for meta in recorded:
        if meta.stats_only or replayed[meta.rank].stats_only:
            return False
        ours, theirs = candidate.read(meta).double(), replay.read(replayed[meta.rank]).double()
        if ours.shape != theirs.shape:
            return False
        allowed = tolerances.tolerance_for(key, meta.dtype).rel * float(ours.norm())
        if float((ours - theirs).norm()) > allowed:
            return False
    return True
