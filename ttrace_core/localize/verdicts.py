"""Stage 4 of record -> canonicalize -> compare -> localize -> render: name the module or reduction at fault.

Input: the candidate's comparison with the reference, and the comparison of its replay: the candidate
relaunched with input rewriting on (workflows/localize.py, record/rewrite.py), where every traced module
computes from the reference's inputs and output gradients while the trace keeps each module's own
values. Output: a `Localization`, with one verdict per module, the culprits, their evidence
(ratios before and after rewriting), the bug class and the command that reproduces the replay.

How the replay is read, per step and micro-batch in execution order:
- an output (forward) or grad_input (backward) that fails: the module was wrong on correct inputs;
- an input or grad_output that fails while nothing earlier in that micro-batch failed: the code
  between modules broke it, i.e. the parent's glue (or, with no traced parent, the code outside
  every traced module, such as the schedule, named by the recorded tensors on both sides of it:
  "between final_norm (backward grad_input.0) and layers.3 (backward grad_output.0)");
- the loss function (pseudo-module format.naming LOSS_FUNCTION) when the error appears between the
  model's last forward output and its backward: its recorded loss fails, or the first gradient of
  the backward does (an older trace records no loss), while the forward output the loss is computed
  from (the micro-batch's last forward tensor) passes; when that output fails, they inherit it. A
  replay cannot feed the loss the reference's inputs and needs not: the candidate's own comparison
  names it (the verdict's `detail` says so);
- a culprit is a module that introduces error while none of its descendants does; its ancestors
  inherit the error.
Only the first step that diverges is judged: later steps start from parameters the bug already
changed. Then, when no module explains them: a parameter gradient that fails is explained by the
gradient its module received when that grad_output (or an input) already fails, or when the module
is traced forward-only (tracer config `forward_only`: no backward hook, so its grad_output recorded
by tensor hooks is not rewritten) and the loss it takes its gradient from is the culprit; else a
reduced gradient that fails is a gradient-sync bug (its replicas disagree along the mesh axis of the
missing reduction, or it is off by a constant factor, a scaling bug) or the module's own weight
gradient. A step scalar of the gradient norm / clipping (GRADIENT_CLIPPING) that fails while every
gradient passes names it, and explains the updated parameters; an updated parameter that fails while
its gradient and the clipping pass is the optimizer's.
"""

from __future__ import annotations

import fnmatch
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ttrace_core.canonicalize.logical_value import logical_value
from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.compare.results import (
    STRUCTURAL_STATUSES as STRUCTURAL, ComparisonStatus, RunComparison, TensorComparison,
)
from ttrace_core.format.naming import (
    DATA_PARALLEL_AXES, GRADIENT_CLIPPING, LEARNING_RATE_SLOT, LOSS_FUNCTION, PSEUDO_MODULES, data_parallel_degree, in_subtree, is_descendant,
    module_of, owner_of, slot_family,
)
from ttrace_core.format import strict_json
from ttrace_core.format.records import data_from_json, data_from_record, record_from_data
from ttrace_core.format.schema import RunManifest, TensorKey
from ttrace_core.format.reader import RunReader

# A gradient off from the reference by a constant factor (and nothing else) is a scaling bug.
PURE_SCALE_RESIDUAL = 1e-3
"""The step scalar of the learning-rate schedule: a wrong one is the optimizer step's, not the clipping's."""


@dataclass(kw_only=True, slots=True)
class Evidence:
    key: str
    ratio_before: float | None
    """Ratio (error / tolerance) in the plain comparison."""
    ratio_after: float | None
    """Ratio in the rewriting replay."""
    status: str


@dataclass(kw_only=True, slots=True)
class ModuleVerdict:
    fqn: str
    verdict: str
    """"introduces error", "inherits error" or "clean"."""
    phase: str = ""
    """Where a culprit's error shows: "forward", "backward", "forward glue", "backward glue",
    "backward (weight gradient)", or "step" (the gradient norm / clipping)."""
    evidence: list[Evidence] = field(default_factory=list)
    detail: str = ""
    """What names a culprit the replay cannot rewrite (the loss function), in words."""


