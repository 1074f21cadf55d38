"""Choosing a (reference, candidate) pair among the runs under the root, and the correspondence map between them when
the reference is another implementation: no streamlit."""

from __future__ import annotations

import importlib.util
from pathlib import PurePosixPath

from ttrace_core.api import RunInfo, fitting_maps


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
    folder = PurePosixPath(candidate.path).parent  # a reference in this folder or below it, not in `folder` + "b"
    return max(same, key=lambda r: (PurePosixPath(r.path).is_relative_to(folder), -len(r.path)), default=None)


def layouts_of(runs: list[RunInfo], reference: str) -> list[str]:
    """The candidates whose matching reference is `reference` (paths, in the root's order): the rows of
    its layout matrix."""
    matched = ((c, matching_reference(runs, c)) for c in candidates(runs))
    return [c.path for c, r in matched if r is not None and r.path == reference]


def default_pair(runs: list[RunInfo], ref: str | None, cand: str | None) -> tuple[str | None, str | None]:
    """The pair to show: the URL's when it names usable runs; else a buggy candidate (a run with a bug
    recorded in its manifest) with its matching reference, so a first visit lands on something to see."""
    pool = candidates(runs)
    cand_run = next((c for c in pool if c.path == cand), None)  # a candidate only: not a reference given as cand=
    if cand_run is None:
        cand_run = next((c for c in pool if c.bug), pool[0] if pool else None)
    if ref in {r.path for r in references(runs)}:
        return ref, cand_run.path if cand_run else None
    matched = matching_reference(runs, cand_run) if cand_run else None
    return (matched.path if matched else None), (cand_run.path if cand_run else None)


def link_problems(runs: list[RunInfo], ref: str | None, cand: str | None) -> list[str]:
    """What is wrong with a link's pair, one line each, for the Runs page to say before it shows another pair:
    the same run twice, the two swapped (the manifests record the roles), a path that is no usable run of its role."""
    by_path = {run.path: run for run in usable(runs)}
    if ref and ref == cand:
        return [f"The link compares `{ref}` with itself, which always passes; showing another pair."]
    roles = (by_path[ref].role if ref in by_path else None, by_path[cand].role if cand in by_path else None)
    if roles == ("candidate", "reference"):
        return [f"The link's ref= and cand= are swapped (`{ref}` was recorded as a candidate, `{cand}` as a "
                "reference); showing another pair."]
    problems = []
    for name, given, wanted in (("ref", ref, "reference"), ("cand", cand, "candidate")):
        if not given:
            continue
        if given not in by_path:
            problems.append(f"The link's {name}=`{given}` is not a usable run under the root; showing another pair.")
        elif (by_path[given].role == "reference") != (wanted == "reference"):
            problems.append(f"The link's {name}=`{given}` was recorded as a {by_path[given].role}, not a {wanted}; "
                            "showing another pair.")
    return problems


def better_reference(runs: list[RunInfo], reference: RunInfo, candidate: RunInfo) -> RunInfo | None:
    """The reference of the candidate's model and precision when the chosen one computes in another precision
    (and holds no estimate for the candidate's): picking it is the fix, not estimating across precisions."""
    if reference.precision == candidate.precision or candidate.precision in reference.estimates_for:
        return None
    matched = matching_reference(runs, candidate)
    if matched is None or matched.path == reference.path or matched.precision != candidate.precision:
        return None
    return matched


def recorded_by_text(entrypoint: str | None) -> str:
    """The manifest's entrypoint: the recorded command, or "module:function" for an older trace; flagged when the
    module it runs (`-m MODULE`, or the factory's) cannot be found in this installation (a run recorded by an older
    ttrace, whose examples lived elsewhere): `ttrace localize` relaunches it from there."""
    if not entrypoint:
        return "-"
    words = entrypoint.split()
    if len(words) > 1:
        module = words[words.index("-m") + 1] if "-m" in words[:-1] else None
    else:
        module = entrypoint.split(":", 1)[0]
    if module is None:
        return entrypoint
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return entrypoint if found else f"{entrypoint} (not found in this installation: recorded by an older version?)"


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
        "recorded by": recorded_by_text(run.entrypoint), "trace format": str(run.format_version),
        "versions": ", ".join(f"{name} {version}" for name, version in run.versions.items()) or "not recorded",
        "model": ", ".join(f"{k}={v}" for k, v in sorted(run.model.items())),
    }


NO_MAP = ""
"""The map picker's "none": the reference runs the candidate's own code."""


def map_options(shipped: list[str], url_map: str | None) -> list[str]:
    """The map picker's choices: none, every shipped map, and the URL's map when it is a file (or unknown: the page
    then says why it cannot be used, instead of silently showing another choice)."""
    return [NO_MAP, *shipped, *([url_map] if url_map and url_map not in shipped else [])]


def map_label(choice: str) -> str:
    return "none (the same code)" if choice == NO_MAP else choice


def suggested_maps(reference: RunInfo, candidate: RunInfo) -> list[str]:
    """The shipped maps that relate this pair when the reference is another implementation (api.fitting_maps: its
    recorded transformers config and parameters against the candidate's); none for a pair of the same code."""
    if reference.world_size != 1 or not isinstance(reference.model.get("config"), dict):
        return []
    return fitting_maps(reference.model, candidate.model)


def suggestion_text(reference: RunInfo, names: list[str]) -> str:
    model_type = reference.model["config"].get("model_type")
    others = f" ({', '.join(f'`{n}`' for n in names[1:])} fit as well)" if len(names) > 1 else ""
    return (f"The reference records a transformers `{model_type}` model and the candidate is another implementation: "
            f"the correspondence map `{names[0]}` relates them{others} (its facts resolve in the reference's config "
            "and its rules turn the reference's parameters into the candidate's, names and shapes). Without a map "
            "the two cannot be compared tensor by tensor.")


def map_text(name: str, reference_words: str, candidate_words: str, mapped: str) -> str:
    """What a chosen map does, in words, for the Runs page."""
    return (f"Compared through the correspondence map `{name}`: the reference ({reference_words}) is rewritten "
            f"in the candidate's names and layouts ({candidate_words}), once, into `{mapped}`; tensors either side "
            "has no counterpart for are listed by reason, not compared.")


def unmapped_lines(coverage) -> list[str]:
    """The comparison's tensors without counterpart through the map: a headline, then one line per reason and the
    first tensors the map neither relates nor declares (a `Coverage` of a mapped comparison; [] without a map)."""
    if coverage is None or not (coverage.unmapped or coverage.num_unaccounted):
        return []
    lines = [f"{coverage.unmapped} tensor{'s' if coverage.unmapped != 1 else ''} without counterpart through the map "
             "(declared in it, not compared):", *(f"- {reason}" for reason in coverage.unmapped_reasons)]
    if coverage.num_unaccounted:
        lines += [f"{coverage.num_unaccounted} tensor{'s' if coverage.num_unaccounted != 1 else ''} the map neither "
                  "relates nor declares (the evidence is incomplete until it does), e.g.:",
                  *(f"- `{tensor}`" for tensor in coverage.unaccounted[:5])]
    return lines
