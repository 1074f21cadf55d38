"""Lightning's `Trainer` under ttrace: does a correct DDP run pass against one process, and is a wrong run caught
(and localized)?

tests/thirdparty/lightning_train.py (a small language model, trained by Lightning itself: its DDP wrapper and
forward redirection, its closure-driven optimizer step, its loss division by `accumulate_grad_batches` and its
gradient clipping; `ttrace.attach_trainer(trainer)` its only ttrace call) is recorded on one process with 4
accumulated batches (the reference) and on 2 DDP processes with 2 each (the candidate; under tensor parallelism,
which shares each batch, with 4), then compared. Each case
below is one candidate against the reference of the same options. Writes results/thirdparty_lightning.{md,json}.

    python benchmarks/thirdparty_lightning.py [--work /var/tmp/ttrace-lightning]
"""

from __future__ import annotations

import platform
from pathlib import Path

from thirdparty_transformers import fresh_work_dir  # beside this script
from trainer_cases import run_cases, write_results

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "thirdparty" / "lightning_train.py"
BUGGY = "blocks.1.mlp"

# (case, options of both runs, the candidate's own options, expected verdict, what it shows)
CASES = [
    ("DDP2, fp32", [], [], "pass", "the DDP wrapper's call kept quiet, gradients after the closure, loss x 1/2"),
    ("DDP2, fp32, shuffled", ["--shuffle"], [], "pass", "an unseeded RandomSampler, dealt by batch"),
    ("DDP2, shuffled, 9 steps over 2 epochs", ["--shuffle", "--steps", "9"], [], "pass",
     "a new shuffle at the second epoch"),
    ("DDP2, bf16-mixed", ["--precision", "bf16-mixed"], [], "pass", "CPU autocast"),
    ("DDP2, bf16-true", ["--precision", "bf16-true"], [], "pass", "bf16 weights"),
    ("ModelParallelStrategy, TP2", ["--tp", "2"], ["--accumulation", "4"], "pass",
     "the MLPs tensor-parallel (DTensor), every batch on both processes, no clipping"),
    ("ModelParallelStrategy, FSDP2", ["--tp", "1"], [], "pass", "fully_shard over 2 processes, no clipping"),
    ("DDP2, one module wrong on process 1", ["--shuffle"], ["--bug", BUGGY], "fail", f"{BUGGY} scaled by 1.01 on process 1"),
]


def main() -> None:
    work = fresh_work_dir(__doc__, Path("/var/tmp/ttrace-lightning"))
    import lightning
    import torch

    rows, minutes = run_cases(work, SCRIPT, CASES)
    results = {"lightning": lightning.__version__, "torch": torch.__version__, "python": platform.python_version(),
               "minutes": minutes, "cases": rows}
    write_results("thirdparty_lightning", results, "Lightning's Trainer under ttrace",
                  f"lightning {results['lightning']}, torch {results['torch']}, python {results['python']}; CPU (gloo), "
                  f"OMP_NUM_THREADS=1, AdamW, gradient clipping at 1.0 (not under ModelParallelStrategy), 2 optimizer steps unless said; "
                  f"{results['minutes']} minutes in all. Script: `tests/thirdparty/lightning_train.py` "
                  "(`ttrace.attach_trainer(trainer)` its only ttrace call). Reference: one process, 4 accumulated "
                  "batches; candidate: 2 processes, DDP unless the case names Lightning's ModelParallelStrategy, 2 accumulated "
                  "batches each (TP2, whose processes share each batch: 4); batch 2. "
                  "Produced by `python benchmarks/thirdparty_lightning.py`.")


if __name__ == "__main__":
    main()
