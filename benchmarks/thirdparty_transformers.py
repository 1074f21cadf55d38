"""Hugging Face Transformers' own tensor parallelism under ttrace: does a correct run pass, and is a
wrong collective caught and localized?

tests/thirdparty/hf_tp_train.py (a tiny Llama and a tiny Qwen3-MoE built from config, loaded with
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=2[, fsdp_size=2]))`, AdamW, two
steps, traced with the README's lines only) is recorded on one rank (the reference) and on 2 or 4
ranks (TP2, TP2 x FSDP2), then compared. Also: TP2 with two micro-batches per step (gradient
accumulation) on the MoE model, and a rowwise module whose all-reduce TP rank 1 drops, then
localized. Writes results/thirdparty_transformers.{md,json}.

    python benchmarks/thirdparty_transformers.py [--work /var/tmp/ttrace-hf]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from ttrace_core.format.schema import TensorKey

RESULTS = Path(__file__).parent / "results"
SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "thirdparty" / "hf_tp_train.py"
BUGGY = "model.layers.1.mlp.down_proj"

# (name, arch, ranks, flags, reference, expected verdict, what it shows)
CASES = [
    ("dense TP2", "llama", 2, ["--tp", "2"], "llama-ref", "pass", "colwise / rowwise / act_fn between them"),
    ("dense TP2 x FSDP2", "llama", 4, ["--tp", "2", "--dp", "2"], "llama-ref", "pass", "2-D mesh, DTensor params"),
    ("MoE TP2", "qwen3_moe", 2, ["--tp", "2", "--micro-batches", "1"], "moe-ref-1mb", "pass",
     "q_norm/k_norm on a view, packed experts, aux loss"),
    ("MoE TP2 x FSDP2", "qwen3_moe", 4, ["--tp", "2", "--dp", "2"], "moe-ref", "pass", "one micro-batch per rank"),
    ("MoE TP2, 2 micro-batches", "qwen3_moe", 2, ["--tp", "2"], "moe-ref", "fail",
     "transformers all-reduces q_norm/k_norm grads at every accumulation"),
    ("dense TP2, dropped all-reduce", "llama", 2, ["--tp", "2", "--bug", f"skip-reduction:{BUGGY}"], "llama-ref",
     "fail", f"TP rank 1 keeps its partial sum in {BUGGY}"),
]
REFERENCES = {"llama-ref": ("llama", []), "moe-ref": ("qwen3_moe", []), "moe-ref-1mb": ("qwen3_moe", ["--micro-batches", "1"])}


def fresh_work_dir(doc: str, default: Path) -> Path:
    """`--work DIR` (default `default`), emptied: a benchmark's command line (thirdparty_hf_trainer.py too)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=default)
    work = parser.parse_args().work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def ttrace(work: Path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m ttrace_core ARGS` in `work` (one thread per process) and its seconds (thirdparty_hf_trainer.py too)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ttrace_core", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done, time.perf_counter() - started


def record(work: Path, name: str, arch: str, ranks: int, flags: list[str]) -> float:
    command = ["torchrun", "--standalone", "--nproc-per-node", str(ranks), str(SCRIPT), "--arch", arch, *flags]
    done, seconds = ttrace(work, "record", "--out", name, "--timeout", "600", "--", *command)
    if done.returncode != 0:
        raise RuntimeError(f"record {name} failed: {done.stderr[-2000:]}")
    return seconds


def compare(work: Path, reference: str, candidate: str) -> dict:
    """`ttrace compare` of two runs in `work`: verdict, tensors passed, largest ratio, first divergence."""
    report = work / f"{candidate}-vs-{reference}.json"
    done, seconds = ttrace(work, "compare", reference, candidate, "--json", str(report))
    if done.returncode not in (0, 1):
        raise RuntimeError(f"compare {candidate} failed: {done.stderr[-1500:]}")
    rows = json.loads(report.read_text())["comparisons"]
    ratios = [row["ratio"] for row in rows if isinstance(row.get("ratio"), (int, float)) and math.isfinite(row["ratio"])]
    first = next((row for row in rows if row["status"] != "pass"), None)
    key = first["key"] if first else None
    return {"exit_code": done.returncode, "verdict": "pass" if done.returncode == 0 else "fail",
            "passed": sum(row["status"] == "pass" for row in rows), "total": len(rows),
            "largest_ratio": max(ratios, default=0.0), "compare_seconds": round(seconds, 1),
            "first_divergence": None if key is None else
            f"{msgspec.convert(key, TensorKey)} ({first['status']}, ratio {first['ratio']:.3g})"}


def main() -> None:
    work = fresh_work_dir(__doc__, Path("/var/tmp/ttrace-hf"))
    import torch
    import transformers

    rows, record_seconds = [], {}
    for name, (arch, flags) in REFERENCES.items():
        record_seconds[name] = round(record(work, name, arch, 1, flags), 1)
    for index, (name, arch, ranks, flags, reference, expected, shows) in enumerate(CASES):
        candidate = f"case{index}"
        seconds = record(work, candidate, arch, ranks, flags)
        row = {"case": name, "model": arch, "ranks": ranks, "flags": " ".join(flags), "reference": reference,
               "expected": expected, "shows": shows, "record_seconds": round(seconds, 1), **compare(work, reference, candidate)}
        if "--bug" in flags:
            done, localize_seconds = ttrace(work, "localize", reference, candidate, "--json", "localize.json")
            row["localized"] = json.loads((work / "localize.json").read_text())["culprits"] if done.returncode in (0, 1) else None
            row["localize_seconds"] = round(localize_seconds, 1)
        rows.append(row)
        print(f"{name:34s} {row['verdict']:5s} {row['passed']}/{row['total']}  largest ratio {row['largest_ratio']:.3g}"
              f"  {row['first_divergence'] or ''} {row.get('localized') or ''}", flush=True)
    # AdamW turns round-off in small gradients into a full step: with the perturbation estimate instead of the
    # fixed fp32 tolerance, the post-step parameters are judged on what round-off really does.
    done, estimate_seconds = ttrace(work, "estimate", "moe-ref", "--samples", "2")
    estimated = None
    if done.returncode == 0:
        moe_fsdp = next(i for i, case in enumerate(CASES) if case[0] == "MoE TP2 x FSDP2")
        estimated = {"case": "MoE TP2 x FSDP2, with `ttrace estimate`", **compare(work, "moe-ref", f"case{moe_fsdp}"),
                     "estimate_seconds": round(estimate_seconds, 1)}
    results = {"transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version(),
               "reference_record_seconds": record_seconds, "cases": rows, "with_estimate": estimated}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "thirdparty_transformers.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "thirdparty_transformers.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    lines = [f"# Hugging Face Transformers' tensor parallelism under ttrace",
             "",
             f"transformers {results['transformers']}, torch {results['torch']}, CPU (gloo), fp32, AdamW, 2 steps. "
             "Script: `tests/thirdparty/hf_tp_train.py` (the README's lines, no declaration). Reference: the same script "
             "on one rank. Produced by `python benchmarks/thirdparty_transformers.py`.",
             "",
             "| case | ranks | expected | verdict | tensors passed / total | largest ratio | first divergence | localized |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["cases"] + ([results["with_estimate"]] if results["with_estimate"] else []):
        lines.append(f"| {row['case']} | {row.get('ranks', 4)} | {row.get('expected', 'pass')} | {row['verdict']} | "
                     f"{row['passed']} / {row['total']} | {row['largest_ratio']:.3g} | {row['first_divergence'] or '-'} | "
                     f"{', '.join(row['localized']) if row.get('localized') else '-'} |")
    lines += ["", "Ratio: error / tolerance (1 is the pass line; for a failed row, the failing tensors' own). "
              "Timings (seconds, 2 CPU cores, shared machine): " + ", ".join(
                  f"{row['case']}: record {row['record_seconds']}" + (f", localize {row['localize_seconds']}" if 'localize_seconds' in row else "")
                  for row in results["cases"]) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
