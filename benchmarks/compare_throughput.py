"""Compare throughput against the speed of reading the same bytes, peak memory, 1 vs 2 workers.

Records (or reuses) a megatron-core pair, a 1-rank reference and a TP 2 + SP candidate, then measures
on the same machine, page cache warm for every measure alike:

- plain h5py: every dataset of both runs read once into memory (the floor of any compare);
- `ttrace compare --rebuild` with 1 worker and with `--workers 2`: wall time, MB/s of the tensor
  bytes of both runs, and the peak RSS of the whole process tree (ru_maxrss of the largest process);
- that the two tables are equal row for row.

Writes results/compare_throughput.{md,json}.

    python benchmarks/compare_throughput.py [--layers 8] [--hidden 256] [--work /var/tmp/ttrace-compare-throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
RUSAGE = "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); " \
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code, file=sys.stderr)"


def record(work: Path, flags: list[str]) -> tuple[Path, Path]:
    runs = {"reference": [], "candidate": ["--tp", "2", "--sp"]}
    for name, extra in runs.items():
        out = work / name
        if not (out / "manifest.json").is_file():
            subprocess.run([sys.executable, "-m", "ttrace_core", "example", "megatron-gpt", *flags, *extra, "--out", str(out)],
                           check=True, cwd=ROOT, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return work / "reference", work / "candidate"


def dataset_bytes(run: Path) -> int:
    total = 0
    for path in run.glob("rank_*.h5"):
        with h5py.File(path, "r") as handle:
            sizes = []
            handle.visititems(lambda name, node: sizes.append(node.id.get_storage_size()) if isinstance(node, h5py.Dataset) else None)
            total += sum(sizes)
    return total


def _read_dataset(name: str, node) -> None:
    if isinstance(node, h5py.Dataset):
        node[()]  # (a visit callback that returns a value stops the visit)


def plain_read_seconds(runs: tuple[Path, Path]) -> float:
    started = time.perf_counter()
    for run in runs:
        for path in sorted(run.glob("rank_*.h5")):
            with h5py.File(path, "r") as handle:
                handle.visititems(_read_dataset)
    return time.perf_counter() - started


def measured_compare(reference: Path, candidate: Path, json_out: Path, *extra: str,
                     env: dict[str, str] | None = None) -> tuple[int, float, int]:
    """`ttrace compare --rebuild --json` in a fresh process: (peak RSS in bytes of its largest process,
    wall seconds, exit code); exit 1 (the pair fails) counts as done."""
    command = [sys.executable, "-c", RUSAGE, sys.executable, "-m", "ttrace_core", "compare", str(reference),
               str(candidate), "--rebuild", "--json", str(json_out), *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    seconds = time.perf_counter() - started
    peak_kib, code = (int(x) for x in done.stderr.strip().splitlines()[-1].split())
    if code not in (0, 1):
        raise RuntimeError(f"ttrace compare {' '.join(extra)} failed:\n{done.stderr[-2000:]}")
    return peak_kib * 1024, seconds, code


def timed_compare(runs: tuple[Path, Path], out: Path, workers: int) -> dict:
    peak, seconds, code = measured_compare(*runs, out, "--workers", str(workers),
                                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {"workers": workers, "seconds": seconds, "peak_rss_mib": peak / 2**20, "exit": code}


PROFILED = {
    # where compare's time goes -> the functions whose cumulative time measures it
    "indexing both runs (RunReader.__init__)": ("store.py", "__init__"),
    "reading values (RunReader.read)": ("store.py", "read"),
    "assembling shards (canonicalize)": ("canonicalize.py", "canonicalize"),
    "replica differences (_replica_differences)": ("canonicalize.py", "_replica_differences"),
    "float64 passes of the comparison (value_sums)": ("value_sums.py", "value_sums"),
    "coverage tally (tally_coverage)": ("evidence.py", "tally_coverage"),
}


def profile_compare(runs: tuple[Path, Path]) -> dict:
    """One comparison in this process under cProfile: cumulative seconds per PROFILED entry."""
    import cProfile
    import pstats

    from ttrace_core.compare.engine import compare_runs
    from ttrace_core.format.reader import RunReader

    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    with RunReader(runs[0]) as reference, RunReader(runs[1]) as candidate:
        compare_runs(reference, candidate)
    profile.disable()
    found = {"compare_runs with indexing (profiled)": time.perf_counter() - started}
    stats = pstats.Stats(profile).stats
    for name, (file, function) in PROFILED.items():
        found[name] = sum(entry[3] for (path, _, func), entry in stats.items() if path.endswith(file) and func == function)
    return found


def render_profile(profile: dict, plain_s: float, rows: list[dict]) -> str:
    total = profile["compare_runs with indexing (profiled)"]
    lines = ["## Profile: where compare's time goes, and the next step", "",
             "One `compare_runs` in-process under cProfile (which inflates Python-heavy parts). Cumulative seconds; "
             "reading and assembling overlap (canonicalize is fed by the reads).", "", "| | seconds | share |", "|---|---|---|"]
    for name, seconds in profile.items():
        lines.append(f"| {name} | {seconds:.2f} | {seconds / total:.0%} |")
    passes = profile["float64 passes of the comparison (value_sums)"]
    reads = profile["reading values (RunReader.read)"]
    listed = sum(seconds for name, seconds in profile.items() if name != "compare_runs with indexing (profiled)")
    one, two = (next(row["seconds"] for row in rows if row["workers"] == n) for n in (1, 2))
    lines += ["", f"Reading the values takes {reads:.2f} s (plain h5py reads them in {plain_s:.2f} s). The float64 "
              f"passes take {passes:.2f} s: each tensor is differenced, then its norms, largest absolute and relative "
              f"differences and mismatch count are taken in separate passes over memory. The {total - listed:.2f} s "
              "not listed hold converting both sides to float64 before that, and the Python around each tensor. Next step: one fused pass per tensor in its "
              "stored precision, with float64 accumulators only, instead of float64 copies and six passes. It would also "
              f"cut the memory per element (bounded.BYTES_PER_ELEMENT). Two workers take {two:.1f} s against one's "
              f"{one:.1f} s: each indexes both runs, and on 2 cores both compete for memory bandwidth."]
    return "\n".join(lines) + "\n"


def render(rows: list[dict], plain_s: float, num_bytes: int, setup: str, same: bool) -> str:
    mb = num_bytes / 1e6
    lines = [f"# Compare throughput ({setup})", "",
             f"Tensor bytes of both runs: {mb:.0f} MB. Plain h5py reading every dataset once: {plain_s:.2f} s "
             f"({mb / plain_s:.0f} MB/s). Target: compare at >= 50% of that rate.", "",
             "| measure | seconds | MB/s | share of plain h5py | peak RSS (MiB, largest process) |", "|---|---|---|---|---|",
             f"| plain h5py read | {plain_s:.2f} | {mb / plain_s:.0f} | 100% | - |"]
    for row in rows:
        rate = mb / row["seconds"]
        lines.append(f"| `ttrace compare --workers {row['workers']}` | {row['seconds']:.2f} | {rate:.0f} | "
                     f"{100 * rate / (mb / plain_s):.0f}% | {row['peak_rss_mib']:.0f} |")
    lines += ["", f"1-worker and 2-worker tables equal row for row: **{'yes' if same else 'NO'}**. Compare times include "
              "starting Python and importing torch (and, with workers, spawning them)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-compare-throughput"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--render-only", action="store_true", help="redraw the .md from the results' .json")
    args = parser.parse_args()
    if args.render_only:
        saved = json.loads((args.results / "compare_throughput.json").read_text())
        text = render(saved["compare"], saved["plain_read_s"], saved["bytes"], saved["setup"], saved["same_table"]) + \
            "\n" + render_profile(saved["profile"], saved["plain_read_s"], saved["compare"])
        (args.results / "compare_throughput.md").write_text(text)
        print(text)
        return
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--seq-len", str(args.seq_len),
             "--micro-batches", "4", "--steps", "1"]
    args.work.mkdir(parents=True, exist_ok=True)
    runs = record(args.work, flags)
    num_bytes = dataset_bytes(runs[0]) + dataset_bytes(runs[1])
    plain_read_seconds(runs)  # warm the page cache for every measure alike
    plain_s = min(plain_read_seconds(runs) for _ in range(3))
    rows = [timed_compare(runs, args.work / f"workers-{n}.json", n) for n in (1, 2)]
    one, two = (json.loads((args.work / f"workers-{n}.json").read_text())["comparisons"] for n in (1, 2))
    setup = (f"megatron-core GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, 4 micro-batches; "
             f"1-rank reference vs TP 2 + SP candidate; {os.cpu_count()} cores")
    profile = profile_compare(runs)
    text = render(rows, plain_s, num_bytes, setup, one == two) + "\n" + render_profile(profile, plain_s, rows)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "compare_throughput.md").write_text(text)
    (args.results / "compare_throughput.json").write_text(json.dumps(
        {"setup": setup, "bytes": num_bytes, "plain_read_s": plain_s, "compare": rows, "same_table": one == two,
         "profile": profile}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
