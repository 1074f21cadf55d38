"""Cost of recording: step time, trace size and compare time for the example GPT on one CPU rank.

Runs a training step of the torch-gpt workload (4 layers, d_model 256, seq 128, 4 micro-batches of
4 sequences) without a tracer, with full recording and in stats-only mode, then times
`compare_runs` on the full trace against itself. Writes results/recording_overhead.{md,csv}.

    OMP_NUM_THREADS=2 python benchmarks/recording_overhead.py [--steps 5]
"""

from __future__ import annotations

import argparse
import csv
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ttrace_core.compare import compare_runs
from ttrace_core.examples.torch_gpt.model import GPT, GPTConfig, loss_fn
from ttrace_core.examples.torch_gpt.train import TorchGPTRunConfig, init_weights, micro_batch
from ttrace_core.store import RunReader
from ttrace_core.tracer import Tracer, TracerConfig

RESULTS = Path(__file__).parent / "results"


def _step(run: TorchGPTRunConfig, model, optimizer) -> None:
    optimizer.zero_grad()
    for index in range(run.num_micro_batches):
        inputs, targets = micro_batch(run, index)
        (loss_fn(model(inputs), targets) / run.num_micro_batches).backward()
    optimizer.step()


def measure(run: TorchGPTRunConfig, mode: str, out: Path, num_steps: int) -> dict:
    model = GPT(run.model)
    init_weights(model, run.seed, torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr)
    tracer = None
    if mode != "no tracer":
        config = TracerConfig(exclude=("",), loss_scale=1 / run.num_micro_batches, stats_only=mode == "stats-only")
        tracer = Tracer(out, model, role="reference", optimizer=optimizer, config=config)
    times = []
    for step in range(num_steps + 1):  # step 0 warms up
        start = time.perf_counter()
        if tracer is None:
            _step(run, model, optimizer)
        else:
            with tracer.step(step):
                _step(run, model, optimizer)
        times.append(time.perf_counter() - start)
    size = sum(p.stat().st_size for p in out.glob("*.h5")) / (num_steps + 1) if tracer else 0
    if tracer:
        tracer.close()
    return {"mode": mode, "ms_per_step": 1000 * sorted(times[1:])[len(times[1:]) // 2], "mib_per_step": size / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    model = GPTConfig(vocab_size=1000, seq_len=128, d_model=256, num_heads=4, num_layers=4)
    run = TorchGPTRunConfig(model=model, micro_batch_size=4, num_micro_batches=4)
    scratch = Path(tempfile.mkdtemp(prefix="ttrace-bench-"))
    try:
        rows = [measure(run, mode, scratch / mode.replace(" ", "-"), args.steps) for mode in ("no tracer", "full", "stats-only")]
        base = rows[0]["ms_per_step"]
        for row in rows:
            row["overhead"] = row["ms_per_step"] / base
        with RunReader(scratch / "full") as reader:
            start = time.perf_counter()
            result = compare_runs(reader, reader)
            compare_s = time.perf_counter() - start
        rows.append({"mode": f"compare full trace ({len(result.comparisons)} tensors, {len(result.steps_compared)} steps)",
                     "ms_per_step": 1000 * compare_s / len(result.steps_compared), "mib_per_step": 0.0, "overhead": float("nan")})
    finally:
        shutil.rmtree(scratch)
    _write(rows, f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.steps} steps after 1 warm-up")


def _ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"  # NaN: not a recording mode


def _write(rows: list[dict], setup: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "recording_overhead.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# Recording overhead ({setup})", "", "| mode | ms/step | overhead | MiB/step |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['ms_per_step']:.0f} | {_ratio(r['overhead'])} | {r['mib_per_step']:.1f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (RESULTS / "recording_overhead.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
