"""torchtitan 0.3.0's own Trainer under ttrace: every layout it runs on CPU, against a one-rank reference.

Each run is torchtitan's real Trainer launched by `python -m ttrace_examples.torchtitan` under
`ttrace record` (llama3's debug model, or qwen3's MoE debug model, from ttrace_examples/torchtitan:
torchtitan's configurations with attention that has a CPU backward and local data), 2 steps of
2 micro-batches of 2 x 256 tokens, chunked loss, selective activation checkpointing, clipping at 1.0.
The MoE model is qwen3_moe_debug cut to 2 of its 8 layers for 1 step (a full 2-step trace is about
10 GB). Per precision a one-rank reference is recorded, then every candidate layout is recorded,
compared, and its trace deleted (the logs and the comparison's JSON stay in --work).

Precisions: fp32 (`--training.mixed_precision_param float32`: torchtitan's default bf16 policy
computes in bf16 through fully_shard even on one rank); bf16-mixed (torchtitan's default: fp32
parameters, bf16 compute through fully_shard's mixed-precision policy; judged at the fixed bf16
tolerances the manifest's observed compute precision selects, no estimate); bf16 (`--training.dtype
bfloat16`: parameters, gradients and optimizer states in bf16; the reference is `ttrace estimate`d).

Writes results/thirdparty_torchtitan.md (and .json): per layout the ranks, the verdict, tensors
passed / total, the largest mismatch ratio and its tensor, seconds to record and compare; a run
torchtitan itself cannot start says why in one line.

    python benchmarks/thirdparty_torchtitan.py [--only NAME ...] [--precision fp32 bf16-mixed bf16]
                                               [--work DIR] [--samples 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

from ttrace_core.format.naming import display_fqn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LAUNCHER = ["-m", "ttrace_examples.torchtitan"]
TRAINING = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--training.global_batch_size", "4"]
STEPS = {"llama3": ["--training.steps", "2"], "qwen3-moe": ["--training.steps", "1"], "deepseek-v3": ["--training.steps", "1"]}
ESTIMATED = ("bf16",)
"""Precisions whose references are `ttrace estimate`d before comparing."""
PRECISION_FLAGS = {"fp32": ["--training.mixed_precision_param", "float32"], "bf16-mixed": [],
                   "bf16": ["--training.dtype", "bfloat16"]}
MODELS = {"llama3": ["--module", "ttrace_examples.torchtitan", "--config", "llama3_debugmodel"],
          "qwen3-moe": ["--module", "ttrace_examples.torchtitan", "--config", "qwen3_moe_debug_2layers"],
          "deepseek-v3": ["--module", "ttrace_examples.torchtitan", "--config", "deepseek_v3_debugmodel"]}
TIMEOUT = 600


@dataclass(kw_only=True, slots=True)
class Layout:
    name: str
    ranks: int
    flags: list[str]
    """torchtitan's own parallelism flags."""
    model: str = "llama3"
    precisions: tuple[str, ...] = ("fp32", "bf16-mixed", "bf16")
    expected: str = "pass"
    """"pass" for a correct layout ttrace must pass; otherwise why it is not expected to."""