@dataclass(kw_only=True, slots=True)
class SyncFinding:
    params: list[str]
    reduction: str
    """"TP", "TP (sequence parallel)", "DP", "PP-embedding", "EP", "optimizer", or "unknown"."""
    bug_class: str
    """"gradient-sync", "scaling" or "optimizer"."""
    detail: str
    evidence: list[Evidence] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Localization:
    reference: str
    candidate: str
    replay: str | None
    diverged: bool
    culprits: list[str] = field(default_factory=list)
    """Module fqns (execution order; a pseudo-module by its name, "the loss function"), then
    "params ... (reduction)" for sync findings."""
    bug_class: str = ""
    modules: list[ModuleVerdict] = field(default_factory=list)
    sync: list[SyncFinding] = field(default_factory=list)
    command: str = ""
    notes: list[str] = field(default_factory=list)
    replay_scope: str = ""
    """"module alone" (only the module ran, module_replay.py), "whole model", or "reused"."""
    reproduction: dict | None = None
    """reproduction.Reproduction as a dict: whether the replay recomputed the candidate's exact-input tensors."""
    original_failed: bool = False
    """The plain comparison failed though no tensor diverged (its evidence is incomplete, or the reference
    did not train): localize then exits as `ttrace compare` does."""

    def __bool__(self) -> bool:
        """True when nothing is at fault."""
        return not self.culprits

    @property
    def reproduced(self) -> bool | None:
        return None if self.reproduction is None else self.reproduction["reproduced"]

    @property
    def exit_code(self) -> int:
        """0 no divergence, 1 culprit named (or, as `ttrace compare`, no divergence but incomplete evidence),
        4 diverged but not explained (or the replay does not reproduce)."""
        if not self.diverged:
            return 1 if self.original_failed else 0
        return 1 if self.culprits and self.reproduced is not False else 4

    def to_json(self) -> str:
        return strict_json.dumps(data_from_record(self), indent=1)  # a NaN or infinite ratio is written as null

    @staticmethod
    def from_json(text: str, where: str = "localization result") -> Localization:
        """Every field's type checked; TraceFormatError naming `where` if the text is not a localization."""
        data = data_from_json(text, where, "localization result", "run the replay again")
        return record_from_data(data, Localization, where, "localization result", "run the replay again")


def _evidence(key: TensorKey, before: dict[TensorKey, TensorComparison], after: TensorComparison) -> Evidence:
    original = before.get(key)
    return Evidence(key=str(key), ratio_before=original.ratio if original is not None else None, ratio_after=after.ratio,
                    status=after.status)


def _tensor_text(key: TensorKey) -> str:
    return f"{key.fqn or 'the model'} ({key.phase} {key.slot})"


def glue_between(comparisons: list[TensorComparison], position: int) -> str:
    """The code that produced the tensor at `position` when no traced module holds that code (the
    model's own forward, the schedule, a module that hands back a function): named by the nearest
    recorded tensors on both sides of it, the last one of the same micro-batch recorded before it
    from another module and the tensor itself, never as the model root."""
    after = comparisons[position].key
    previous = next((c.key for c in reversed(comparisons[:position])
                     if c.key.step == after.step and c.key.micro_batch == after.micro_batch
                     and c.key.phase in ("forward", "backward") and (c.key.fqn, c.key.phase) != (after.fqn, after.phase)),
                    None)
    start = _tensor_text(previous) if previous else "the micro-batch's data"
    return f"between {start} and {_tensor_text(after)}"


def _earlier_in_micro_batch(comparisons: list[TensorComparison], position: int) -> list[TensorComparison]:
    key = comparisons[position].key
    return [c for c in comparisons[:position] if (c.key.step, c.key.micro_batch) == (key.step, key.micro_batch)]


def _starts_backward(comparisons: list[TensorComparison], position: int) -> bool:
    """The tensor at `position` is the loss, or the first gradient of its micro-batch's backward: what the
    loss function computes from the model's last forward output (forward sorts before backward)."""
    key = comparisons[position].key
    return key.fqn == LOSS_FUNCTION or (key.phase == "backward" and not any(
        c.key.phase == "backward" for c in _earlier_in_micro_batch(comparisons, position)))


