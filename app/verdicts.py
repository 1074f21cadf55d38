"""A localization's module verdicts as the rows the Localize page draws: pure functions, no streamlit."""

from __future__ import annotations

import re

import pandas as pd

VERDICT_MARKS = {"introduces error": "🔴 introduces", "inherits error": "🟠 inherits", "clean": "🟢 clean"}


def depth_of(fqn: str, listed: set[str] | frozenset[str] = frozenset()) -> int:
    """How far to indent a module: the number of its ancestors that the table lists, so a module sits one step
    under its nearest listed parent, and siblings (`embedding...` and `decoder.layers.0`, whose common parent is
    not listed) line up. Counting dots made `decoder.layers.0` look like a child of `embedding.embedding_dropout`."""
    parts = fqn.split(".")
    return sum(".".join(parts[:i]) in listed for i in range(1, len(parts)))


def ratio_text(ratio: float | None) -> str:
    """A ratio the way every page prints it (`.3g`: 6.61e+04), "-" when there is none."""
    return "-" if ratio is None or ratio != ratio else f"{ratio:.3g}"


def _reduction_findings(localization) -> dict[str, list]:
    """Module -> the sync findings (gradient reduction, optimizer) naming its own parameters."""
    from ttrace_core.api import owner_of

    found: dict[str, list] = {}
    for finding in localization.sync:
        for owner in dict.fromkeys(owner_of(param) or param for param in finding.params):
            found.setdefault(owner, []).append(finding)
    return found


def verdict_rows(localization) -> pd.DataFrame:
    """One row per judged module in execution order: indented name, verdict, phase, evidence ratios (as text, one
    format). A module the replay found clean while a gradient reduction or optimizer step of its own parameters
    introduces the error says so, with that evidence, rather than "clean" beside a culprit naming its parameters."""
    listed = {module.fqn for module in localization.modules}
    reductions = _reduction_findings(localization)
    rows = []
    for module in localization.modules:
        verdict, phase, evidence = VERDICT_MARKS.get(module.verdict, module.verdict), module.phase, module.evidence
        if module.verdict == "clean" and module.fqn in reductions:
            findings = reductions[module.fqn]
            verdict = f"🔴 its {', '.join(dict.fromkeys(f.reduction for f in findings))}"
            phase = "parameters' " + ", ".join(dict.fromkeys(f.bug_class for f in findings))
            evidence = [e for f in findings for e in f.evidence if module.fqn in e.key] or \
                [e for f in findings for e in f.evidence]
        worst = max(evidence, key=lambda e: e.ratio_after or 0, default=None)
        rows.append({
            "module": "\u2003" * depth_of(module.fqn, listed) + module.fqn, "fqn": module.fqn, "verdict": verdict,
            "where": phase, "ratio before": ratio_text(worst.ratio_before if worst else None),
            "ratio after": ratio_text(worst.ratio_after if worst else None), "evidence": worst.key if worst else "",
        })
    return pd.DataFrame(rows, columns=["module", "fqn", "verdict", "where", "ratio before", "ratio after", "evidence"])


def bisect_targets(localization, root: str | None) -> list[str]:
    """Modules to replay on their own next: each culprit that holds traced modules below it. Not the model
    root (""): replayed alone, it is the whole model again."""
    from ttrace_core.api import is_descendant

    fqns = [m.fqn for m in localization.modules]
    culprits = [m.fqn for m in localization.modules if m.verdict == "introduces error" and m.fqn not in (root, "")]
    return [c for c in culprits if any(is_descendant(f, c) for f in fqns)]


def summary(localization) -> tuple[str, str]:
    """(level, one line) of the outcome: level is "success", "error" or "warning"."""
    if not localization.diverged:
        return "success", "No divergence: the candidate matches the reference, nothing to localize."
    if localization.reproduced is False:
        return "warning", "Not reproduced: the replay computes something else than the candidate recorded, so " \
                          "nothing is blamed. See the differences below."
    if len(localization.culprits) == 1:
        return "error", f"Culprit (introduces the error): {localization.culprits[0]} · bug class: " \
                        f"{localization.bug_class or '-'}"
    if localization.culprits:  # every one named: "(and 3 more)" hid three culprits in a scrolling table
        return "error", f"Culprits (each introduces an error): {'; '.join(localization.culprits)} · bug class: " \
                        f"{localization.bug_class or '-'}"
    return "warning", "Diverged, but no module, reduction or optimizer step explains it: " + " ".join(localization.notes)


_STAGE_TIME = re.compile(r"\s*\(t=([0-9.]+) s\)$")


def progress_text(progress: str, seconds: float | None) -> str:
    """The replay's progress line as the page shows it while the job runs: the stage, then the time running and
    the time in this stage, both from now. The log's own "(t=0.1 s)" is when the stage began, and left as it
    was it read as a frozen clock while a long stage ran."""
    elapsed = seconds or 0.0
    matched = _STAGE_TIME.search(progress)
    stage = _STAGE_TIME.sub("", progress) or "starting"
    if matched is None:
        return f"{stage} · running for {elapsed:.0f} s"
    return f"{stage} · running for {elapsed:.0f} s, this stage for {max(elapsed - float(matched.group(1)), 0):.0f} s"


def progress_fraction(progress: str) -> float:
    """"2/3 replaying ..." -> 2/3; anything else -> a sliver, so the bar shows it started."""
    head = progress.split(" ", 1)[0]
    done, _, total = head.partition("/")
    if done.isdigit() and total.isdigit() and int(total) > 0:
        return min(int(done) / int(total), 1.0)
    return 0.05
