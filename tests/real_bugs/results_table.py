"""The Markdown of the real-bug results (benchmarks/results/real_bugs.md), rendered from their json.

Input: the results dict benchmarks/real_bugs.py writes to real_bugs.json (versions, notes, precisions,
one row per case and precision: a runner.CaseResult plus the case's summary). Output: the Markdown.
Shared by the benchmark, which writes it, and test_real_bugs_figures.py, which checks the committed
Markdown is exactly this rendering of the committed json.
"""

from __future__ import annotations


def ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _culprits(row: dict) -> str:
    return "; ".join(row["culprits"]) or "-"


def _link(url: str | None) -> str:
    if not url:
        return "-"
    tail = url.rstrip("/").split("/")
    return f"[{tail[-4]}#{tail[-1]}]({url})" if len(tail) >= 4 and tail[-2] in ("issues", "pull") else url


def markdown(results: dict) -> str:
    rows = results["rows"]
    bugs = [r for r in rows if not r["control"]]
    controls = [r for r in rows if r["control"]]
    lines = ["# The real-bug corpus", "",
             f"Measured {results['date']} with " + ", ".join(f"{k} {v}" for k, v in results["versions"].items())
             + "; 2 CPU cores, gloo. Written by `python benchmarks/real_bugs.py`; the cases are in tests/real_bugs/.",
             "", "## Summary", ""]
    for precision in results["precisions"]:
        measured = [r for r in bugs if r["precision"] == precision]
        names = {r["name"] for r in measured}
        moe = {r["name"] for r in measured if r["moe"]}
        lines.append(f"- {precision}: {sum(r['detected'] for r in measured)}/{len(measured)} bugs detected "
                     f"({len(moe)} MoE / expert parallel), {sum(r['localized'] for r in measured)}/{len(measured)} "
                     f"localized to what the fix touched; "
                     f"{sum(not r['detected'] and not r['error'] for r in controls if r['precision'] == precision)}/"
                     f"{sum(r['precision'] == precision for r in controls)} controls passed; "
                     f"{len(names)} distinct bugs.")
    for note in results["notes"]:
        lines.append(f"- note: {note}")
    lines += ["", "## Bugs", "",
              "| bug | framework | MoE | source | fix | reproduced | precision | detected | ratio at first divergence "
              "| deciding test | first divergence | culprit named | the fix touched | localized | seconds |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in bugs:
        detected = "error" if r["error"] else ("yes" if r["detected"] else "no")
        lines.append(f"| {r['name']} | {r['framework']} | {'yes' if r['moe'] else 'no'} | {_link(r['source'])} "
                     f"| {_link(r['fix'])} | {r['reproduced_by']} | {r['precision']} | {detected} | {ratio_text(r['ratio'])} "
                     f"| {r['deciding_test'] or '-'} | `{r['first_divergence'] or '-'}` | {_culprits(r)} | {r['touched']} "
                     f"| {'yes' if r['localized'] else 'no'} | {r['seconds']:.0f} |")
    lines += ["", "## Negative controls", "",
              "| control | framework | precision | verdict | worst first failure | what it changes |",
              "|---|---|---|---|---|---|"]
    for r in controls:
        verdict = f"error: {r['error'][:80]}" if r["error"] else r["verdict"]
        lines.append(f"| {r['name']} | {r['framework']} | {r['precision']} | {verdict} "
                     f"| `{r['first_divergence'] or '-'}` | {r['summary']} |")
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += ["", "## Cases that could not be measured", ""]
        lines += [f"- {r['name']} ({r['precision']}): {r['error'].splitlines()[-1][:300]}" for r in errors]
    lines += ["", "## How each bug is reproduced", ""]
    seen = set()
    for r in bugs:
        if r["name"] not in seen:
            seen.add(r["name"])
            lines.append(f"- **{r['name']}** ({r['reproduced_by']}): {r['summary']}")
    return "\n".join(lines) + "\n"
