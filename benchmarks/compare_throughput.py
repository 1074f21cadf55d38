"""Compare throughput against the speed of reading the same bytes, before and after a change.

Records (or reuses) a megatron-core pair, a 1-rank reference and a TP 2 + SP candidate, then measures
on the same machine, page cache warm for every measure alike, in interleaved rounds (medians):

- plain h5py: every dataset of both runs read once into memory (the floor of any compare);
- `ttrace compare --rebuild --workers 1`: wall time of a fresh process, Python start and imports included;
- `compare_runs` in a process that has already imported torch: indexing plus comparing, the part that
  reads the bytes plain h5py reads;
- each of those for this tree and, with `--baseline`, for another checkout (e.g. main) in the same rounds;
- once: `--workers 2`, peak RSS, and that the tables agree (1 vs 2 workers; before vs after);
- a cProfile of one in-process comparison: where the time goes.

Writes results/compare_throughput.{md,json}.

    python benchmarks/compare_throughput.py [--baseline /work/main] [--rounds 3] [--layers 8] [--hidden 256]
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
                     env: dict[str, str] | None = None, root: Path = ROOT) -> tuple[int, float, int]:
    """`ttrace compare --rebuild --json` in a fresh process run from the code tree `root`: (peak RSS in
    bytes of its largest process, wall seconds, exit code); exit 1 (the pair fails) counts as done."""
    command = [sys.executable, "-c", RUSAGE, sys.executable, "-m", "ttrace_core", "compare", str(reference),
               str(candidate), "--rebuild", "--json", str(json_out), *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=3600, env=env)
    seconds = time.perf_counter() - started
    peak_kib, code = (int(x) for x in done.stderr.strip().splitlines()[-1].split())
    if code not in (0, 1):
        raise RuntimeError(f"ttrace compare {' '.join(extra)} failed:\n{done.stderr[-2000:]}")
    return peak_kib * 1024, seconds, code


def _tree_env(root: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}


def timed_compare(runs: tuple[Path, Path], out: Path, workers: int, root: Path = ROOT) -> dict:
    peak, seconds, code = measured_compare(*runs, out, "--workers", str(workers), env=_tree_env(root), root=root)
    return {"workers": workers, "seconds": seconds, "peak_rss_mib": peak / 2**20, "exit": code}


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def default_threads_compare(runs: tuple[Path, Path], out: Path, root: Path) -> float:
    """`ttrace compare --workers 1` as a user runs it, with torch's and numpy's default thread counts (none of
    THREAD_VARIABLES set): every other measure here runs on one thread, so it would not see what the thread
    pools do to each other."""
    env = {name: value for name, value in _tree_env(root).items() if name not in THREAD_VARIABLES}
    return measured_compare(*runs, out, "--workers", "1", env=env, root=root)[1]


IN_PROCESS = """import sys, time
from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.reader import RunReader
started = time.perf_counter()
with RunReader(sys.argv[1]) as reference, RunReader(sys.argv[2]) as candidate:
    indexed = time.perf_counter()
    compare_runs(reference, candidate)