LAYOUTS = [
    Layout(name="tp2 (+SP, loss parallel)", ranks=2, flags=["--parallelism.tensor_parallel_degree", "2"]),
    Layout(name="tp2 no SP", ranks=2, flags=["--parallelism.tensor_parallel_degree", "2",
                                             "--parallelism.no-enable_sequence_parallel"], precisions=("fp32",)),
    Layout(name="tp2 full_dtensor", ranks=2, flags=["--parallelism.tensor_parallel_degree", "2",
                                                    "--parallelism.spmd_backend", "full_dtensor"], precisions=("fp32",)),
    Layout(name="fsdp2", ranks=2, flags=["--parallelism.data_parallel_shard_degree", "2"]),
    Layout(name="fsdp2 full_dtensor", ranks=2, flags=["--parallelism.data_parallel_shard_degree", "2",
                                                      "--parallelism.spmd_backend", "full_dtensor"], precisions=("fp32",)),
    Layout(name="tp2 x fsdp2", ranks=4, flags=["--parallelism.data_parallel_shard_degree", "2",
                                               "--parallelism.tensor_parallel_degree", "2"]),
    Layout(name="ddp2", ranks=2, flags=["--parallelism.data_parallel_replicate_degree", "2",
                                        "--parallelism.data_parallel_shard_degree", "1"], precisions=("fp32",)),
    Layout(name="cp2", ranks=2, flags=["--parallelism.context_parallel_degree", "2"], precisions=("fp32",),
           expected="run fails: torch's ring attention has no CPU kernel"),
    Layout(name="pp2 (1F1B)", ranks=2, flags=["--parallelism.pipeline_parallel_degree", "2",
                                              "--parallelism.pipeline_parallel_schedule", "1F1B"], precisions=("fp32",),
           expected="run fails inside torchtitan's pipeline schedule"),
    Layout(name="moe ep2", ranks=2, model="qwen3-moe", flags=["--parallelism.expert_parallel_degree", "2"],
           precisions=("fp32",)),
    Layout(name="moe tp2 x ep2", ranks=2, model="deepseek-v3", precisions=("fp32",),
           flags=["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]),
    Layout(name="moe fsdp2 x ep2", ranks=2, model="deepseek-v3", precisions=("fp32",),
           flags=["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]),
    Layout(name="moe tp2", ranks=2, model="qwen3-moe", flags=["--parallelism.tensor_parallel_degree", "2"],
           precisions=("fp32",)),
]


@dataclass(kw_only=True, slots=True)
class Row:
    layout: str
    model: str
    precision: str
    ranks: int
    expected: str = "pass"
    verdict: str = ""
    passed: int = 0
    total: int = 0
    largest_ratio: float | None = None
    largest_at: str = ""
    first_divergence: str = ""
    record_seconds: float = 0.0
    compare_seconds: float = 0.0
    why: str = ""
    command: list[str] = field(default_factory=list)


def _run(command: list[str], cwd: Path, log: Path, timeout: float = TIMEOUT) -> tuple[int, float]:
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        try:
            code = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\ntimed out after {timeout} s\n")
            code = -1
    return code, time.perf_counter() - started


def _why(log: Path) -> str:
    """The first error a failed run printed (torchtitan's or torch's own), in one line."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in lines
              if re.search(r"(Error|Exception|timed out)\b.*:", line) and "lspci" not in line]
    return errors[0][:300] if errors else (lines[-1][:300] if lines else "no output")


def _record(work: Path, out: str, ranks: int, model: str, precision: str, flags: list[str]) -> tuple[int, float, list[str]]:
    shutil.rmtree(work / out, ignore_errors=True)
    command = ["torchrun", "--standalone", "--nproc-per-node", str(ranks), *LAUNCHER, *MODELS[model], *TRAINING,
               *STEPS[model], *PRECISION_FLAGS[precision], *flags]
    code, seconds = _run([sys.executable, "-m", "ttrace_core", "record", "--out", out, "--timeout", str(TIMEOUT),
                          "--", *command], work, work / f"{out}.log")
    return code, seconds, command


def _compared(work: Path, reference: str, candidate: str, row: Row) -> None:
    code, row.compare_seconds = _run([sys.executable, "-m", "ttrace_core", "compare", reference, candidate, "--json",
                                      f"{candidate}.json"], work, work / f"{candidate}.compare.log")
    result_file = work / f"{candidate}.json"
    if code not in (0, 1) or not result_file.exists():
        row.verdict, row.why = "error", _why(work / f"{candidate}.compare.log")
        return
    result = json.loads(result_file.read_text())
    rows = result["comparisons"]
    row.verdict = "PASSED" if result["passed"] else f"FAILED ({result['verdict']})"
    row.total, row.passed = len(rows), sum(r["status"] == "pass" for r in rows)
    ratios = [(r["ratio"], r["key"]) for r in rows if isinstance(r.get("ratio"), (int, float))]
    if ratios:
        ratio, key = max(ratios, key=lambda item: item[0])
        row.largest_ratio = ratio
        row.largest_at = f"step {key['step']} / {key['phase']} / {display_fqn(key['fqn'])} / {key['slot']}"
    text = (work / f"{candidate}.compare.log").read_text()
    if "first divergence" in text:
        lines = [line for line in text.split("first divergence", 1)[1].splitlines() if line.startswith("FAILED")]
        row.first_divergence = lines[0].split("  -- ")[0].split(None, 3)[-1] if lines else ""


def run(layouts: list[Layout], precisions: list[str], work: Path, samples: int, kept: list[Row]) -> list[Row]:
    """Every row after `kept`; the results files are rewritten after each, so an interrupted run keeps what it
    measured."""
    rows: list[Row] = list(kept)
    started = time.perf_counter()
    for precision in precisions:
        for model in sorted({layout.model for layout in layouts if precision in layout.precisions}):
            reference = f"ref-{model}-{precision}"
            code, seconds, _ = _record(work, reference, 1, model, precision, [])
            print(f"reference {model} {precision}: exit {code} in {seconds:.0f} s", flush=True)
            if code != 0:
                rows += [Row(layout=layout.name, model=model, precision=precision, ranks=layout.ranks,
                             expected=layout.expected, verdict="error",
                             why=f"reference failed: {_why(work / f'{reference}.log')}")
                         for layout in layouts if layout.model == model and precision in layout.precisions]
                continue
            if precision in ESTIMATED or model != "llama3":  # MoE: the grouped experts compute in bf16 (see the docs)
                code, _ = _run([sys.executable, "-m", "ttrace_core", "estimate", reference, "--samples", str(samples)],
                               work, work / f"{reference}.estimate.log", timeout=TIMEOUT * (samples + 1))
                print(f"estimate {reference}: exit {code}", flush=True)
            for layout in layouts:
                if layout.model != model or precision not in layout.precisions:
                    continue
                candidate = re.sub(r"[^a-z0-9]+", "-", f"{layout.name}-{model}-{precision}".lower()).strip("-")
                row = Row(layout=layout.name, model=model, precision=precision, ranks=layout.ranks,
                          expected=layout.expected)
                code, row.record_seconds, row.command = _record(work, candidate, layout.ranks, model, precision, layout.flags)
                if code != 0:
                    row.verdict, row.why = "run failed", _why(work / f"{candidate}.log")
                else:
                    _compared(work, reference, candidate, row)
                shutil.rmtree(work / candidate, ignore_errors=True)  # a MoE trace is about 10 GB
                print(f"{layout.name:28} {precision:10} {row.verdict:32} {row.passed}/{row.total} "
                      f"ratio {row.largest_ratio} {row.why}", flush=True)
                rows = [kept_row for kept_row in rows if (kept_row.layout, kept_row.model, kept_row.precision)
                        != (row.layout, row.model, row.precision)] + [row]
                write_results(rows, time.perf_counter() - started)
    return rows


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"torch": version("torch"), "torchtitan": version("torchtitan"), "python": sys.version.split()[0]}


def write_results(rows: list[Row], seconds: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    found = versions()
    (RESULTS / "thirdparty_torchtitan.json").write_text(json.dumps(
        {"date": date.today().isoformat(), **found, "seconds": round(seconds), "training": TRAINING, "steps": STEPS,
         "rows": [asdict(row) for row in rows]}, indent=1))
    lines = [
        f"# torchtitan {found['torchtitan']}'s Trainer under ttrace",
        "",
        f"torchtitan {found['torchtitan']}, torch {found['torch']}, python {found['python']}; "
        f"{date.today().isoformat()}, 2 CPU cores, gloo, OMP_NUM_THREADS=1; {seconds / 60:.1f} minutes in all. "
        "`python benchmarks/thirdparty_torchtitan.py`. Each candidate is compared with a one-rank reference of the "
        "same precision (bf16-mixed at the fixed bf16 tolerances, bf16 after `ttrace estimate --samples 2`); llama3: "
        "2 steps x 2 micro-batches of 2 x 256 tokens, chunked loss (8 lm_head calls per micro-batch), selective "
        "activation checkpointing, clipping at 1.0; qwen3-moe: its first 2 layers, 1 step; deepseek-v3: its debug model, "
        "1 step. MoE references are estimated (4 samples): torchtitan's grouped experts compute in bf16.",
        "",
        "| layout | model | precision | ranks | expected | verdict | tensors passed | largest ratio (at) | record s | compare s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        at = f" ({row.largest_at})" if row.largest_ratio is not None and row.largest_ratio > 1 else ""
        verdict = row.verdict if not row.why else f"{row.verdict}: {row.why}"
        lines.append(f"| {row.layout} | {row.model} | {row.precision} | {row.ranks} | {row.expected} | {verdict} | "
                     f"{row.passed}/{row.total} | {_ratio(row.largest_ratio)}{at} | {row.record_seconds:.0f} | "
                     f"{row.compare_seconds:.0f} |")
    failing = [row for row in rows if row.first_divergence]
    if failing:
        lines += ["", "First divergence of each failing comparison:", ""]
        lines += [f"- {row.layout} {row.precision}: `{row.first_divergence}`" for row in failing]
    (RESULTS / "thirdparty_torchtitan.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="layout names (as in the table) to run; default every one")
    parser.add_argument("--precision", nargs="*", default=list(PRECISION_FLAGS), choices=list(PRECISION_FLAGS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-torchtitan-benchmark"))
    parser.add_argument("--samples", type=int, default=2, help="`ttrace estimate` samples for bf16 references")
    args = parser.parse_args()
    layouts = [layout for layout in LAYOUTS if not args.only or layout.name in args.only]
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    kept = []
    if args.only and (RESULTS / "thirdparty_torchtitan.json").exists():  # re-run some rows, keep the others
        kept = [Row(**row) for row in json.loads((RESULTS / "thirdparty_torchtitan.json").read_text())["rows"]]
    rows = run(layouts, args.precision, args.work, args.samples, kept)
    write_results(rows, time.perf_counter() - started)
    print(f"wrote {RESULTS / 'thirdparty_torchtitan.md'}")


if __name__ == "__main__":
    main()
