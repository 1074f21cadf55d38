"""Stage 4 of record -> canonicalize -> compare -> localize -> render: name the module or reduction at fault.

Input: a reference and a candidate run directory. The candidate is relaunched from its manifest
(entrypoint factory and config) with input rewriting on (rewrite.py): every traced module computes
from the reference's inputs and output gradients, while the trace keeps each module's own
values. Output: a `Localization`, with one verdict per module, the culprits, their evidence
(ratios before and after rewriting), the bug class and the command that reproduces the replay.

How the replay is read, per step and micro-batch in execution order:
- an output (forward) or grad_input (backward) that fails: the module was wrong on correct inputs;
- an input or grad_output that fails while nothing earlier in that micro-batch failed: the code
  between modules broke it, i.e. the parent's glue (or, with no traced parent, the code outside
  every traced module, such as the loss and the schedule, named by the recorded tensors on both
  sides of it: "between output_layer (forward output.0) and output_layer (backward grad_output.0)");
- a culprit is a module that introduces error while none of its descendants does; its ancestors
  inherit the error.
Only the first step that diverges is judged: later steps start from parameters the bug already
changed. Then, when no module explains them: a reduced gradient that fails is a gradient-sync bug (its
replicas disagree along the mesh axis of the missing reduction, or it is off by a constant factor,
a scaling bug), and an updated parameter that fails while its gradient passes is the optimizer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
import os
import shlex
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ttrace_core.compare import RunComparison, TensorComparison, compare_runs, logical_value
from ttrace_core.dataflow import in_subtree, owner_of
from ttrace_core.errors import TtraceError
from ttrace_core.reproduction import check_reproduction
from ttrace_core.schema import RunManifest, TensorKey
from ttrace_core.store import RunReader, read_manifest
from ttrace_core.tolerances import select_tolerances

STRUCTURAL = ("missing", "extra", "shape", "dtype", "layout")
# A gradient off from the reference by a constant factor (and nothing else) is a scaling bug.
PURE_SCALE_RESIDUAL = 1e-3


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
    """Where a culprit's error shows: "forward", "backward", "forward glue", "backward glue"."""
    evidence: list[Evidence] = field(default_factory=list)


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
    """Module fqns (execution order), then "params ... (reduction)" for sync findings."""
    bug_class: str = ""
    modules: list[ModuleVerdict] = field(default_factory=list)
    sync: list[SyncFinding] = field(default_factory=list)
    command: str = ""
    notes: list[str] = field(default_factory=list)
    replay_scope: str = ""
    """"module alone" (only the module ran, module_replay.py), "whole model", or "reused"."""
    reproduction: dict | None = None
    """reproduction.Reproduction as a dict: whether the replay recomputed the candidate's exact-input tensors."""

    def __bool__(self) -> bool:
        """True when nothing is at fault."""
        return not self.culprits

    @property
    def reproduced(self) -> bool | None:
        return None if self.reproduction is None else self.reproduction["reproduced"]

    @property
    def exit_code(self) -> int:
        """0 no divergence, 1 culprit named, 4 diverged but not explained (or the replay does not reproduce)."""
        if not self.diverged:
            return 0
        return 1 if self.culprits and self.reproduced is not False else 4

    def to_json(self) -> str:
        from ttrace_core import strict_json  # strict JSON: a NaN or infinite ratio is written as null

        return strict_json.dumps(asdict(self), indent=1, default=str)

    @staticmethod
    def from_json(text: str, where: str = "localization result") -> Localization:
        """Every field's type checked; TraceFormatError naming `where` if the text is not a localization."""
        from ttrace_core.records import data_from_json, record_from_data

        data = data_from_json(text, where, "localization result", "run the replay again")
        return record_from_data(data, Localization, where, "localization result", "run the replay again")


def is_descendant(fqn: str, ancestor: str) -> bool:
    """Module nesting by name; glue named by its neighbours ("between ...") is nobody's ancestor."""
    return bool(ancestor) and fqn.startswith(ancestor + ".")


def _evidence(key: TensorKey, before: dict[TensorKey, TensorComparison], after: TensorComparison) -> Evidence:
    original = before.get(key)
    return Evidence(key=str(key), ratio_before=original.ratio if original is not None else None, ratio_after=after.ratio,
                    status=after.status)