print(indexed - started, time.perf_counter() - indexed)
"""


def in_process_compare(runs: tuple[Path, Path], root: Path) -> tuple[float, float]:
    """(indexing seconds, comparing seconds) of one `compare_runs` after Python and torch are loaded:
    the part of a compare that reads the bytes plain h5py reads."""
    done = subprocess.run([sys.executable, "-c", IN_PROCESS, *map(str, runs)], cwd=root, capture_output=True,
                          text=True, timeout=3600, env=_tree_env(root), check=True)
    indexing, comparing = (float(x) for x in done.stdout.split())
    return indexing, comparing


PROFILED = {
    # where compare's time goes -> the functions whose cumulative time measures it
    "indexing both runs (RunReader.__init__)": ("reader.py", "__init__"),
    "reading values (RunReader.read)": ("reader.py", "read"),
    "of which the bytes (os.preadv, format 5)": ("~", "<built-in method posix.preadv>"),
    "assembling shards (canonicalize)": ("shards.py", "canonicalize"),
    "replica differences (_replica_differences)": ("shards.py", "_replica_differences"),
    "one-pass value sums (value_sums)": ("metrics.py", "value_sums"),
    "of which float64 arithmetic on the chunks (_finite_chunk_sums)": ("metrics.py", "_finite_chunk_sums"),
    "small tensors gathered from their bytes and summed in batches (window_sums)": ("window.py", "window_sums"),
    "small tensors read and summed alone (batched_sums)": ("batched.py", "batched_sums"),
    "metadata consistency (_inconsistent)": ("engine.py", "_inconsistent"),
    "coverage tally (tally_coverage)": ("evidence.py", "tally_coverage"),
}


def profile_compare(runs: tuple[Path, Path]) -> dict:
    """One comparison in this process (this tree's code) under cProfile: cumulative seconds per PROFILED entry."""
    import cProfile
    import pstats

    sys.path.insert(0, str(ROOT))
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
        found[name] = sum(entry[3] for (path, _, func), entry in stats.items()
                          if path.endswith(file) and func == function and ("ttrace_core" in path or path == "~"))
    return found


def render_profile(profile: dict, plain_s: float) -> str:
    total = profile["compare_runs with indexing (profiled)"]
    lines = ["## Profile: where compare's time goes now", "",
             "One `compare_runs` in-process under cProfile (which inflates Python-heavy parts). Cumulative seconds; "
             "reading and assembling overlap (canonicalize is fed by the reads).", "", "| | seconds | share |", "|---|---|---|"]
    for name, seconds in profile.items():
        lines.append(f"| {name} | {seconds:.2f} | {seconds / total:.0%} |")
    listed = sum(seconds for name, seconds in profile.items()
                 if name != "compare_runs with indexing (profiled)" and not name.startswith("of which"))
    lines += ["", f"Not listed: {max(0.0, total - listed):.2f} s of Python around each tensor (row building, "
              f"tolerances, verdicts). Plain h5py reads every dataset in {plain_s:.2f} s."]
    return "\n".join(lines) + "\n"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def measure_rounds(runs: tuple[Path, Path], work: Path, trees: dict[str, Path], num_rounds: int) -> dict:
    """Interleaved rounds (plain read, then each tree's CLI and in-process compare): a machine whose
    speed drifts 2x between runs slows every measure of one round alike; medians over rounds."""
    rounds: dict[str, list[float]] = {"plain": []}
    for round_index in range(num_rounds):
        rounds["plain"].append(plain_read_seconds(runs))
        for name, root in trees.items():
            rounds.setdefault(f"{name} cli", []).append(timed_compare(runs, work / f"{name}-workers-1.json", 1, root)["seconds"])
            indexing, comparing = in_process_compare(runs, root)
            rounds.setdefault(f"{name} in-process", []).append(indexing + comparing)
            rounds.setdefault(f"{name} indexing", []).append(indexing)
        print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rounds.items()), flush=True)
    return {"rounds": rounds, "median": {name: _median(values) for name, values in rounds.items()}}


def same_verdicts(one: list[dict], other: list[dict]) -> bool:
    """Row for row the same key, status, indices and counts, and norms equal within float rounding."""
    if len(one) != len(other):
        return False
    exact = ("key", "status", "max_abs_index", "max_rel_index", "num_mismatched", "num_nan", "num_inf")
    for a, b in zip(one, other):
        if any(a.get(name) != b.get(name) for name in exact):
            return False
        for name in ("error", "abs_error", "max_abs_diff", "max_rel_diff"):
            x, y = a.get(name), b.get(name)
            if isinstance(x, float) and isinstance(y, float) and abs(x - y) > 1e-9 * max(abs(x), abs(y)):
                return False
    return True


