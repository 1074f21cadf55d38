"""What storing a step costs the recording side: trace format 5's packs against format 4's dataset per tensor.

Reads rank 0's shards of a recorded run (by default the 8-layer candidate of compare_throughput.py) into memory,
then stores them all, in recording order, the way each format's writer does, interleaved round by round
(medians): format 5 through RunWriter itself (a tensor under OWN_PACK_BYTES copied into the gathering
buffer, a larger one a pack of its own, the index at the step's end); format 4 as its writer stored
them, one contiguous dataset per tensor through HDF5's low-level API (writer.py's `_write_dataset`),
the same index at the end. The statistics and the hooks are the same for both and are not in the
figure: only the storage the format chose. Writes results/pack_writing.{md,json}.

    python benchmarks/pack_writing.py [--run /var/tmp/ttrace-compare-throughput/candidate] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import h5py
import numpy as np

from ttrace_core.format.reader import RunReader, dataset_path
from ttrace_core.format.tensor_index import TENSOR_INDEX, row_line
from ttrace_core.format.writer import RunWriter, _write_dataset, array_from_tensor

RESULTS = Path(__file__).parent / "results"


def load(run: Path) -> list:
    """(meta, value) of every shard with values of rank 0 (one step file), in recording order."""
    with RunReader(run) as reader:
        metas = sorted((m for ms in reader.index.values() for m in ms if not m.stats_only and m.rank == 0),
                       key=lambda m: m.seq)
        return [(meta, reader.read(meta)) for meta in metas]


def format5_seconds(shards: list, out: Path) -> float:
    writer = RunWriter(out, 0)
    started = time.perf_counter()
    writer.begin_step(0)
    for meta, value in shards:
        writer.write(meta, value, deduplicate=False)
    writer.end_step()
    return time.perf_counter() - started


def format4_seconds(shards: list, out: Path) -> float:
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []
    with h5py.File(out / "step.h5", "w") as handle:
        for meta, value in shards:
            path = dataset_path(meta.key)
            _write_dataset(handle, path, array_from_tensor(value))
            rows.append(row_line(path, meta))
        handle.create_dataset(TENSOR_INDEX, data=np.frombuffer(b"\n".join(rows), dtype=np.uint8))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("/var/tmp/ttrace-compare-throughput/candidate"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-pack-writing"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    shards = load(args.run)
    num_bytes = sum(value.numel() * value.element_size() for _, value in shards)
    seconds: dict[str, list[float]] = {"format 4 (a dataset per tensor)": [], "format 5 (packs)": []}
    for index in range(args.rounds):
        order = [("format 4 (a dataset per tensor)", format4_seconds), ("format 5 (packs)", format5_seconds)]
        for name, measure in order if index % 2 == 0 else order[::-1]:
            shutil.rmtree(args.work, ignore_errors=True)
            seconds[name].append(measure(shards, args.work))
        print({name: round(values[-1], 3) for name, values in seconds.items()}, flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = medians["format 5 (packs)"] / medians["format 4 (a dataset per tensor)"]
    lines = ["# Storing a step: format 5's packs against format 4's dataset per tensor", "",
             f"`python benchmarks/pack_writing.py --rounds {args.rounds}`: the {len(shards):,} shards of "
             f"`{args.run}` ({num_bytes / 1e6:.0f} MB, recording order) stored as each format's writer stores them, "
             "interleaved round by round, medians; the statistics and hooks, the same for both, are not in the figure. "
             f"2 shared CPU cores; load average {os.getloadavg()[0]:.1f} when it ended.", "",
             "| format | seconds (median) | MB/s |", "| --- | --- | --- |"]
    lines += [f"| {name} | {median:.3f} | {num_bytes / 1e6 / median:.0f} |" for name, median in medians.items()]
    lines += ["", f"Format 5 stores a step in **{ratio:.2f}x** the time format 4 took (target: at most 1x, "
              f"{'met' if ratio <= 1 else '**not met**'}).", ""]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "pack_writing.md").write_text("\n".join(lines))
    (args.results / "pack_writing.json").write_text(json.dumps({"shards": len(shards), "bytes": num_bytes,
                                                                "seconds": seconds, "medians": medians,
                                                                "ratio": ratio}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