def glue_between(comparisons: list[TensorComparison], position: int) -> str:
    """The code that produced the tensor at `position` when no traced module holds that code (the
    model's own forward, the loss, the schedule, a module that hands back a function): named by
    the nearest recorded tensors on both sides of it, the last one of the same micro-batch recorded
    before it from another module and the tensor itself, never as the model root."""
    after = comparisons[position].key
    previous = next((c.key for c in reversed(comparisons[:position])
                     if c.key.step == after.step and c.key.micro_batch == after.micro_batch
                     and c.key.phase in ("forward", "backward") and (c.key.fqn, c.key.phase) != (after.fqn, after.phase)),
                    None)
    start = f"{previous.fqn or 'the model'} ({previous.phase} {previous.slot})" if previous else "the micro-batch's data"
    return f"between {start} and {after.fqn or 'the model'} ({after.phase} {after.slot})"


def _module_suspects(replay: RunComparison, before: dict, traced: set[str],
                     root: str | None) -> dict[str, tuple[str, list[Evidence]]]:
    """fqn -> (phase, evidence) of every module the replay says introduced an error. With a `root`
    (a one-module replay) that module's own inputs and output gradients come from unrewritten code
    outside it: they are not evidence. Glue that no traced module owns is named by its neighbours
    (`glue_between`)."""
    suspects: dict[str, tuple[str, list[Evidence]]] = {}
    failed_scopes: set[tuple] = set()
    for position, c in enumerate(replay.comparisons):
        if c.key.phase not in ("forward", "backward") or c.status in STRUCTURAL:
            continue
        scope = (c.key.step, c.key.phase, c.key.micro_batch)
        family = c.key.slot.split(".", 1)[0]
        if c:
            continue
        if family in ("output", "grad_input"):
            fqn, phase = c.key.fqn, c.key.phase
        elif scope in failed_scopes or c.key.fqn == root:
            continue  # an input broken by an earlier failure in the same micro-batch, or from outside the replay
        else:
            parent = owner_of(c.key.fqn)
            fqn = parent if parent and parent in traced else glue_between(replay.comparisons, position)
            phase = f"{c.key.phase} glue"
        failed_scopes.add(scope)
        entry = suspects.setdefault(fqn, (phase, []))
        if len(entry[1]) < 5:
            entry[1].append(_evidence(c.key, before, c))
    return suspects


def module_verdicts(original: RunComparison, replay: RunComparison, root: str | None = None) -> list[ModuleVerdict]:
    before = {c.key: c for c in original.comparisons}
    traced = {c.key.fqn for c in replay.comparisons if c.key.phase in ("forward", "backward")}
    suspects = _module_suspects(replay, before, traced, root)
    failing_before = {c.key.fqn for c in original.comparisons if not c and c.key.phase in ("forward", "backward")}
    verdicts = []
    for fqn in sorted(traced | set(suspects), key=lambda f: _first_position(replay, f)):
        if fqn in suspects and not any(is_descendant(other, fqn) for other in suspects if other != fqn):
            phase, evidence = suspects[fqn]
            verdicts.append(ModuleVerdict(fqn=fqn, verdict="introduces error", phase=phase, evidence=evidence))
        elif fqn in suspects or fqn in failing_before:
            verdicts.append(ModuleVerdict(fqn=fqn, verdict="inherits error"))
        else:
            verdicts.append(ModuleVerdict(fqn=fqn, verdict="clean"))
    return verdicts


def _first_position(replay: RunComparison, fqn: str) -> int:
    return next((i for i, c in enumerate(replay.comparisons) if c.key.fqn == fqn), len(replay.comparisons))


def _drift_axes(drift: dict, manifest: RunManifest) -> list[str]:
    ranks = list(drift.get("ranks") or [])
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
    return "DP" if "dp" in axes or "fsdp" in axes else "unknown"


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
    if c.status == "replica_drift" or (c.replica_drift and c.replica_drift.get("relative_diff", 0) > 0):
        axes = _drift_axes(c.replica_drift or {}, manifest)
        if axes:
            return _reduction_name(axes, manifest), "gradient-sync", f"replicas differ along {'/'.join(axes)}"
    s, residual = _scale_factor(reference, replay, c.key)
    data_parallel = max(manifest.degrees.get("dp", 1), manifest.degrees.get("fsdp", 1), manifest.degrees.get("ep", 1))
    # Pure scaling: once divided by the factor, the gradient would pass its own tolerance.
    if residual < max(PURE_SCALE_RESIDUAL, c.tolerance.rel if c.tolerance else 0.0) and data_parallel > 1:
        reduction = "EP" if ".experts." in c.key.fqn and manifest.degrees.get("ep", 1) > 1 else "DP"
        return reduction, "scaling", f"off by a constant factor {s:.4g}"
    return "", "backward", f"weight gradient wrong (factor {s:.3g}, residual {residual:.2g})"