def _loss_source(comparisons: list[TensorComparison], position: int) -> TensorComparison | None:
    """The forward output the loss before `position` is computed from: its micro-batch's last forward tensor."""
    return next((c for c in reversed(_earlier_in_micro_batch(comparisons, position))
                 if c.key.phase == "forward" and c.key.fqn != LOSS_FUNCTION), None)


def _ratio_text(c: TensorComparison) -> str:
    return f"ratio {c.ratio:.3g}" if c.ratio is not None else c.status


def _loss_evidence(comparisons: list[TensorComparison], position: int,
                   before: dict[TensorKey, TensorComparison]) -> tuple[str, list[Evidence]]:
    """(detail, evidence) of the loss function, from the candidate's own comparison: its loss (or, not
    recorded, the first gradient of the backward) fails while the last forward output, which the loss is
    computed from, passes. A replay cannot feed the loss the reference's inputs, and needs not."""
    first, source = comparisons[position], _loss_source(comparisons, position)
    loss = next((c for c in _earlier_in_micro_batch(comparisons, position) if c.key.fqn == LOSS_FUNCTION), None)
    first_ratio = _ratio_text(before.get(first.key, first))
    gradient = f"{_tensor_text(first.key)}, fails ({first_ratio})"
    if first.key.fqn == LOSS_FUNCTION:
        failing = f"the loss ({first.key.slot}) fails ({first_ratio})"
    elif loss is None:
        failing = f"no loss is recorded and the backward's first gradient, {gradient}"
    else:
        failing = f"the loss passes but the gradient it starts the backward with, {gradient}"
    why = "A replay cannot rewrite the loss's inputs (it is no traced module), and this evidence needs none."
    if source is None:
        return f"in the candidate's comparison {failing}, before any forward tensor of its micro-batch. {why}", []
    source_ratio = _ratio_text(before.get(source.key, source))
    passing = f"{_tensor_text(source.key)}, which the loss is computed from, passes ({source_ratio})"
    return (f"in the candidate's comparison {failing} while {passing}: the error arises in the loss function. {why}",
            [_evidence(source.key, before, source)])


@dataclass(kw_only=True, slots=True)
class _Suspect:
    phase: str
    position: int
    """Where its first failing tensor sits in the replay's execution order."""
    evidence: list[Evidence] = field(default_factory=list)
    detail: str = ""


def _unfed(fqn: str, phase: str, unfed: frozenset[str]) -> bool:
    """Whether the replay could not feed `fqn` all of the reference's values its `phase` computes from: a
    forward input (the backward reuses them too), or in backward an output gradient (InputRewriter.unfed)."""
    prefixes = (f"forward/{fqn}/input.",) + ((f"backward/{fqn}/grad_output.",) if phase == "backward" else ())
    return any(name.startswith(prefixes) for name in unfed)


def _fed_owner(fqn: str, phase: str, unfed: frozenset[str], traced: set[str]) -> str | None:
    """The module a failure of `fqn` is evidence against: `fqn` when the replay fed it, else its nearest traced
    ancestor that was fed (the error entered somewhere inside that ancestor, between its fed inputs and this
    output); None when no ancestor was."""
    while fqn:
        if fqn in traced and not _unfed(fqn, phase, unfed):
            return fqn
        fqn = owner_of(fqn)
    return None


