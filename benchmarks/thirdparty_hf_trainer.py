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

import platform
from pathlib import Path

from thirdparty_transformers import fresh_work_dir  # beside this script
from trainer_cases import run_cases, write_results

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


def main() -> None:
    work = fresh_work_dir(__doc__, Path("/var/tmp/ttrace-hf-trainer"))
    import accelerate
    import torch
    import transformers

    rows, minutes = run_cases(work, SCRIPT, CASES)
    results = {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
               "torch": torch.__version__, "python": platform.python_version(), "minutes": minutes, "cases": rows}
    write_results("thirdparty_hf_trainer", results, "The Hugging Face Trainer under ttrace",
                  f"transformers {results['transformers']}, accelerate {results['accelerate']}, torch {results['torch']}, "
                  f"python {results['python']}; CPU (gloo), OMP_NUM_THREADS=1, AdamW, 2 optimizer steps; "
                  f"{results['minutes']} minutes in all. Script: `tests/thirdparty/hf_trainer_train.py` "
                  "(`ttrace.attach_trainer(trainer)` its only ttrace call). Reference: one process, 4 accumulation steps; "
                  "candidate: DDP on 2 processes, 2 each; per-device batch 2, labels padded to varying lengths. "
                  "Produced by `python benchmarks/thirdparty_hf_trainer.py`.")


if __name__ == "__main__":
    main()
