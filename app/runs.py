"""Choosing a (reference, candidate) pair among the runs under the root: pure functions, no streamlit."""

from __future__ import annotations

from ttrace_core.api import RunInfo


def usable(runs: list[RunInfo]) -> list[RunInfo]:
    return [run for run in runs if run.error is None]


def references(runs: list[RunInfo]) -> list[RunInfo]:
    return [run for run in usable(runs) if run.role == "reference"]


def candidates(runs: list[RunInfo]) -> list[RunInfo]:
    return [run for run in usable(runs) if run.role != "reference"]


def matching_reference(runs: list[RunInfo], candidate: RunInfo) -> RunInfo | None:
    """The reference recorded from the same model at the same precision, nearest in the folder tree."""
    same = [r for r in references(runs) if r.model == candidate.model and r.precision == candidate.precision]
    same = same or [r for r in references(runs) if r.model == candidate.model]
    folder = candidate.path.rsplit("/", 1)[0] if "/" in candidate.path else ""
    return max(same, key=lambda r: (r.path.startswith(folder), -len(r.path)), default=None)


def layouts_of(runs: list[RunInfo], reference: str) -> list[str]:
    """The candidates whose matching reference is `reference` (paths, in the root's order): the rows of
    its layout matrix."""
    matched = ((c, matching_reference(runs, c)) for c in candidates(runs))
    return [c.path for c, r in matched if r is not None and r.path == reference]


def default_pair(runs: list[RunInfo], ref: str | None, cand: str | None) -> tuple[str | None, str | None]:
    """The pair to show: the URL's when it names usable runs; else a buggy candidate (a run with a bug
    recorded in its manifest) with its matching reference, so a first visit lands on something to see."""
    by_path = {run.path: run for run in usable(runs)}
    cand_run = by_path.get(cand or "")
    if cand_run is None:
        pool = candidates(runs)
        cand_run = next((c for c in pool if c.bug), pool[0] if pool else None)
    if ref in by_path:
        return ref, cand_run.path if cand_run else None
    matched = matching_reference(runs, cand_run) if cand_run else None
    return (matched.path if matched else None), (cand_run.path if cand_run else None)


def _steps_text(steps: list[int]) -> str:
    """A count first, then the ids: "1 (step 0)" (a bare "0" read as "no complete steps")."""
    if not steps:
        return "none"
    return f"{len(steps)} (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"


def metadata_rows(run: RunInfo) -> dict[str, str]:
    """What the Runs page shows of one run, as label -> text."""
    return {
        "role": run.role or "-", "layout": run.layout, "world size": str(run.world_size), "precision": run.precision or "-",
        "complete steps": _steps_text(run.steps), "partial steps": _steps_text(run.partial_steps), "injected bug": run.bug or "none",
        "tolerance estimate": ("yes (perturbation)" if run.has_estimate else "no")
        + "".join(f"; for {p} candidates" for p in run.estimates_for),
        "blind spots": "; ".join(f"{fqn or '(the model)'}: {why}" for fqn, why in sorted(run.blind_spots.items())) or "none",
        "recorded by": run.entrypoint or "-", "trace format": str(run.format_version),
        "versions": ", ".join(f"{name} {version}" for name, version in run.versions.items()) or "not recorded",
        "model": ", ".join(f"{k}={v}" for k, v in sorted(run.model.items())),
    }
