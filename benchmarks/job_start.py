"""The dashboard's comparison job started cold (a new Python importing torch and the core) against warm
(forked by the warm worker `ttrace dashboard` keeps beside the server, service/warm_worker.py), in one run.

For each pair, each round submits the job the Heatmap page submits (`submit_comparison`, a cleared cache:
the job runs again) once cold and once warm, in alternating order, and times from the submit to the
first streamed rows on disk (what the page draws first) and to the finished table. The worker is started
here as `ttrace dashboard` starts it. Pairs: the megatron-core samples the dashboard opens on
(sample_traces/fp32, reference against tp2_row_parallel_bias) and, if given, any other pair.
Writes results/job_start.{md,json}.

    python benchmarks/job_start.py [--rounds 5] [--pair REF CAND]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ttrace_core.record import warm_client
from ttrace_core.service import warm_worker
from ttrace_core.service.comparison_jobs import submit_comparison

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
SAMPLES = (REPO / "sample_traces" / "fp32" / "reference", REPO / "sample_traces" / "fp32" / "tp2_row_parallel_bias")
POLL_S = 0.01


def _copy(pair: tuple[Path, Path], work: Path) -> tuple[Path, Path]:
    """The pair copied without its caches (each run writes its own)."""
    copies = []
    for index, run in enumerate(pair):
        target = work / f"{index}-{run.name}"
        shutil.copytree(run, target, ignore=shutil.ignore_patterns(".ttrace"))
        copies.append(target)
    return copies[0], copies[1]


def _timed_job(reference: Path, candidate: Path, worker: str) -> dict:
    for run in (reference, candidate):
        shutil.rmtree(run / ".ttrace", ignore_errors=True)
    os.environ[warm_client.WARM_ENV] = worker
    started = time.perf_counter()
    job = submit_comparison(reference, candidate)
    first_rows = None
    while not (status := job.status()).done:
        if first_rows is None and any(job.directory.glob("rows-*.parquet")):
            first_rows = time.perf_counter() - started
        time.sleep(POLL_S)
    finished = time.perf_counter() - started
    assert status.state == "complete", (status, job.log_tail())
    return {"warm": status.warm, "first_rows_s": first_rows if first_rows is not None else finished,
            "table_s": finished}


def measure(pair: tuple[Path, Path], rounds: int, worker: str, work: Path) -> dict:
    reference, candidate = _copy(pair, work)
    cold_path = str(Path(worker).with_name("none.sock"))  # no worker listens there: a new process each time
    _timed_job(reference, candidate, worker)  # page cache and the worker's first fork, not counted
    found: dict[str, list[dict]] = {"cold": [], "warm": []}
    for round_ in range(rounds):
        order = ("cold", "warm") if round_ % 2 == 0 else ("warm", "cold")
        for mode in order:
            timed = _timed_job(reference, candidate, worker if mode == "warm" else cold_path)
            assert timed["warm"] == (mode == "warm"), timed
            found[mode].append(timed)
    median = {mode: {measure: statistics.median(t[measure] for t in found[mode]) for measure in ("first_rows_s", "table_s")}
              for mode in found}
    return {"pair": [str(p) for p in pair], "rounds": rounds, "median": median, "runs": found,
            "saved_first_rows_s": median["cold"]["first_rows_s"] - median["warm"]["first_rows_s"],
            "saved_table_s": median["cold"]["table_s"] - median["warm"]["table_s"]}


def render(points: list[dict], load: tuple[float, float]) -> str:
    lines = ["# Comparison job start: a new process against the dashboard's warm worker", "",
             f"`python benchmarks/job_start.py`: the job the Heatmap page submits (`submit_comparison`, cache cleared), "
             "submitted cold (a new Python that imports torch and the core) and warm (forked by the worker `ttrace "
             "dashboard` starts beside the server, service/warm_worker.py), alternating, in one run; medians. Times "
             "run from the submit to the first streamed rows on disk (what the heatmap draws first) and to the "
             f"finished table. 2 shared cores: 1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end.",
             "", "| pair | rounds | first rows, cold (s) | first rows, warm (s) | saved (s) | table, cold (s) | table, warm (s) | saved (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for point in points:
        cold, warm = point["median"]["cold"], point["median"]["warm"]
        name = " vs ".join(Path(p).name for p in point["pair"])
        lines.append(f"| {name} | {point['rounds']} | {cold['first_rows_s']:.2f} | {warm['first_rows_s']:.2f} | "
                     f"{point['saved_first_rows_s']:.2f} | {cold['table_s']:.2f} | {warm['table_s']:.2f} | "
                     f"{point['saved_table_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pair", nargs=2, action="append", default=None, metavar=("REF", "CAND"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    pairs = [SAMPLES] + [(Path(a), Path(b)) for a, b in (args.pair or [])]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker, _ = warm_worker.start(dict(os.environ))
    deadline = time.monotonic() + 120
    while not os.path.exists(worker):
        assert time.monotonic() < deadline, "the warm worker did not start"
        time.sleep(0.1)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ttrace-job-start-") as work:
        points = []
        for index, pair in enumerate(pairs):
            points.append(measure(pair, args.rounds, worker, Path(work) / str(index)))
            print(json.dumps({k: v for k, v in points[-1].items() if k != "runs"}), flush=True)
    load = (load_before, os.getloadavg()[0])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "job_start.json").write_text(json.dumps({"load": load, "points": points}, indent=1))
    (args.results / "job_start.md").write_text(render(points, load))


if __name__ == "__main__":
    main()