def _module_suspects(replay: RunComparison, before: dict, traced: set[str], root: str | None,
                     unfed: frozenset[str] = frozenset()) -> dict[str, _Suspect]:
    """fqn -> the phase, position and evidence of every module the replay says introduced an error.
    With a `root` (a one-module replay) that module's own inputs and output gradients come from
    unrewritten code outside it: they are not evidence, and the loss lies outside. Glue that no
    traced module owns is named by its neighbours (`glue_between`), the loss function by its own name.
    `unfed`: inputs the replay could not feed the reference's values (a reference of another
    implementation has none for them): a module computing from one is not judged on its own, its
    failure is its nearest fed ancestor's."""
    suspects: dict[str, _Suspect] = {}
    failed_scopes: set[tuple] = set()
    for position, c in enumerate(replay.comparisons):
        if c or c.key.phase not in ("forward", "backward") or c.status in STRUCTURAL:
            continue
        scope = (c.key.step, c.key.phase, c.key.micro_batch)
        if slot_family(c.key.slot) in ("output", "grad_input"):
            fqn, phase = c.key.fqn, c.key.phase
            if unfed and (owner := _fed_owner(fqn, phase, unfed, traced)) != fqn:
                fqn = owner or glue_between(replay.comparisons, position)
        elif scope in failed_scopes or c.key.fqn == root:
            continue  # an input broken by an earlier failure in the same micro-batch, or from outside the replay
        elif not root and _starts_backward(replay.comparisons, position):
            source = _loss_source(replay.comparisons, position)
            if source is not None and not source and source.status not in STRUCTURAL:
                failed_scopes.add(scope)
                continue  # the loss computed from a forward output that already fails
            fqn, phase = LOSS_FUNCTION, c.key.phase
        else:
            parent = owner_of(c.key.fqn)
            fqn = parent if parent and parent in traced else glue_between(replay.comparisons, position)
            phase = f"{c.key.phase} glue"
        failed_scopes.add(scope)
        suspect = suspects.get(fqn)
        if suspect is None:
            suspect = suspects[fqn] = _Suspect(phase=phase, position=position)
            if fqn == LOSS_FUNCTION:
                suspect.detail, suspect.evidence = _loss_evidence(replay.comparisons, position, before)
        if len(suspect.evidence) < 5:
            suspect.evidence.append(_evidence(c.key, before, c))
    return suspects


def module_verdicts(original: RunComparison, replay: RunComparison, root: str | None = None,
                    unfed: frozenset[str] = frozenset()) -> list[ModuleVerdict]:
    before = {c.key: c for c in original.comparisons}
    traced = {c.key.fqn for c in replay.comparisons if c.key.phase in ("forward", "backward")}
    suspects = _module_suspects(replay, before, traced, root, unfed)
    failing_before = {c.key.fqn for c in original.comparisons if not c and c.key.phase in ("forward", "backward")}
    verdicts = []
    for fqn in sorted(traced | set(suspects), key=lambda f: _first_position(replay, f, suspects.get(f))):
        if fqn in suspects and not any(is_descendant(other, fqn) for other in suspects):
            suspect = suspects[fqn]
            verdicts.append(ModuleVerdict(fqn=fqn, verdict="introduces error", phase=suspect.phase,
                                          evidence=suspect.evidence, detail=suspect.detail))
        elif fqn in suspects or fqn in failing_before:
            verdicts.append(ModuleVerdict(fqn=fqn, verdict="inherits error"))
        else:
            verdicts.append(ModuleVerdict(fqn=fqn, verdict="clean"))
    return verdicts


def _first_position(replay: RunComparison, fqn: str, suspect: _Suspect | None) -> int:
    """Where a module first shows in the replay: its first tensor, or a suspect's first failure (glue,
    and a loss function that is not recorded, have no tensor of their own)."""
    recorded = next((i for i, c in enumerate(replay.comparisons) if c.key.fqn == fqn), len(replay.comparisons))
    return min(recorded, suspect.position) if suspect else recorded


def _drift_axes(drift: ReplicaDrift | None, manifest: RunManifest) -> list[str]:
    ranks = list(drift.ranks) if drift is not None else []
    if len(ranks) < 2 or not manifest.rank_coordinates:
        return []
    first, second = (manifest.rank_coordinates[r] for r in ranks[:2])
    return [name for name, a, b in zip(manifest.mesh_axis_names, first, second) if a != b]


def _reduction_name(axes: list[str], manifest: RunManifest) -> str:
    if "pp" in axes:
        return "PP-embedding"
    if "tp" in axes:
        return "TP (sequence parallel)" if manifest.degrees.get("sp") else "TP"
    if "ep" in axes:
        return "EP"
    return "DP" if any(axis in DATA_PARALLEL_AXES for axis in axes) else "unknown"


def _scale_factor(reference: RunReader, replay: RunReader, key: TensorKey) -> tuple[float, float]:
    """(s, residual): candidate ~ s * reference, residual = ||a - s e|| / ||a||."""
    actual, expected = logical_value(replay, key), logical_value(reference, key)
    denominator = float((expected * expected).sum())
    if denominator == 0:
        return math.nan, math.inf
    s = float((actual * expected).sum()) / denominator
    norm = float(torch.linalg.vector_norm(actual))
    return s, (float(torch.linalg.vector_norm(actual - s * expected)) / norm if norm else math.inf)


