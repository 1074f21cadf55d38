"""The real-bug corpus under ttrace: every case of tests/real_bugs, in fp32 and bf16.

Each case (tests/real_bugs/corpus.py) is a silent bug from a public upstream issue or pull request of
megatron-core, PyTorch distributed, torchtitan or transformers, either with its fix reverted at run
time or as the pinned release ships it, or a negative control that must pass. The shared runner
(tests/real_bugs/runner.py) records the case's one-rank reference and its candidate, runs
`ttrace compare` and, for a detected bug, `ttrace localize`, and reports the ratio at the first
divergence, the check that decided it and the culprit named against what the fix touched. bf16 runs
are judged at the fixed bf16 tolerances (no `ttrace estimate`).

Writes results/real_bugs.json and results/real_bugs.md. Cases whose framework module is absent are
listed as a note; `--only` re-runs some cases and keeps the other rows of the existing results.

    python benchmarks/real_bugs.py [--only NAME ...] [--precision fp32 bf16] [--skip-slow] [--work DIR]
    python benchmarks/real_bugs.py --render     # rewrite the Markdown (and notes) from the json, no runs
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from datetime import date
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
MODULES = {"megatron-core": "tests.real_bugs.megatron_cases", "pytorch": "tests.real_bugs.pytorch_cases",
           "torchtitan": "tests.real_bugs.torchtitan_cases", "transformers": "tests.real_bugs.transformers_cases"}
PACKAGES = ("torch", "megatron-core", "torchtitan", "transformers")


def load_cases() -> tuple[list, list[str]]:
    """Every framework module's CASES, and a note per module that is not there."""
    cases, notes = [], []
    for framework, module in MODULES.items():
        try:
            cases.extend(importlib.import_module(module).CASES)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
            notes.append(f"{framework}: {module} is not present; its cases were not run")
    return cases, notes


def versions() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def unmeasured_notes(cases: list, rows: list[dict]) -> list[str]:
    """A note per framework whose cases are present but have no row in the results yet."""
    measured = {row["name"] for row in rows}
    notes = []
    for framework in MODULES:
        missing = [c.name for c in cases if c.framework == framework and c.name not in measured]
        if missing:
            notes.append(f"{framework}: {len(missing)} case(s) present but not measured in this file "
                         f"(`--only {' '.join(missing)}` adds them): {', '.join(missing)}")
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="case names to (re-)run; the other rows are kept")
    parser.add_argument("--precision", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--skip-slow", action="store_true", help="leave out the cases marked slow (4 ranks)")
    parser.add_argument("--work", default="/tmp/ttrace_real_bugs", help="where runs are recorded (deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the recorded runs in --work")
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown and notes from the json")
    args = parser.parse_args()
    from tests.real_bugs.results_table import markdown, ratio_text
    from tests.real_bugs.runner import run_case

    cases, notes = load_cases()
    if args.render:
        results = json.loads((RESULTS / "real_bugs.json").read_text())
        results["notes"] = notes + unmeasured_notes(cases, results["rows"])
        (RESULTS / "real_bugs.json").write_text(json.dumps(results, indent=1) + "\n")
        (RESULTS / "real_bugs.md").write_text(markdown(results))
        return
    selected = [c for c in cases if (args.only is None or c.name in args.only) and not (args.skip_slow and c.slow)]
    previous = json.loads((RESULTS / "real_bugs.json").read_text()) if (RESULTS / "real_bugs.json").is_file() else None
    rerun = {(c.name, p) for c in selected for p in args.precision}
    rows = [r for r in (previous or {}).get("rows", []) if (r["name"], r["precision"]) not in rerun
            and any(c.name == r["name"] for c in cases)]
    for case in selected:
        for precision in args.precision:
            work = Path(args.work) / precision / case.name
            shutil.rmtree(work, ignore_errors=True)
            result = run_case(case, work, precision)
            row = {**result.to_dict(), "summary": case.summary}
            rows.append(row)
            print(f"{case.name:<45} {precision:<5} detected={result.detected!s:<5} localized={result.localized!s:<5} "
                  f"ratio={ratio_text(result.ratio):<8} {result.deciding_test} culprits={result.culprits} "
                  f"{result.seconds:.0f}s {('ERROR ' + result.error.splitlines()[-1][:200]) if result.error else ''}",
                  flush=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    order = {c.name: index for index, c in enumerate(cases)}
    rows.sort(key=lambda r: (order[r["name"]], r["precision"] != "fp32"))
    results = {"date": date.today().isoformat(), "versions": versions(), "notes": notes + unmeasured_notes(cases, rows),
               "precisions": sorted({r["precision"] for r in rows}, key=lambda p: p != "fp32"), "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "real_bugs.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "real_bugs.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
