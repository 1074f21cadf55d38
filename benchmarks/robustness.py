"""Robustness benchmark: damage real traces in many ordinary ways and count how ttrace answers.

The cases and the answering are tests/faults/damage_runner.py's, run as a child process (a 1-rank
reference with a tolerance estimate and a TP2 + SP candidate, 1 layer, 1 step; every corruption class of
tests/faults/, each answered by `ttrace inspect`, `ttrace compare` and the dashboard's API in a forked
process with a time limit). This script counts the answers per class: crashes, hangs, unclear errors,
silent passes (a pass on a material corruption) and reads outside the trace.

Writes results/robustness.{md,csv}.

    python benchmarks/robustness.py [--work /tmp/ttrace-robustness] [--jobs 2] [--seed 0] [--scale 1] [--per-class N]
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter, defaultdict
from pathlib import Path

import fault_summary
from harness import run_harness

RESULTS = Path(__file__).parent / "results"


def summary_rows(results: list[dict], commands: list[str], outcomes: list[str]) -> list[dict]:
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for result in results:
        by_kind[result["kind"]].append(result)
    rows = []
    for kind, group in [*sorted(by_kind.items()), ("all", results)]:
        counts = {command: Counter(r[command]["outcome"] for r in group) for command in commands}
        rows.append({"class": kind, "cases": len(group), "material": sum(bool(r["material"]) for r in group),
                     **{f"{o}": sum(counts[c][o] for c in commands) for o in outcomes},
                     "silent passes": sum(r["silent"] for r in group),
                     "reads outside": sum(r["read_outside"] for r in group)})
    return rows


def render(run: dict) -> str:
    results, commands = run["results"], run["commands"]
    rows = summary_rows(results, commands, run["outcomes"])
    header = ["class", "cases", "material", *run["outcomes"], "silent passes", "reads outside"]
    total = rows[-1]
    lines = ["# Robustness benchmark", "",
             f"`python benchmarks/robustness.py`: {len(results)} damaged copies of a real megatron-core trace pair "
             f"(a 1-rank reference with a tolerance estimate and a TP2 + SP candidate, 1 layer, 1 step, "
             f"`ttrace example megatron-gpt {' '.join(run['base_flags'])}`), each answered by `ttrace inspect`, "
             f"`ttrace compare` and the dashboard's API (`api.find_runs`, `api.comparison_table`) in a forked process "
             f"with a {run['time_limit_s']:.0f} s limit; {run['seconds'] / 60:.1f} minutes on this machine.", "",
             f"**{total['crash']} crashes, {total['hang']} hangs, {total['silent passes']} silent passes, "
             f"{total['unclear error']} unclear errors, {total['reads outside']} reads outside the trace** over "
             f"{3 * len(results)} answers.", "",
             "A *material* corruption changes recorded values beyond their tolerance or makes the evidence incomplete "
             "or inconsistent: a pass on it is silent. Counts are answers (3 per case: inspect, compare, api); "
             "`inspect` lists a trace and has no verdict, so its passes are never silent. A *way out of the trace* "
             "(an HDF5 external or soft link, a virtual dataset, external raw storage, a step file or manifest "
             "symlinked outside) leads to an exact copy of the data on tmpfs whose access time is set before its "
             "modification time: a read by any of the three answers moves it, and counts as a read outside.", "",
             "Byte-level classes overwrite ranges (1 byte to 4 KiB) with zeros or random bytes at uniformly random "
             "offsets, or flip bits inside the HDF5 structures a reader walks: object headers and, inside a dataset's, "
             "its datatype, dataspace, layout and attribute messages; the global heap collections holding every "
             "dataset's `meta`; the superblock, group B-trees, symbol-table nodes and local heaps. *Lying shape over "
             "unallocated storage* declares 2**31 to 2**40 elements the file never wrote; *huge sizes in metadata* "
             "claims flat ranges of 10**12 elements, meshes of 10**9 ranks, split or block factors of 10**12, told "
             "alike by every shard of the tensor in both runs. The special-file classes put a FIFO, a socket, a device "
             "(a /dev/zero or /dev/null node, a link to /dev/zero or /dev/urandom), a directory or a broken symlink "
             "(to itself, a loop of two, to nothing) in place of every file of the pair but the estimate; *unreadable "
             "estimate* does the same to `tolerance_estimate.json`, empties it, cuts it in half or fills it with "
             "binary. Each case's process may take at most "
             f"{run['child_memory_bytes'] // 2**30} GiB of address space: a runaway allocation fails there as a crash, and so "
             "does a process killed by a signal (a segmentation fault in HDF5). The oracle that decides whether a case "
             "is material reads the damaged files with plain h5py in a process of its own: a file that crashes or "
             "hangs h5py is material.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row[name]) for name in header) + " |" for row in rows]
    bad = [r for r in results if r["silent"] or r["read_outside"]
           or any(r[c]["outcome"] in ("crash", "hang", "unclear error") for c in commands)]
    lines += ["", "## Every crash, hang, unclear error, silent pass and read outside", ""]
    if not bad:
        lines.append("None.")
    for r in bad:
        worst = [f"{c}: {r[c]['outcome']} {r[c]['line']}" for c in commands
                 if r[c]["outcome"] in ("crash", "hang", "unclear error")]
        lines.append(f"- {r['kind']}: {r['name']}: " + ("silent pass; " if r["silent"] else "")
                     + ("read outside; " if r["read_outside"] else "") + "; ".join(worst))
    return "\n".join(lines) + "\n"


def write_csv(run: dict, path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["class", "case", "material", *run["commands"], "silent", "read outside", "seconds", "compare line"])
        for r in run["results"]:
            writer.writerow([r["kind"], r["name"], r["material"], *(r[c]["outcome"] for c in run["commands"]), r["silent"],
                             r["read_outside"], r["seconds"], r["compare"]["line"]])


def with_fault_summary(text: str, results: Path) -> str:
    """robustness.md with its last section, the fault benchmarks' table, (re)drawn from their summaries."""
    head = text.split(fault_summary.render(Path("/nonexistent")).splitlines()[0])[0].rstrip()
    return head + "\n\n" + fault_summary.render(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-robustness"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=int, default=1, help="multiplies the random cases of every class")
    parser.add_argument("--per-class", type=int, default=None,
                        help="only the first N cases of every class: a smoke run, not a result to commit")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--summary-only", action="store_true",
                        help="redraw the fault benchmarks' table in robustness.md without re-running the cases")
    args = parser.parse_args()
    if args.summary_only:
        path = args.results / "robustness.md"
        path.write_text(with_fault_summary(path.read_text(), args.results))
        print(path.read_text())
        return
    run = run_harness("tests.faults.damage_runner", "--work", str(args.work), "--jobs", str(args.jobs),
                      "--seed", str(args.seed), "--scale", str(args.scale),
                      *(["--per-class", str(args.per_class)] if args.per_class is not None else []))
    args.results.mkdir(parents=True, exist_ok=True)
    text = with_fault_summary(render(run), args.results)
    (args.results / "robustness.md").write_text(text)
    write_csv(run, args.results / "robustness.csv")
    print(text)


if __name__ == "__main__":
    main()