def sync_findings(original: RunComparison, replay: RunComparison, reference: RunReader, replay_reader: RunReader,
                  manifest: RunManifest, module_culprits: list[str]) -> tuple[list[SyncFinding], list[ModuleVerdict]]:
    """Failing reduced gradients and updated parameters that no module culprit explains."""
    before = {c.key: c for c in original.comparisons}
    groups: dict[tuple[str, str, str], SyncFinding] = {}
    wgrad: dict[str, ModuleVerdict] = {}
    failing_grads = {c.key.fqn for c in replay.comparisons if c.key.phase == "grad" and not c}
    for c in replay.comparisons:
        if c or c.key.phase not in ("grad", "param") or c.status in STRUCTURAL:
            continue
        if any(is_descendant(c.key.fqn, m) for m in module_culprits):
            continue
        if c.key.phase == "param":
            if c.key.fqn in failing_grads:
                continue  # a wrong gradient gives a wrong update: already reported
            reduction, bug_class, detail = "optimizer", "optimizer", "updated parameter wrong while its gradient passes"
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
            manifest: RunManifest, root: str | None = None) -> Localization:
    modules = module_verdicts(original, replay, root)
    introducing = [m.fqn for m in modules if m.verdict == "introduces error"]
    sync, wgrad_culprits = sync_findings(original, replay, reference, replay_reader, manifest, introducing)
    modules += wgrad_culprits
    culprits = introducing + [m.fqn for m in wgrad_culprits]
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
    in_module = [c for c in original.comparisons if in_subtree(_owner_module(c.key), module)]
    return any(c.key.fqn == module and c.key.phase == "forward" for c in in_module) and \
        any(not c and c.key.phase in ("forward", "backward") for c in in_module)


def _owner_module(key: TensorKey) -> str:
    return owner_of(key.fqn) if key.phase in ("grad", "param") else key.fqn


def relaunch_with_rewriting(reference_dir: Path, candidate_dir: Path, replay_dir: Path, *, module: str | None,
                            timeout_s: float, step: int = 0, alone: bool = True) -> str:
    """Run the candidate again from its manifest, with every traced module (of `module`'s subtree) fed
    the reference's values. With a module at step 0, the run is asked to call only that module
    (Session.one_module_replay; the bundled examples can, a script that does not check runs whole).
    Returns which ran: "module alone" or "whole model"."""
    from ttrace_core.errors import LaunchError
    from ttrace_core.record import relaunch

    manifest = read_manifest(candidate_dir)
    rewrite = {"reference": str(reference_dir.resolve()), "module": module}
    # An adaptive capture's command records statistics only: the replay records values of the judged step.
    value_steps = [step] if manifest.tracer.get("value_steps") else None
    if module and step == 0 and alone:
        shutil.rmtree(replay_dir, ignore_errors=True)
        alone = {**rewrite, "alone": {"candidate": str(candidate_dir.resolve()), "step": step}}
        try:
            relaunch(candidate_dir, manifest, replay_dir.resolve(), rewrite=alone, value_steps=value_steps,
                     timeout_s=timeout_s)
            if _holds_only(replay_dir, module):
                return "module alone"
        except LaunchError as error:
            if error.killed_by_signal:  # killed from outside: a fault, not a module that cannot run alone
                raise
            print(f"{module} cannot be replayed alone ({error}); replaying it inside the whole model", flush=True)
    shutil.rmtree(replay_dir, ignore_errors=True)
    relaunch(candidate_dir, manifest, replay_dir.resolve(), rewrite=rewrite, value_steps=value_steps,
             timeout_s=timeout_s)
    return "whole model"


def _holds_only(replay_dir: Path, module: str) -> bool:
    """Whether a replay recorded only `module`'s subtree (it ran alone) rather than the whole model."""
    with RunReader(replay_dir) as replay:
        return bool(replay.index) and all(in_subtree(_owner_module(key), module) for key in replay.index)