def _classify_gradient(c: TensorComparison, reference: RunReader, replay: RunReader, manifest: RunManifest) -> tuple[str, str, str]:
    """(reduction, bug class, detail) of one failing reduced gradient; reduction "" = the module's own wgrad."""
    if c.status == ComparisonStatus.REPLICA_DRIFT or c.replica_drift is not None:
        axes = _drift_axes(c.replica_drift, manifest)
        if axes:
            return _reduction_name(axes, manifest), "gradient-sync", f"replicas differ along {'/'.join(axes)}"
    s, residual = _scale_factor(reference, replay, c.key)
    data_parallel = max(data_parallel_degree(manifest.degrees), manifest.degrees.get("ep", 1))
    # Pure scaling: once divided by the factor, the gradient would pass its own tolerance.
    if residual < max(PURE_SCALE_RESIDUAL, c.tolerance.rel if c.tolerance else 0.0) and data_parallel > 1:
        reduction = "EP" if ".experts." in c.key.fqn and manifest.degrees.get("ep", 1) > 1 else "DP"
        return reduction, "scaling", f"off by a constant factor {s:.4g}"
    return "", "backward", f"weight gradient wrong (factor {s:.3g}, residual {residual:.2g})"


def _forward_only(manifest: RunManifest, fqn: str) -> bool:
    """Traced with no backward hook (manifest.tracer "forward_only"): nothing rewrites its grad_output."""
    return any(fnmatch.fnmatchcase(fqn, glob) for glob in manifest.tracer.get("forward_only") or ())


def _fed_failing_gradients(replay: RunComparison, manifest: RunManifest, loss_blamed: bool,
                           root: str | None) -> set[str]:
    """Modules whose parameter gradients the gradient they received explains: a grad_output or an input
    of theirs already fails in the replay; or, forward-only with no grad_output recorded, they take the
    gradient that the loss function, a culprit, starts the backward with. A one-module replay's root
    computes from the reference's inputs, and from its output gradient unless forward-only: what it
    recorded before the rewrite came from outside the replay, and explains nothing."""
    received: dict[str, list[TensorComparison]] = defaultdict(list)
    for c in replay.comparisons:
        family = slot_family(c.key.slot)
        if (c.key.phase, family) not in (("forward", "input"), ("backward", "grad_output")):
            continue
        if c.key.fqn != root or (family == "grad_output" and _forward_only(manifest, root)):
            received[c.key.fqn].append(c)
    fed = {fqn for fqn, tensors in received.items() if any(not c and c.status not in STRUCTURAL for c in tensors)}
    if loss_blamed:
        fed |= {fqn for fqn, tensors in received.items()
                if _forward_only(manifest, fqn) and not any(c.key.phase == "backward" for c in tensors)}
    return fed


def _failing_clipping_scalars(replay: RunComparison) -> list[TensorComparison]:
    """The gradient norm / clipping's scalars that fail, the learning rate aside."""
    return [c for c in replay.comparisons if c.key.fqn == GRADIENT_CLIPPING and c.key.slot != LEARNING_RATE_SLOT
            and not c and c.status not in STRUCTURAL]


def clipping_verdict(original: RunComparison, replay: RunComparison) -> ModuleVerdict | None:
    """The gradient norm / clipping when one of its scalars fails: it introduces the error when every
    parameter gradient passes (it computed the norm, the coefficient or the skip from right gradients),
    else it inherits it from them. None when its scalars pass or are not recorded."""
    failing = _failing_clipping_scalars(replay)
    if not failing:
        return None
    if not all(c for c in replay.comparisons if c.key.phase == "grad"):
        return ModuleVerdict(fqn=GRADIENT_CLIPPING, verdict="inherits error")
    before = {c.key: c for c in original.comparisons}
    return ModuleVerdict(fqn=GRADIENT_CLIPPING, verdict="introduces error", phase="step",
                         evidence=[_evidence(c.key, before, c) for c in failing[:5]])