def render(timing: dict, workers_2: dict, num_bytes: int, setup: str, same: dict[str, bool]) -> str:
    mb, median = num_bytes / 1e6, timing["median"]
    plain_s = median["plain"]
    num_rounds = len(timing["rounds"]["plain"])
    lines = [f"# Compare throughput ({setup})", "",
             f"Tensor bytes of both runs: {mb:.0f} MB. Plain h5py reading every dataset once: {plain_s:.2f} s "
             f"({mb / plain_s:.0f} MB/s). Target: compare at >= 60% of that rate. Medians of {num_rounds} interleaved "
             "rounds (each round: plain read, then every measure below), so a drift of the shared machine's speed "
             "slows every measure of a round alike.", "",
             "| measure | seconds | MB/s | share of plain h5py |", "|---|---|---|---|",
             f"| plain h5py read | {plain_s:.2f} | {mb / plain_s:.0f} | 100% |"]
    labels = {"cli": "`ttrace compare --workers 1` (starting Python and importing torch included)",
              "in-process": "`compare_runs` after imports (indexing included)",
              "indexing": "of which indexing both runs (RunReader.__init__)"}
    for name, seconds in median.items():
        if name == "plain":
            continue
        tree, kind = name.rsplit(" ", 1)
        lines.append(f"| {tree}: {labels[kind]} | {seconds:.2f} | {mb / seconds:.0f} | {plain_s / seconds:.0%} |")
    for tree, seconds in timing.get("default_threads", {}).items():
        lines.append(f"| {tree}: `ttrace compare --workers 1` with the default thread counts (no OMP_NUM_THREADS; "
                     f"{os.cpu_count()} threads), once | {seconds:.2f} | {mb / seconds:.0f} | {plain_s / seconds:.0%} |")
    if "before cli" in median:
        lines += ["", f"Speed-up in the same rounds: CLI {median['before cli'] / median['after cli']:.2f}x, "
                  f"in-process {median['before in-process'] / median['after in-process']:.2f}x; comparing alone "
                  f"(in-process minus indexing) {(median['before in-process'] - median['before indexing']) / (median['after in-process'] - median['after indexing']):.2f}x."]
    lines += ["", f"`--workers 2` (after, once): {workers_2['seconds']:.2f} s, peak RSS {workers_2['peak_rss_mib']:.0f} MiB "
              f"(largest process). " + " ".join(f"{what}: **{'yes' if ok else 'NO'}**." for what, ok in same.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-compare-throughput"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of ttrace (e.g. the main branch) timed as 'before' in the same rounds")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--seq-len", str(args.seq_len),
             "--micro-batches", "4", "--steps", "1"]
    args.work.mkdir(parents=True, exist_ok=True)
    runs = record(args.work, flags)
    num_bytes = dataset_bytes(runs[0]) + dataset_bytes(runs[1])
    plain_read_seconds(runs)  # warm the page cache for every measure alike
    trees = {"before": args.baseline.resolve(), "after": ROOT} if args.baseline else {"after": ROOT}
    timing = measure_rounds(runs, args.work, trees, args.rounds)
    timing["default_threads"] = {name: default_threads_compare(runs, args.work / f"{name}-default-threads.json", root)
                                 for name, root in trees.items()}
    print("default threads: " + ", ".join(f"{k} {v:.2f} s" for k, v in timing["default_threads"].items()), flush=True)
    workers_2 = timed_compare(runs, args.work / "after-workers-2.json", 2)
    table = {name: json.loads((args.work / f"{name}-workers-1.json").read_text())["comparisons"] for name in trees}
    same = {"1-worker and 2-worker tables equal row for row":
            table["after"] == json.loads((args.work / "after-workers-2.json").read_text())["comparisons"]}
    if args.baseline:
        same["before and after give the same rows (statuses, indices, counts; norms within 1e-9)"] = \
            same_verdicts(table["before"], table["after"])
    setup = (f"megatron-core GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, 4 micro-batches; "
             f"1-rank reference vs TP 2 + SP candidate; {os.cpu_count()} cores shared with other work")
    profile = profile_compare(runs)
    text = render(timing, workers_2, num_bytes, setup, same) + "\n" + render_profile(profile, timing["median"]["plain"])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "compare_throughput.md").write_text(text)
    (args.results / "compare_throughput.json").write_text(json.dumps(
        {"setup": setup, "bytes": num_bytes, "timing": timing, "workers_2": workers_2, "same": same,
         "profile": profile, "trees": {name: str(root) for name, root in trees.items()}}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
