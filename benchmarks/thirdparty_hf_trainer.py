"""The Hugging Face `transformers.Trainer` under ttrace: does a correct DDP run pass against one process, and is a
wrong run caught (and localized)?

tests/thirdparty/hf_trainer_train.py (a tiny Llama or Qwen3-MoE from config, trained by the Trainer itself: its
optimizer, accelerate's DDP and batch sharding, its token-count loss normalization; labels padded to varying
lengths; `ttrace.attach_trainer(trainer)` its only ttrace call) is recorded on one process with 4 accumulation steps
(the reference) and on 2 DDP processes with 2 each (the candidate), 2 optimizer steps, then compared. Each case
below is one candidate against the reference of the same model and options. Writes
results/thirdparty_hf_trainer.{md,json}.

    python benchmarks/thirdparty_hf_trainer.py [--work /var/tmp/ttrace-hf-trainer]
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from thirdparty_transformers import compare, fresh_work_dir, ttrace  # beside this script

RESULTS = Path(__file__).parent / "results"
SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "thirdparty" / "hf_trainer_train.py"
BUGGY = "model.layers.1.mlp.down_proj"

# (case, options of both runs, the candidate's own options, expected verdict, what it shows)
CASES = [
    ("DDP2, fp32", [], [], "pass", "optimizer inside AcceleratedOptimizer, batch k x 2 + p, loss x 2"),
    ("DDP2, bf16", ["--bf16"], [], "pass", "bf16=True: CPU autocast"),
    ("DDP2, Qwen3-MoE", ["--arch", "qwen3_moe"], [], "pass", "routed experts, router aux loss"),
    ("DDP2, gradient checkpointing", ["--gradient-checkpointing"], [], "pass", "recomputed forwards"),
    ("DDP2, label smoothing", ["--label-smoothing", "0.1"], [], "pass", "the Trainer's loss, outside the model"),
    ("DDP2, average_tokens_across_devices=False", [], ["--local-tokens"], "fail",
     "each process divides by its own token count"),
    ("DDP2, one module wrong on process 1", [], ["--bug", BUGGY], "fail", f"{BUGGY} scaled by 1.01 on process 1"),
]


def record(work: Path, name: str, processes: int, flags: list[str]) -> float:
    launcher = [sys.executable] if processes == 1 else ["torchrun", "--standalone", "--nproc-per-node", str(processes)]
    accumulation = str(4 // processes)
    done, seconds = ttrace(work, "record", "--out", name, "--timeout", "600", "--", *launcher, str(SCRIPT),
                           "--accumulation", accumulation, *flags)
    if done.returncode != 0:
        raise RuntimeError(f"record {name} failed: {done.stderr[-2000:]}")
    return seconds


def main() -> None:
    work = fresh_work_dir(__doc__, Path("/var/tmp/ttrace-hf-trainer"))
    import accelerate
    import torch
    import transformers

    started = time.perf_counter()
    references: dict[tuple[str, ...], str] = {}
    rows = []
    for index, (name, shared, own, expected, shows) in enumerate(CASES):
        if tuple(shared) not in references:
            references[tuple(shared)] = reference = f"reference{len(references)}"
            record(work, reference, 1, shared)
        reference = references[tuple(shared)]
        candidate = f"case{index}"
        seconds = record(work, candidate, 2, shared + own)
        row = {"case": name, "flags": " ".join(shared + own), "expected": expected, "shows": shows,
               "record_seconds": round(seconds, 1), **compare(work, reference, candidate)}
        if "--bug" in own:
            row["broken_module"] = own[own.index("--bug") + 1]
            done, localize_seconds = ttrace(work, "localize", reference, candidate, "--json", "localize.json")
            row["localized"] = (json.loads((work / "localize.json").read_text())["culprits"]
                                if done.returncode in (0, 1) else None)
            row["localize_seconds"] = round(localize_seconds, 1)
        rows.append(row)
        print(f"{name:44s} {row['verdict']:5s} {row['passed']}/{row['total']}  largest ratio {row['largest_ratio']:.3g}"
              f"  {row['first_divergence'] or ''} {row.get('localized') or ''}", flush=True)
    results = {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
               "torch": torch.__version__, "python": platform.python_version(),
               "minutes": round((time.perf_counter() - started) / 60, 1), "cases": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "thirdparty_hf_trainer.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "thirdparty_hf_trainer.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    lines = ["# The Hugging Face Trainer under ttrace",
             "",
             f"transformers {results['transformers']}, accelerate {results['accelerate']}, torch {results['torch']}, "
             f"python {results['python']}; CPU (gloo), OMP_NUM_THREADS=1, AdamW, 2 optimizer steps; "
             f"{results['minutes']} minutes in all. Script: `tests/thirdparty/hf_trainer_train.py` "
             "(`ttrace.attach_trainer(trainer)` its only ttrace call). Reference: one process, 4 accumulation steps; "
             "candidate: DDP on 2 processes, 2 each; per-device batch 2, labels padded to varying lengths. "
             "Produced by `python benchmarks/thirdparty_hf_trainer.py`.",
             "",
             "| case | expected | verdict | tensors passed / total | largest ratio | first divergence | localized |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["cases"]:
        lines.append(f"| {row['case']} | {row['expected']} | {row['verdict']} | {row['passed']} / {row['total']} | "
                     f"{row['largest_ratio']:.3g} | {row['first_divergence'] or '-'} | "
                     f"{', '.join(row['localized']) if row.get('localized') else '-'} |")
    lines += ["", "Ratio: error / tolerance (1 is the pass line; for a failed row, the failing tensors' own). "
              "Timings (seconds, 2 shared CPU cores): " + ", ".join(
                  f"{row['case']}: record {row['record_seconds']}, compare {row['compare_seconds']}"
                  + (f", localize {row['localize_seconds']}" if "localize_seconds" in row else "")
                  for row in results["cases"]) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