def sync_findings(original: RunComparison, replay: RunComparison, reference: RunReader, replay_reader: RunReader,
                  manifest: RunManifest, module_culprits: list[str],
                  root: str | None = None) -> tuple[list[SyncFinding], list[ModuleVerdict]]:
    """Failing reduced gradients and updated parameters that no module culprit, no gradient a module
    received and no clipping scalar explains: (sync findings, weight-gradient culprits). `root`: the
    module a one-module replay ran."""
    before = {c.key: c for c in original.comparisons}
    groups: dict[tuple[str, str, str], SyncFinding] = {}
    wgrad: dict[str, ModuleVerdict] = {}
    failing_grads = {c.key.fqn for c in replay.comparisons if c.key.phase == "grad" and not c}
    fed_failing = _fed_failing_gradients(replay, manifest, LOSS_FUNCTION in module_culprits, root)
    clipping_fails = bool(_failing_clipping_scalars(replay))
    for c in replay.comparisons:
        if c or c.key.phase not in ("grad", "param") or c.status in STRUCTURAL:
            continue
        if any(is_descendant(c.key.fqn, m) for m in module_culprits):
            continue
        if c.key.phase == "param":
            if c.key.fqn in failing_grads or clipping_fails:
                continue  # a wrong gradient or clip coefficient gives a wrong update: reported there
            reduction, bug_class, detail = "optimizer", "optimizer", "updated parameter wrong while its gradient passes"
        elif owner_of(c.key.fqn) in fed_failing:
            continue  # computed from a gradient that was already wrong when the module received it
        else:
            reduction, bug_class, detail = _classify_gradient(c, reference, replay_reader, manifest)
        if not reduction:
            owner = owner_of(c.key.fqn) or c.key.fqn  # a parameter of the model root is named itself
            verdict = wgrad.setdefault(owner, ModuleVerdict(fqn=owner, verdict="introduces error",
                                                            phase="backward (weight gradient)"))
            verdict.evidence.append(_evidence(c.key, before, c))
            continue
        finding = groups.setdefault((reduction, bug_class, detail.split(" ")[0]),
                                    SyncFinding(params=[], reduction=reduction, bug_class=bug_class, detail=detail))
        finding.params.append(c.key.fqn)
        if len(finding.evidence) < 5:
            finding.evidence.append(_evidence(c.key, before, c))
    return list(groups.values()), list(wgrad.values())


def analyze(original: RunComparison, replay: RunComparison, reference: RunReader, replay_reader: RunReader,
            manifest: RunManifest, root: str | None = None, unfed: frozenset[str] = frozenset()) -> Localization:
    modules = module_verdicts(original, replay, root, unfed)
    introducing = [m.fqn for m in modules if m.verdict == "introduces error"]
    sync, wgrad_culprits = sync_findings(original, replay, reference, replay_reader, manifest, introducing, root)
    clipping = clipping_verdict(original, replay)
    modules += wgrad_culprits + ([clipping] if clipping else [])
    culprits = [PSEUDO_MODULES.get(m.fqn, m.fqn) for m in modules if m.verdict == "introduces error"]
    culprits += [f"{_summarize(s.params)} ({s.reduction})" for s in sync]
    first_class = next((m.phase for m in modules if m.verdict == "introduces error"), "")
    bug_class = first_class or (sync[0].bug_class + f": {sync[0].reduction}" if sync else "")
    return Localization(reference=original.reference, candidate=original.candidate, replay=replay.candidate,
                        diverged=True, culprits=culprits, bug_class=bug_class, modules=modules, sync=sync)


def _summarize(params: list[str]) -> str:
    return ", ".join(params) if len(params) <= 3 else f"{', '.join(params[:3])} and {len(params) - 3} more"


def can_replay_alone(original: RunComparison, module: str) -> bool:
    """A module run alone shows what it computes, never a gradient reduction or an optimizer step: so
    only when `module` is a recorded module and some activation of its subtree fails (reduced
    gradients that fail with no activation failing point at the reduction or the optimizer)."""
    if module in PSEUDO_MODULES:
        return False  # the loss and the clipping run outside every traced module: nothing to run alone
    in_module = [c for c in original.comparisons if in_subtree(module_of(c.key), module)]
    return any(c.key.fqn == module and c.key.phase == "forward" for c in in_module) and \
        any(not c and c.key.phase in ("forward", "backward") for c in in_module)
