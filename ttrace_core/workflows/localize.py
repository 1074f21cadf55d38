"""`ttrace localize`: relaunch the candidate with every traced module fed the reference's inputs,
compare the replay and name the module or reduction at fault (localize/verdicts.py judges it).

A workflow: it loops back into recording (record.command.relaunch with input rewriting,
record/rewrite.py), then compares (compare) and judges (localize). Output: a `Localization`.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ttrace_core.compare.results import RunComparison
from ttrace_core.compare.engine import compare_readers
from ttrace_core.compare.settings import CompareSettings
from ttrace_core.errors import LaunchError, TtraceError
from ttrace_core.format.naming import PSEUDO_MODULES, in_subtree, module_of
from ttrace_core.format.reader import RunReader, read_manifest
from ttrace_core.localize.reproduction import check_reproduction
from ttrace_core.localize.verdicts import STRUCTURAL, Localization, analyze, can_replay_alone
from ttrace_core.record.command import relaunch
from ttrace_core.record.rewrite import read_unfed


def relaunch_with_rewriting(reference_dir: Path, candidate_dir: Path, replay_dir: Path, *, module: str | None,
                            timeout_s: float, step: int = 0, alone: bool = True) -> str:
    """Run the candidate again from its manifest, with every traced module (of `module`'s subtree) fed
    the reference's values. With a module at step 0, the run is asked to call only that module
    (Session.one_module_replay; the bundled examples can, a script that does not check runs whole).
    Returns which ran: "module alone" or "whole model"."""
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
        return bool(replay.index) and all(in_subtree(module_of(key), module) for key in replay.index)


def _judge_replay(original: RunComparison, reference_dir: Path, candidate_dir: Path, replay_dir: Path,
                  module: str | None, settings: CompareSettings) -> Localization:
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
        replay = compare_readers(reference, replay_reader, settings)
        # Only the first step that diverges: later steps start from parameters the bug already changed,
        # so every module would fail there on correct inputs.
        replay.comparisons = [c for c in replay.comparisons if c.key.step == step and in_subtree(c.key.fqn, module)]
        result = analyze(original, replay, reference, replay_reader, candidate.manifest, root=module,
                         unfed=frozenset(read_unfed(replay_dir)))
    result.reproduction = asdict(reproduction)
    if reproduction.reproduced is None:
        result.notes.append("reproduction not verified: no tensor of the candidate had only exact sources")
    structural = [c for c in replay.comparisons if not c and c.status in STRUCTURAL]
    if not result.culprits and structural:
        result.notes.append(f"{len(structural)} tensors of the replay fail on structure, the first {structural[0].key} "
                            f"({structural[0].status}: {structural[0].message}); input rewriting cannot explain those")
    elif not result.culprits:
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
             progress: Callable[[str], None] | None = None, settings: CompareSettings | None = None) -> Localization:
    """Localize the divergence of a candidate; `original`, if given, is its plain comparison (else
    computed); `reuse_replay` judges a complete replay already in `replay_dir` instead of relaunching.
    `progress` hears about each of the three stages (compare, replay, judge). `settings` judge the
    original and the replay alike (those of `ttrace compare`)."""
    if module in PSEUDO_MODULES:
        raise TtraceError(f"--module {module}: {PSEUDO_MODULES[module]} is no module a replay can feed the reference's "
                          "inputs; localize the whole model (without --module), whose comparison names it")
    progress = progress or (lambda message: None)
    settings = settings or CompareSettings()
    reference_dir, candidate_dir = Path(reference_dir), Path(candidate_dir)
    if read_manifest(reference_dir).tracer.get("stats_only"):
        raise TtraceError(f"{reference_dir}: recorded with --stats-only, so it holds no values to feed the candidate's "
                          "modules; record the reference again without --stats-only")
    command = shlex.join(["ttrace", "localize", str(reference_dir), str(candidate_dir)] + (["--module", module] if module else []))
    progress("1/3 comparing the candidate with the reference")
    if original is None:
        with RunReader(reference_dir) as reference, RunReader(candidate_dir) as candidate:
            original = compare_readers(reference, candidate, settings)
    if not original.comparisons:
        raise TtraceError(f"{candidate_dir}: no step was completed in both runs, nothing to localize")
    if original.first_divergence is None:  # every compared tensor passes, whether or not the evidence is complete
        lacking = "the reference did not train" if original.verdict == "refused" else "the evidence is incomplete"
        notes = ["the candidate matches the reference: nothing to localize"] if original.passed else \
            [f"no compared tensor diverged: nothing to localize; but {lacking}", *original.findings]
        return Localization(reference=str(reference_dir), candidate=str(candidate_dir), replay=None, diverged=False,
                            command=command, notes=notes, original_failed=not original.passed)
    first = original.first_divergence
    if first.status in STRUCTURAL:  # no value is wrong yet: what rewriting inputs explains cannot be at fault
        return Localization(reference=str(reference_dir), candidate=str(candidate_dir), replay=None, diverged=True,
                            command=command, notes=[
                                f"the first divergence, {first.key}, is structural ({first.status}: {first.message}); "
                                "feeding modules the reference's inputs cannot explain it, so nothing was replayed: "
                                "fix what it says, then compare again"])
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
    result = _judge_replay(original, reference_dir, candidate_dir, replay_dir, module, settings)
    result.command, result.replay_scope = command, scope
    return result