def _judge_replay(original: RunComparison, reference_dir: Path, candidate_dir: Path, replay_dir: Path,
                  module: str | None) -> Localization:
    step = original.first_divergence.key.step
    # A module's replay reads only that subtree's tensors of each run.
    with RunReader(reference_dir, subtree=module) as reference, RunReader(candidate_dir, subtree=module) as candidate, \
            RunReader(replay_dir, subtree=module) as replay_reader:
        reproduction = check_reproduction(original, candidate, replay_reader, step)
        if reproduction.reproduced is False:
            return Localization(reference=original.reference, candidate=original.candidate, replay=str(replay_dir),
                                diverged=True, reproduction=asdict(reproduction), notes=[
                                    f"the replay does not reproduce the candidate: {len(reproduction.mismatches)}+ of "
                                    f"{reproduction.num_checked} tensors computed from exact inputs differ, so no "
                                    "verdict is given; run the replay where the candidate was recorded"])
        replay = compare_runs(reference, replay_reader, select_tolerances("auto", reference, replay_reader))
        # Only the first step that diverges: later steps start from parameters the bug already changed,
        # so every module would fail there on correct inputs.
        replay.comparisons = [c for c in replay.comparisons if c.key.step == step and in_subtree(c.key.fqn, module)]
        result = analyze(original, replay, reference, replay_reader, candidate.manifest, root=module)
    result.reproduction = asdict(reproduction)
    if reproduction.reproduced is None:
        result.notes.append("reproduction not verified: no tensor of the candidate had only exact sources")
    if not result.culprits:
        reproduced = f"the replay reproduces the candidate ({reproduction.num_checked} tensors checked)" \
            if reproduction.reproduced else "the replay could not be checked against the candidate"
        result.notes.append(f"{reproduced}, yet with "
                            "every module fed the reference's inputs nothing fails: the error comes from state carried "
                            "between modules that is not a module input (a cached tensor, an RNG state, a residual "
                            "kept in a variable)")
    return result


def localize(reference_dir: str | os.PathLike, candidate_dir: str | os.PathLike, *, module: str | None = None,
             timeout_s: float = 600.0, replay_dir: str | os.PathLike | None = None,
             original: RunComparison | None = None, reuse_replay: bool = False,
             progress: Callable[[str], None] | None = None) -> Localization:
    """Localize the divergence of a candidate; `original`, if given, is its plain comparison (else
    computed); `reuse_replay` judges a complete replay already in `replay_dir` instead of relaunching.
    `progress` hears about each of the three stages (compare, replay, judge)."""
    progress = progress or (lambda message: None)
    reference_dir, candidate_dir = Path(reference_dir), Path(candidate_dir)
    if read_manifest(reference_dir).tracer.get("stats_only"):
        raise TtraceError(f"{reference_dir}: recorded with --stats-only, so it holds no values to feed the candidate's "
                          "modules; record the reference again without --stats-only")
    command = shlex.join(["ttrace", "localize", str(reference_dir), str(candidate_dir)] + (["--module", module] if module else []))
    progress("1/3 comparing the candidate with the reference")
    if original is None:
        with RunReader(reference_dir) as reference, RunReader(candidate_dir) as candidate:
            original = compare_runs(reference, candidate)
    if not original.comparisons:
        raise TtraceError(f"{candidate_dir}: no step was completed in both runs, nothing to localize")
    if original.first_divergence is None:  # every compared tensor passes, whether or not the evidence is complete
        notes = ["the candidate matches the reference: nothing to localize"] if original.passed else \
            ["no compared tensor diverged: nothing to localize; but the evidence is incomplete", *original.findings]
        return Localization(reference=str(reference_dir), candidate=str(candidate_dir), replay=None, diverged=False,
                            command=command, notes=notes)
    replay_dir = Path(replay_dir) if replay_dir else candidate_dir / ".localize" / ("replay" + (f"-{module}" if module else ""))
    reusable = reuse_replay and (replay_dir / "manifest.json").exists() and list(replay_dir.glob("rank_*.h5")) \
        and not list(replay_dir.glob("*.partial"))
    if not reusable:
        progress("2/3 replaying the candidate with the reference's inputs")
        scope = relaunch_with_rewriting(reference_dir, candidate_dir, replay_dir, module=module, timeout_s=timeout_s,
                                        step=original.first_divergence.key.step,
                                        alone=module is not None and can_replay_alone(original, module))
    else:
        scope = "reused"
    progress("3/3 checking the replay reproduces the candidate, then judging every module")
    result = _judge_replay(original, reference_dir, candidate_dir, replay_dir, module)
    result.command, result.replay_scope = command, scope
    return result
