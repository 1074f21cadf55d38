"""What starting ranks costs: `ttrace example megatron-gpt` with this code against an earlier checkout, in one run.

Each round runs, for each code, a 1-rank and a TP 2 recording of the 2-layer megatron-core GPT for one step
(`python -m ttrace_core example megatron-gpt --num-layers 2 --steps 1 [--tp 2]`, a new Python each time, as a
user runs it), alternating which code goes first, and measures its wall time and the CPU time the whole machine
spent while it ran (/proc/stat: the ranks and any fork server are not children this process waits for, so their
CPU time is not in its rusage). Medians over the rounds. Run it on an otherwise idle machine: the CPU figure counts
every process. Writes results/rank_start.{md,json}.

    git worktree add /var/tmp/before COMMIT
    python benchmarks/rank_start.py --before /var/tmp/before [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"1 rank": (), "TP 2": ("--tp", "2")}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (every state of /proc/stat's cpu line but idle
    and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


def _commit(code: Path) -> str:
    done = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def timed_recording(code: Path, flags: tuple[str, ...], out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    busy, started = _busy_seconds(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ttrace_core", "example", "megatron-gpt", "--num-layers", "2",
                           "--steps", "1", *flags, "--out", str(out)], cwd=code, env=env, capture_output=True,
                          text=True, timeout=900)
    wall, cpu = time.perf_counter() - started, _busy_seconds() - busy
    assert done.returncode == 0, done.stderr[-3000:]
    return {"wall_s": wall, "cpu_s": cpu}


def measure(before: Path, rounds: int, work: Path) -> list[dict]:
    codes = {"before": before, "after": REPO}
    points = []
    for layout, flags in LAYOUTS.items():
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for round_ in range(rounds + 1):  # the first round warms the page cache and is not counted
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            for name in order:
                timed = timed_recording(codes[name], flags, work / name)
                if round_:
                    runs[name].append(timed)
        median = {name: {key: statistics.median(run[key] for run in runs[name]) for key in ("wall_s", "cpu_s")}
                  for name in runs}
        points.append({"layout": layout, "rounds": rounds, "median": median, "runs": runs,
                       "cpu_ratio": median["before"]["cpu_s"] / median["after"]["cpu_s"],
                       "wall_ratio": median["before"]["wall_s"] / median["after"]["wall_s"]})
        print(json.dumps({k: v for k, v in points[-1].items() if k != "runs"}), flush=True)
    return points


def render(points: list[dict], before: Path, load: tuple[float, float]) -> str:
    lines = ["# Starting ranks: this code against an earlier checkout, in one run", "",
             f"`python benchmarks/rank_start.py --before CHECKOUT`: the checkout at {_commit(before)} (before) and this "
             f"code at {_commit(REPO)} (after, uncommitted changes included), each recording the 2-layer megatron-core "
             "GPT for one step with `ttrace example megatron-gpt` in a new Python, alternating, medians of "
             f"{points[0]['rounds']} rounds. CPU is what the whole machine spent busy while the command ran. "
             f"2 shared cores: 1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end.", "",
             "| layout | wall, before (s) | wall, after (s) | faster | CPU, before (s) | CPU, after (s) | less CPU |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for point in points:
        before_, after = point["median"]["before"], point["median"]["after"]
        lines.append(f"| {point['layout']} | {before_['wall_s']:.1f} | {after['wall_s']:.1f} | {point['wall_ratio']:.2f}x | "
                     f"{before_['cpu_s']:.1f} | {after['cpu_s']:.1f} | {point['cpu_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout (git worktree) of an earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ttrace-rank-start-") as work:
        points = measure(args.before.resolve(), args.rounds, Path(work))
    load = (load_before, os.getloadavg()[0])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "rank_start.json").write_text(json.dumps({"load": load, "before": _commit(args.before),
                                                              "after": _commit(REPO), "points": points}, indent=1))
    (args.results / "rank_start.md").write_text(render(points, args.before, load))


if __name__ == "__main__":
    main()
