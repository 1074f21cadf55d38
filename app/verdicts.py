"""A localization's module verdicts as the rows the Localize page draws: pure functions, no streamlit."""

from __future__ import annotations

import pandas as pd

VERDICT_MARKS = {"introduces error": "🔴 introduces", "inherits error": "🟠 inherits", "clean": "🟢 clean"}


def depth_of(fqn: str, root: str | None) -> int:
    """How far to indent a module: its dots, or its levels below the replayed root (0 for the root)."""
    if root and (fqn == root or fqn.startswith(root + ".")):
        rest = fqn[len(root):].lstrip(".")
        return rest.count(".") + 1 if rest else 0
    return fqn.count(".")


def verdict_rows(localization, root: str | None) -> pd.DataFrame:
    """One row per judged module in execution order: indented name, verdict, phase, evidence ratios."""
    rows = []
    for module in localization.modules:
        worst = max(module.evidence, key=lambda e: e.ratio_after or 0, default=None)
        rows.append({
            "module": "\u2003" * depth_of(module.fqn, root) + module.fqn, "fqn": module.fqn,
            "verdict": VERDICT_MARKS.get(module.verdict, module.verdict), "where": module.phase,
            "ratio before": worst.ratio_before if worst else None, "ratio after": worst.ratio_after if worst else None,
            "evidence": worst.key if worst else "",
        })
    return pd.DataFrame(rows, columns=["module", "fqn", "verdict", "where", "ratio before", "ratio after", "evidence"])


def bisect_targets(localization, root: str | None) -> list[str]:
    """Modules to replay on their own next: each culprit that holds traced modules below it."""
    fqns = [m.fqn for m in localization.modules]
    culprits = [m.fqn for m in localization.modules if m.verdict == "introduces error" and m.fqn != root]
    return [c for c in culprits if any(f.startswith(c + ".") for f in fqns)]


def summary(localization) -> tuple[str, str]:
    """(level, one line) of the outcome: level is "success", "error" or "warning"."""
    if not localization.diverged:
        return "success", "No divergence: the candidate matches the reference, nothing to localize."
    if localization.reproduced is False:
        return "warning", "Not reproduced: the replay computes something else than the candidate recorded, so " \
                          "nothing is blamed. See the differences below."
    if localization.culprits:
        return "error", f"Culprit (introduces the error): {localization.culprits[0]}" + (
            f" (and {len(localization.culprits) - 1} more)" if len(localization.culprits) > 1 else "") + \
            f" · bug class: {localization.bug_class or '-'}"
    return "warning", "Diverged, but no module, reduction or optimizer step explains it: " + " ".join(localization.notes)


def progress_fraction(progress: str) -> float:
    """"2/3 replaying ..." -> 2/3; anything else -> a sliver, so the bar shows it started."""
    head = progress.split(" ", 1)[0]
    done, _, total = head.partition("/")
    if done.isdigit() and total.isdigit() and int(total) > 0:
        return min(int(done) / int(total), 1.0)
    return 0.05
