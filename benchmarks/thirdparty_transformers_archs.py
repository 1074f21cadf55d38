"""Hugging Face Transformers' tensor parallelism on more decoder families: does each family's own
`base_model_tp_plan` pass under ttrace, unchanged, on two ranks against one?

tests/thirdparty/hf_tp_train.py builds each tiny model from its config (2 layers, hidden 64, 4 heads of 16,
2 kv heads), loads it with `DistributedConfig(tp_size=2)` and trains 2 steps of 2 micro-batches with AdamW,
traced by the README's lines only. The families differ in what their plan does: biased q/k/v (Qwen2),
`colwise_gather_output` then `rowwise_split_input` (OLMo 2), fused `qkv_proj` / `gate_up_proj` (Phi-3,
GLM-4), a plan that shards only the embedding (GPT-OSS), `packed_colwise` experts (Mixtral), norms on
heads transposed in front of the sequence (Gemma 3, also run at one micro-batch: at two, transformers'
`replicated_with_grad_allreduce` sums the first micro-batch's norm gradient twice, docs/transformers.md).
Each pair is compared at the fixed fp32 table, then once more after `ttrace estimate --samples 2` of the
reference when it failed there. Writes results/thirdparty_transformers_archs.{md,json}.

    python benchmarks/thirdparty_transformers_archs.py [--work /var/tmp/ttrace-hf-archs]
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from thirdparty_transformers import RESULTS, compare, fresh_work_dir, record, ttrace  # beside this script

# (family: the script's --arch, which builds its tiny config; flags; expected verdict)
CASES = [(family, [], "pass") for family in ("qwen2", "mistral", "olmo2", "phi3", "glm4", "starcoder2", "cohere",
                                              "gpt_oss", "mixtral")] + [
    ("gemma3", ["--micro-batches", "1"], "pass"),
    ("gemma3", [], "fail"),
]


def main() -> None:
    work = fresh_work_dir(__doc__, Path("/var/tmp/ttrace-hf-archs"))
    import torch
    import transformers

    rows = []
    for arch, flags, expected in CASES:
        name = arch + "".join(flags).replace("--micro-batches", "-mb")
        row = {"family": arch, "flags": " ".join(flags), "expected": expected,
               "record_seconds": round(record(work, f"{name}-ref", arch, 1, flags) + record(work, f"{name}-tp2", arch, 2,
                                                                                             ["--tp", "2", *flags]), 1)}
        row["fixed"] = compare(work, f"{name}-ref", f"{name}-tp2")
        if row["fixed"]["verdict"] == "fail":
            done, _ = ttrace(work, "estimate", f"{name}-ref", "--samples", "2")
            row["estimated"] = compare(work, f"{name}-ref", f"{name}-tp2") if done.returncode == 0 else None
        final = row.get("estimated") or row["fixed"]
        row["verdict"] = final["verdict"]
        rows.append(row)
        print(f"{name:16s} fixed {row['fixed']['verdict']} {row['fixed']['passed']}/{row['fixed']['total']}  final "
              f"{final['verdict']} {final['passed']}/{final['total']}  {final['first_divergence'] or ''}", flush=True)
    results = {"transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version(),
               "cases": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "thirdparty_transformers_archs.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "thirdparty_transformers_archs.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    lines = ["# More decoder families under transformers' own tensor parallelism",
             "",
             f"transformers {results['transformers']}, torch {results['torch']}, python {results['python']}, CPU (gloo), "
             "fp32, AdamW, 2 steps of 2 micro-batches unless the flags say otherwise; TP2 by each family's own "
             "`base_model_tp_plan` against the same script on one rank. Produced by "
             "`python benchmarks/thirdparty_transformers_archs.py`.",
             "",
             "| family | flags | expected | fixed fp32 table: passed / total | with `ttrace estimate` | verdict | first divergence |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["cases"]:
        fixed, estimated = row["fixed"], row.get("estimated")
        final = estimated or fixed
        with_estimate = f"{estimated['passed']} / {estimated['total']}" if estimated else "-"
        lines.append(f"| {row['family']} | {row['flags'] or '-'} | {row['expected']} | {fixed['passed']} / {fixed['total']} | "
                     f"{with_estimate} | "
                     f"{row['verdict']} | {final['first_divergence'] or '-'} |")
    lines += ["", "Seconds to record both runs (2 CPU cores, shared machine): "
              + ", ".join(f"{row['family']}{' ' + row['flags'] if row['flags'] else ''} {row['record_seconds']}"
                          for row in results["cases"]) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
