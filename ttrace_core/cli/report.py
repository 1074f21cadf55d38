"""Plain-text rendering of comparisons and traces for the CLI (the dashboard renders the same data)."""

from __future__ import annotations

import math
import shlex
import sys
from collections import Counter
from typing import TYPE_CHECKING

from ttrace_core.api import PSEUDO_MODULES, display_fqn, ComparisonStatus, KindHeadroom, RunComparison, TensorComparison, finding_lines

if TYPE_CHECKING:
    from ttrace_core.api import RunReader


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.3g}"


def comparison_row(c: TensorComparison) -> str:
    """`mismatch` is the error against the reference over the tolerance, `drift` how far the candidate's
    own replicas disagree over theirs; the verdict names the one that decided."""
    tol = _number(c.tolerance.rel) if c.tolerance else "-"
    verdict = "PASSED" if c else f"FAILED[{c.status}]"
    drift = _number(c.drift_ratio) if c.drift_ratio else "-"
    ratio = _number(c.value_ratio if c.value_ratio is not None else c.ratio)
    return f"{verdict:<22} {_number(c.error):>9} {tol:>9} {ratio:>9} {drift:>9}  {c.key}" + \
        (f"  -- {c.message}" if c.message and not c else "")


def ratios_text(c: TensorComparison) -> str:
    """"mismatch ratio 19.2, replica drift ratio 168 (decided by replica drift)": both ratios, named."""
    if c.value_ratio is None:
        return f"ratio {_number(c.ratio)}"
    if not c.drift_ratio:
        return f"mismatch ratio {_number(c.value_ratio)}"
    return f"mismatch ratio {_number(c.value_ratio)}, replica drift ratio {_number(c.drift_ratio)} (decided by {c.decided_by})"


COMPARISON_HEADER = f"{'verdict':<22} {'rel.err':>9} {'tol':>9} {'mismatch':>9} {'drift':>9}  tensor"


def headroom_lines(headroom: list[KindHeadroom]) -> list[str]:
    """Per tensor kind, the smallest relative error the verdict could have caught: the median over the kind's
    tensors and the largest (an error up to it could have passed on one of them)."""
    if not headroom:
        return ["headroom by tensor family: none (no tensor was compared element-wise, so no error size is bounded)"]
    lines = ["headroom by tensor family (the smallest relative error the verdict catches):",
             f"  {'kind':<12} {'tensors':>8} {'median':>9} {'largest':>9}"]
    return lines + [f"  {h.kind:<12} {h.num_tensors:>8} {_number(h.median):>9} {_number(h.largest):>9}" for h in headroom]


def render_comparison(result: RunComparison, *, num_worst: int = 10) -> str:
    header = COMPARISON_HEADER
    lines = [f"reference: {result.reference}", f"candidate: {result.candidate}", ""]
    first = result.first_divergence
    if first is not None:
        lines += ["first divergence (execution order):", header, comparison_row(first)]
        if first.max_abs_index is not None:
            lines.append(f"    max |diff| {_number(first.max_abs_diff)} at index {first.max_abs_index}; "
                         f"{first.num_mismatched}/{first.numel} elements outside tolerance; "
                         f"smallest passing rel tolerance {_number(first.min_rel_tolerance)}")
        if first.replica_drift:
            lines.append(f"    replica drift between ranks {tuple(first.replica_drift.ranks)}: "
                         f"{_number(first.replica_drift.relative_diff)} relative")
        lines.append("")
    lines += [f"worst {num_worst} by ratio (mismatch: error / tolerance; drift: replica difference / its tolerance):", header]
    lines += [comparison_row(c) for c in result.worst(num_worst)]
    lines.append("")
    lines += [f"note: {note}" for note in result.notes]
    summary = result.summary()
    lines += headroom_lines(summary.headroom)
    if result.coverage is not None:
        lines.append(f"coverage: {result.coverage.summary()}")
        lines += [f"unmapped: {line}" for line in result.coverage.unmapped_reasons]
    lines += [f"finding: {finding}" for finding in result.findings]
    statuses = Counter(c.status for c in result.comparisons)
    passed = statuses.pop(ComparisonStatus.PASS, 0)
    detail = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
    total = len(result.comparisons)
    lines.append(f"{summary.headline()} | {passed}/{total} tensors pass over steps {result.steps_compared}"
                 + (f"; {detail}" if detail else ""))
    return "\n".join(lines)


def _entrypoint_text(entrypoint: dict) -> str:
    if entrypoint.get("command"):
        return f"{shlex.join(entrypoint['command'])} (in {entrypoint.get('cwd') or '?'})"
    return entrypoint.get("factory") or "-"


def render_run(reader: RunReader, *, list_tensors: bool) -> str:
    m = reader.manifest
    lines = [f"run: {reader.run_dir}", f"role: {m.role}  world_size: {m.world_size}  degrees: {m.degrees}",
             f"mesh: {m.mesh_shape} {m.mesh_axis_names}  rank coordinates: {m.rank_coordinates}",
             f"precision: {m.precision}  seed: {m.seed}  entrypoint: {_entrypoint_text(m.entrypoint)}",
             f"model: {m.model}", f"complete steps: {reader.complete_steps}"]
    lines += [f"blind spot: {display_fqn(fqn)}: {why}" for fqn, why in sorted(m.blind_spots.items())]
    lines += [f"partial step {s}: {why}" for s, why in sorted(reader.partial_steps.items())]
    lines += [f"finding: {line}" for line in finding_lines(reader.findings)]
    by_phase = Counter(key.phase for key in reader.index)
    num_shards = sum(len(metas) for metas in reader.index.values())
    lines.append(f"tensors: {len(reader.index)} logical, {num_shards} shards; by phase: {dict(by_phase)}")
    if list_tensors:
        for key in sorted(reader.index, key=lambda k: (*k.execution_order(), min(x.seq for x in reader.index[k]))):
            meta = reader.index[key][0]
            lines.append(f"  {key}  {meta.dtype} {list(meta.layout.global_shape)} "
                         f"placements={list(meta.layout.placements)} shards={len(reader.index[key])}")
    return "\n".join(lines)


