"""What the benchmarks of third-party Trainers share (thirdparty_hf_trainer.py, thirdparty_lightning.py): record a
user's Trainer script on one process with 4 accumulated batches (the reference) and on 2 DDP processes with 2 each
(the candidate), compare each candidate with the reference of the same options, localize a planted bug, and write
the table a results file holds.

A case is (name, options of both runs, the candidate's own options, expected verdict, what it shows); a candidate
given `--bug MODULE` is localized too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from thirdparty_transformers import compare, ttrace  # beside this script

RESULTS = Path(__file__).parent / "results"


def record(work: Path, script: Path, name: str, processes: int, flags: list[str]) -> float:
    launcher = [sys.executable] if processes == 1 else ["torchrun", "--standalone", "--nproc-per-node", str(processes)]
    done, seconds = ttrace(work, "record", "--out", name, "--timeout", "600", "--", *launcher, str(script),
                           "--accumulation", str(4 // processes), *flags)
    if done.returncode != 0:
        raise RuntimeError(f"record {name} failed: {done.stderr[-2000:]}")
    return seconds


def run_cases(work: Path, script: Path, cases: list[tuple[str, list[str], list[str], str, str]]) -> tuple[list[dict], float]:
    """Every case's row (compare's figures, and what localize named for a planted bug), and the minutes it all took."""
    started = time.perf_counter()
    references: dict[tuple[str, ...], str] = {}
    rows = []
    for index, (name, shared, own, expected, shows) in enumerate(cases):
        if tuple(shared) not in references:
            references[tuple(shared)] = reference = f"reference{len(references)}"
            record(work, script, reference, 1, shared)
        reference = references[tuple(shared)]
        candidate = f"case{index}"
        seconds = record(work, script, candidate, 2, shared + own)
        row = {"case": name, "flags": " ".join(shared + own), "expected": expected, "shows": shows,
               "record_seconds": round(seconds, 1), **compare(work, reference, candidate)}
        if "--bug" in own:
            row["broken_module"] = own[own.index("--bug") + 1]
            done, localize_seconds = ttrace(work, "localize", reference, candidate, "--json", "localize.json")
            row["localized"] = (json.loads((work / "localize.json").read_text())["culprits"]
                                if done.returncode in (0, 1) else None)
            row["localize_seconds"] = round(localize_seconds, 1)
        rows.append(row)
        print(f"{name:44s} {row['verdict']:5s} {row['passed']}/{row['total']}  largest ratio {row['largest_ratio']:.3g}"
              f"  {row['first_divergence'] or ''} {row.get('localized') or ''}", flush=True)
    return rows, round((time.perf_counter() - started) / 60, 1)


def write_results(name: str, results: dict, title: str, setup: str) -> None:
    """results/NAME.{json,md}: the json as measured, the markdown its table under `title` and `setup` (one paragraph)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1))
    (RESULTS / f"{name}.md").write_text(markdown(results, title, setup))
    print(markdown(results, title, setup))


def markdown(results: dict, title: str, setup: str) -> str:
    lines = [f"# {title}", "", setup, "",
             "| case | expected | verdict | tensors passed / total | largest ratio | first divergence | localized |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["cases"]:
        lines.append(f"| {row['case']} | {row['expected']} | {row['verdict']} | {row['passed']} / {row['total']} | "
                     f"{row['largest_ratio']:.3g} | {row['first_divergence'] or '-'} | "
                     f"{', '.join(row['localized']) if row.get('localized') else '-'} |")
    lines += ["", "Ratio: error / tolerance (1 is the pass line; for a failed row, the failing tensors' own). "
              "Timings (seconds, 2 shared CPU cores): " + ", ".join(
                  f"{row['case']}: record {row['record_seconds']}, compare {row['compare_seconds']}"
                  + (f", localize {row['localize_seconds']}" if "localize_seconds" in row else "")
                  for row in results["cases"]) + "."]
    return "\n".join(lines) + "\n"
