"""Replay cost: one layer replayed alone against the whole-model localize of the same pair.

Records a megatron-gpt reference and a TP2 candidate with `row-parallel-bias-per-rank` for each
model depth, then times, as fresh jobs (`ttrace localize --rerun`):
- the whole-model localize (every module of the model fed the reference's inputs);
- the replay of `decoder.layers.0` alone (module_replay.py: only that layer runs);
and splits each into the stages the job logs (`[progress] ... (t=...)`): comparing the pair, the
replay itself (process start, imports, model build, compute, writing the trace) and judging. The
bare cost of starting a rank with megatron imported is measured on its own. Writes
results/replay.{md,csv}.

    python benchmarks/replay.py [--layers 2 8] [--workdir /tmp/ttrace-bench-replay]
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYER = "decoder.layers.0"
_STAGE = re.compile(r"^\[progress\] (\d)/3 .*\(t=([\d.]+) s\)$|^\[progress\] done \(t=([\d.]+) s\)$")


def _ttrace(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ttrace_core", *args], capture_output=True, text=True, env=env)


def _record(workdir: Path, num_layers: int) -> tuple[Path, Path]:
    reference, candidate = workdir / f"L{num_layers}" / "ref", workdir / f"L{num_layers}" / "cand"
    for out, flags in ((reference, []), (candidate, ["--tp", "2", "--bug", "row-parallel-bias-per-rank"])):
        if not (out / "manifest.json").exists():
            result = _ttrace("example", "megatron-gpt", "--num-layers", str(num_layers), *flags, "--out", str(out))
            if result.returncode != 0:
                raise SystemExit(f"recording {out} failed:\n{result.stderr[-2000:]}")
    return reference, candidate


def _stages(log: str) -> dict[str, float]:
    """Seconds per stage from the job log's progress timestamps."""
    marks = {}
    for line in log.splitlines():
        if match := _STAGE.match(line.strip()):
            stage = match.group(1) or "done"
            marks[stage] = float(match.group(2) or match.group(3))
    replay_start = marks.get("2", marks.get("3", 0.0))
    return {"compare": replay_start, "replay": marks.get("3", 0.0) - replay_start,
            "judge": marks.get("done", 0.0) - marks.get("3", 0.0)}


def _localize(reference: Path, candidate: Path, module: str | None) -> dict:
    from ttrace_core.api import submit_replay

    started = time.perf_counter()
    job = submit_replay(reference, candidate, module, rerun=True)
    status = job.wait()
    seconds = time.perf_counter() - started
    log = job.log_path.read_text()
    scope = re.search(r"\((only the module ran|the whole model ran)", log)
    return {"seconds": seconds, "state": status.state, "exit_code": status.exit_code, **_stages(log),
            "scope": scope.group(1) if scope else "?"}


def _rank_start_seconds() -> float:
    """A fresh interpreter importing torch, megatron-core and the example (what every replay rank pays)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import ttrace_examples.megatron_gpt.train, megatron.core.models.gpt"],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - started


def main() -> None:
    from ttrace_core import api

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ttrace-bench-replay"))
    args = parser.parse_args()
    rank_start = _rank_start_seconds()
    rows = []
    for num_layers in args.layers:
        reference, candidate = _record(args.workdir, num_layers)
        api.comparison_table(reference, candidate)  # both replays then read the cached comparison
        whole, layer = _localize(reference, candidate, None), _localize(reference, candidate, LAYER)
        rows.append({"layers": num_layers, "whole_s": whole["seconds"], "layer_s": layer["seconds"],
                     "ratio": layer["seconds"] / whole["seconds"],
                     **{f"whole_{k}": whole[k] for k in ("compare", "replay", "judge", "exit_code", "scope")},
                     **{f"layer_{k}": layer[k] for k in ("compare", "replay", "judge", "exit_code", "scope")}})
        print(rows[-1], flush=True)
    _write(rows, rank_start)


def _write(rows: list[dict], rank_start: float) -> None:
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "replay.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# Replay: one layer alone against the whole-model localize",
        "",
        f"`python benchmarks/replay.py` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}. megatron-gpt "
        "(hidden 64, 4 micro-batches), reference on 1 process, candidate TP2 with `row-parallel-bias-per-rank`; every "
        "replay is a fresh `ttrace localize` job (`--rerun`), timed from submission to its verdict, with the pair's "
        "comparison table already cached (the first comparison is the dashboard benchmark's). Goal: the layer "
        "replay takes at most half the time of the whole-model localize.",
        "",
        "| layers | whole model (s) | `decoder.layers.0` alone (s) | ratio | goal (<= 0.5) | whole: compare / replay / judge (s) | layer: compare / replay / judge (s) | verdicts (exit) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['whole_s']:.1f} | {r['layer_s']:.1f} | {r['ratio']:.2f} | "
            f"{'met' if r['ratio'] <= 0.5 else 'missed'} | {r['whole_compare']:.1f} / {r['whole_replay']:.1f} / "
            f"{r['whole_judge']:.1f} | {r['layer_compare']:.1f} / {r['layer_replay']:.1f} / {r['layer_judge']:.1f} | "
            f"{r['whole_exit_code']} / {r['layer_exit_code']} ({r['layer_scope']}) |")
    lines += ["", f"Where the time goes: a replay rank starts a fresh interpreter and imports torch and megatron-core "
              f"({rank_start:.1f} s measured alone), builds and initializes the model, then computes. The layer replay "
              "skips the other layers' compute, the loss, the reduction and the optimizer, and writes and judges only "
              "the layer's tensors; process start and the model build are paid by both. The compare stage reads the "
              "cached comparison table.", ""]
    (RESULTS / "replay.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
