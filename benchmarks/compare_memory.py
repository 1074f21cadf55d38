"""Compare in bounded memory: peak RSS of `ttrace compare` with and without `--max-memory`, on a
trace several times larger than the budget.

Writes a synthetic pair (tests/support/bounded_pair.py, run as a child: a 1-rank reference, a 2-rank
candidate whose tensors are split over rows S(0) or replicated, one mismatching and one with replica
drift), then runs `ttrace compare` in a fresh process for each budget and reads its peak RSS
(ru_maxrss). The fixed margin is the peak of
the same command on a pair of tiny tensors: the interpreter, torch, h5py and the run's index.
Also prints the bytes per element an unbounded comparison takes (bounded.BYTES_PER_ELEMENT).

Writes results/compare_memory.{md,json}.

    python benchmarks/compare_memory.py [--tensors 12] [--rows 256] [--work /var/tmp/ttrace-compare-memory]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from compare_throughput import measured_compare
from harness import run_harness

PAIR = "tests.support.bounded_pair"
"""The pair's writer and the row-for-row check, run as a child (benchmarks/harness.py)."""
RESULTS = Path(__file__).parent / "results"


def written_pair(root: Path, num_tensors: int, rows: int) -> tuple[tuple[Path, Path], int]:
    """The synthetic pair, written under `root` by the child: (reference, candidate), elements per tensor."""
    written = run_harness(PAIR, "write", str(root), "--tensors", str(num_tensors), "--rows", str(rows))
    return (Path(written["reference"]), Path(written["candidate"])), written["numel_per_tensor"]


def measure(work: Path, *, num_tensors: int, rows: int, budgets: list[str]) -> dict:
    from ttrace_core.cli.settings_flags import byte_size

    shutil.rmtree(work, ignore_errors=True)
    tiny, _ = written_pair(work / "tiny", num_tensors, 2)
    big, numel = written_pair(work / "big", num_tensors, rows)
    trace_bytes = sum(p.stat().st_size for run in big for p in run.glob("*.h5"))
    margin, _, _ = measured_compare(*tiny, work / "tiny.json")
    rows_out = []
    for budget in [None, *budgets]:
        extra = () if budget is None else ("--max-memory", budget)
        out = work / f"compare-{budget or 'unbounded'}.json"
        peak, seconds, _ = measured_compare(*big, out, *extra)
        rows_out.append({"max_memory": budget, "max_memory_bytes": budget and byte_size(budget), "peak_rss": peak,
                         "seconds": seconds, "over_margin": peak - margin, "table": str(out)})
    same = run_harness(PAIR, "same-rows", *(row["table"] for row in rows_out))
    for row, equal in zip(rows_out, [None, *same]):
        row["equal_to_unbounded"] = equal
    return {"trace_bytes": trace_bytes, "margin": margin, "numel_per_tensor": numel, "num_tensors": num_tensors,
            "bytes_per_element_unbounded": rows_out[0]["over_margin"] / numel, "rows": rows_out}


def render(measured: dict) -> str:
    mib = 2**20
    unbounded = measured["rows"][0]
    lines = [f"# Compare in bounded memory ({measured['num_tensors']} fp32 tensors of "
             f"{measured['numel_per_tensor'] * 4 / mib:.0f} MiB; a 1-rank reference and a 2-rank candidate)", "",
             f"Trace size of both runs: {measured['trace_bytes'] / mib:.0f} MiB. Fixed margin (the same command on "
             f"tiny tensors: interpreter, torch, h5py, the index): {measured['margin'] / mib:.0f} MiB. An unbounded "
             f"comparison takes {measured['bytes_per_element_unbounded']:.0f} bytes per element of its largest tensor.", "",
             "| --max-memory | peak RSS (MiB) | above the margin (MiB) | within budget + margin? | table equal to unbounded? | seconds |",
             "|---|---|---|---|---|---|"]
    for row in measured["rows"]:
        budget = row["max_memory_bytes"]
        within = "-" if budget is None else ("yes" if row["over_margin"] <= budget else "**no**")
        equal = "-" if row is unbounded else ("yes" if row["equal_to_unbounded"] else "**no**")
        lines.append(f"| {row['max_memory'] or 'none'} | {row['peak_rss'] / mib:.0f} | {row['over_margin'] / mib:.0f} "
                     f"| {within} | {equal} | {row['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=12)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--budgets", nargs="*", default=["32M", "64M", "128M"])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-compare-memory"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    measured = measure(args.work, num_tensors=args.tensors, rows=args.rows, budgets=args.budgets)
    text = render(measured)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "compare_memory.md").write_text(text)
    for row in measured["rows"]:
        row.pop("table"), row.pop("equal_to_unbounded")
    (args.results / "compare_memory.json").write_text(json.dumps(measured, indent=1))
    print(text)


if __name__ == "__main__":
    main()
