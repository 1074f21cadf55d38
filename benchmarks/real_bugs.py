"""The real-bug corpus under ttrace: every case of tests/real_bugs, in fp32 and bf16.

Each case (tests/real_bugs/corpus.py) is a silent bug from a public upstream issue or pull request of
megatron-core, PyTorch distributed, torchtitan or transformers, either with its fix reverted at run
time or as the pinned release ships it, or a negative control that must pass. The shared runner
(tests/real_bugs/runner.py), run as a child process per case and precision, records the case's
one-rank reference and its candidate, runs `ttrace compare` and, for a detected bug, `ttrace
localize`, and reports the ratio at the first divergence, the check that decided it, the culprit named
against what the fix touched, and its seconds. bf16 runs are judged at the fixed bf16 tolerances (no
`ttrace estimate`).

Writes results/real_bugs.json and results/real_bugs.md (rendered from the json by `markdown` below;
tests/real_bugs/test_real_bugs_figures.py checks the two agree). Cases whose framework module is
absent are listed as a note; `--only` re-runs some cases and keeps the other rows of the existing results.

    python benchmarks/real_bugs.py [--only NAME ...] [--precision fp32 bf16] [--skip-slow] [--work DIR] [--results DIR]
    python benchmarks/real_bugs.py --render     # rewrite the Markdown (and notes) from the json, no runs
"""

from __future__ import annotations

import argparse
import json
import shutil
from datetime import date
from importlib import metadata
from pathlib import Path

from harness import run_harness

RESULTS = Path(__file__).parent / "results"
RUNNER = "tests.real_bugs.runner"
PACKAGES = ("torch", "megatron-core", "torchtitan", "transformers")


def versions() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def unmeasured_notes(cases: list[dict], rows: list[dict]) -> list[str]:
    """A note per framework whose cases are present but have no row in the results yet."""
    measured = {row["name"] for row in rows}
    notes = []
    for framework in dict.fromkeys(c["framework"] for c in cases):  # in the corpus's order
        missing = [c["name"] for c in cases if c["framework"] == framework and c["name"] not in measured]
        if missing:
            notes.append(f"{framework}: {len(missing)} case(s) present but not measured in this file "
                         f"(`--only {' '.join(missing)}` adds them): {', '.join(missing)}")
    return notes


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="case names to (re-)run; the other rows are kept")
    parser.add_argument("--precision", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--skip-slow", action="store_true", help="leave out the cases marked slow (4 ranks)")
    parser.add_argument("--work", default="/tmp/ttrace_real_bugs", help="where runs are recorded (deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the recorded runs in --work")
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown and notes from the json")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where real_bugs.{json,md} are read and written (another directory for a trial run)")
    args = parser.parse_args()
    listed = run_harness(RUNNER, "--list")
    cases, notes, results_json = listed["cases"], listed["notes"], args.results / "real_bugs.json"
    if args.render:
        results = json.loads(results_json.read_text())
        results["notes"] = notes + unmeasured_notes(cases, results["rows"])
        results_json.write_text(json.dumps(results, indent=1) + "\n")
        (args.results / "real_bugs.md").write_text(markdown(results))
        return
    selected = [c for c in cases if (args.only is None or c["name"] in args.only) and not (args.skip_slow and c["slow"])]
    previous = json.loads(results_json.read_text()) if results_json.is_file() else None
    rerun = {(c["name"], p) for c in selected for p in args.precision}
    rows = [r for r in (previous or {}).get("rows", []) if (r["name"], r["precision"]) not in rerun
            and any(c["name"] == r["name"] for c in cases)]
    for case in selected:
        for precision in args.precision:
            work = Path(args.work) / precision / case["name"]
            shutil.rmtree(work, ignore_errors=True)
            row = run_harness(RUNNER, "--case", case["name"], "--precision", precision, "--work", str(work))
            rows.append(row)
            error = row["error"]
            print(f"{row['name']:<45} {precision:<5} detected={row['detected']!s:<5} localized={row['localized']!s:<5} "
                  f"ratio={ratio_text(row['ratio']):<8} {row['deciding_test']} culprits={row['culprits']} "
                  f"{row['seconds']:.0f}s {('ERROR ' + error.splitlines()[-1][:200]) if error else ''}", flush=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    order = {c["name"]: index for index, c in enumerate(cases)}
    rows.sort(key=lambda r: (order[r["name"]], r["precision"] != "fp32"))
    results = {"date": date.today().isoformat(), "versions": versions(), "notes": notes + unmeasured_notes(cases, rows),
               "precisions": sorted({r["precision"] for r in rows}, key=lambda p: p != "fp32"), "rows": rows}
    args.results.mkdir(parents=True, exist_ok=True)
    results_json.write_text(json.dumps(results, indent=1) + "\n")
    (args.results / "real_bugs.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