class ProgressBar:
    """A one-line text progress bar on stderr, drawn only when it is a terminal (or when forced)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total == 0:
            return
        percent = 100 * done // total
        if percent == self._last and done != total:
            return
        self._last = percent
        filled = percent * 30 // 100
        sys.stderr.write(f"\rcomparing [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _evidence_lines(evidence) -> list[str]:
    return [f"      {_number(e.ratio_before):>9} -> {_number(e.ratio_after):>9}  {e.key}" for e in evidence]


def render_localization(result) -> str:
    """A `localize.Localization` as text: culprits with evidence, the module tally, the command."""
    lines = [f"reference: {result.reference}", f"candidate: {result.candidate}"]
    if not result.diverged:
        return "\n".join(lines + ["", "no divergence: no culprit", *result.notes])
    scope = {"module alone": "only the module ran, on the reference's inputs",
             "whole model": "the whole model ran, every traced module fed the reference's inputs"}.get(result.replay_scope,
                                                                                                    "every traced module fed the reference's inputs")
    lines += [f"replay:    {result.replay} ({scope})", ""]
    if result.reproduced is False:
        reproduction = result.reproduction
        lines += ["NOT REPRODUCED: the replay computes something else than the candidate recorded, "
                  "so nothing is blamed.", "  tensors computed from exact inputs that differ:"]
        lines += [f"    {mismatch}" for mismatch in reproduction["mismatches"]]
        lines += ["  environment differences (recorded -> replay):"]
        lines += [f"    {difference}" for difference in reproduction["differences"] or ["none recorded"]]
        return "\n".join(lines + ["", *result.notes, f"reproduce: {result.command}"])
    if not result.culprits:
        lines.append("no culprit found")
    culprits = [m for m in result.modules if m.verdict == "introduces error"]
    for module in culprits:
        lines += [f"culprit: {PSEUDO_MODULES.get(module.fqn, module.fqn)}  (introduces error in {module.phase})"]
        lines += [f"      {module.detail}"] if module.detail else []
        lines += ["      ratio before -> after rewriting"] + _evidence_lines(module.evidence)
    for finding in result.sync:
        what = "optimizer step (update or parameter all-gather)" if finding.reduction == "optimizer" \
            else f"{finding.reduction} gradient reduction"
        params = f"{', '.join(finding.params[:6])}{' ...' if len(finding.params) > 6 else ''}"
        lines += [f"culprit: {params}: the {what} introduces the error [{finding.bug_class}]: {finding.detail} "
                  f"({len(finding.params)} parameter(s))", "      ratio before -> after rewriting"] \
            + _evidence_lines(finding.evidence)
    tally = Counter(m.verdict for m in result.modules)
    lines += ["", f"bug class: {result.bug_class or '-'}",
              f"modules: {tally['introduces error']} introduce error, {tally['inherits error']} inherit it, {tally['clean']} clean",
              *result.notes, f"reproduce: {result.command}"]
    return "\n".join(lines)


def render_markdown(result: RunComparison, localization=None) -> str:
    """A short summary for a review comment: verdict, first divergence, culprit, evidence."""
    statuses = Counter(c.status for c in result.comparisons)
    passed = statuses.get(ComparisonStatus.PASS, 0)
    lines = [f"**ttrace: {'PASSED' if result else 'FAILED'}** ({result.verdict}) · {passed}/{len(result.comparisons)} "
             f"tensors pass over steps {result.steps_compared}", "",
             f"- reference: `{result.reference}`", f"- candidate: `{result.candidate}`"]
    if result.coverage is not None:
        lines.append(f"- coverage: {result.coverage.summary()}")
    lines += [f"- finding: {finding}" for finding in result.findings]
    first = result.first_divergence
    if first is not None:
        tolerance = f"{first.tolerance.rel:.3g} ({first.tolerance.source})" if first.tolerance else "-"
        lines += [f"- first divergence: `{first.key}`: {first.status}, error {_number(first.error)}, "
                  f"tolerance {tolerance}, {ratios_text(first)}"]
    if localization is not None and localization.diverged:
        if localization.reproduced is False:
            lines.append("- localization: the replay does not reproduce the candidate; nothing blamed")
        elif localization.culprits:
            lines.append(f"- culprit: `{localization.culprits[0]}` ({localization.bug_class or '-'})"
                         + (f", and {len(localization.culprits) - 1} more" if len(localization.culprits) > 1 else ""))
            culprit = next((m for m in localization.modules if m.verdict == "introduces error"), None)
            evidence = culprit.evidence if culprit else (localization.sync[0].evidence if localization.sync else [])
            lines += [f"  - `{e.key}`: ratio {_number(e.ratio_before)} before, {_number(e.ratio_after)} with the "
                      "reference's inputs" for e in evidence[:3]]
        else:
            lines.append("- localization: diverged, but no module or reduction explains it")
        lines.append(f"- reproduce: `{localization.command}`")
    elif first is not None:
        lines.append(f"- localize: `ttrace localize {result.reference} {result.candidate}`")
    return "\n".join(lines)
