"""A tiny Llama trained with gradient accumulation over micro-batches of unequal numbers of label tokens,
normalized the way transformers' Trainer does since https://github.com/huggingface/transformers/pull/34191
("Fix Gradient Accumulation issue"), or the way it did before (`--normalization micro-batch-mean`).

    torchrun --standalone --nproc-per-node 2 hf_grad_accum_train.py --tp 2 [--normalization micro-batch-mean]

Since the fix the Trainer counts the step's label tokens (`num_items_in_batch`) and hands them to the
model's loss (transformers' `ForCausalLMLoss` -> `fixed_cross_entropy`, which then sums and divides by
them), and no longer divides by the accumulation steps: every token weighs the same in the step's
gradient. Before it, each micro-batch's loss was the model's mean over its own tokens, divided by the
accumulation steps: a token of a short micro-batch weighed more. The two agree when every micro-batch
has as many label tokens (`--equal-labels`). The model comes from hf_tp_train.py (seeded config,
saved once per rank); micro-batch m's last labels are masked (-100) by an amount that depends on m.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "thirdparty"))  # hf_tp_train.py

import ttrace_core as ttrace  # noqa: E402
from hf_tp_train import SEQ, batch, model_dir  # noqa: E402

IGNORE = -100


def labels_of(tokens: torch.Tensor, micro_batch: int, equal: bool) -> torch.Tensor:
    """Micro-batch 0 keeps 27 label tokens a row, micro-batch 1 keeps 15 (after the model's shift)."""
    labels = tokens.clone()
    labels[:, SEQ - (4 if equal else 4 + 12 * (micro_batch % 2)):] = IGNORE
    return labels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--models", default="models")
    parser.add_argument("--normalization", choices=("global-tokens", "micro-batch-mean"), default="global-tokens")
    parser.add_argument("--equal-labels", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, DistributedConfig

    path = model_dir(Path(args.models).resolve(), "llama")
    distributed = DistributedConfig(tp_size=args.tp) if args.tp > 1 else None
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=distributed, dtype=getattr(torch, args.dtype))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The backward root is a micro-batch's mean loss / micro-batches for equal token counts, whichever the normalization.
    session = ttrace.attach(model, optimizer, loss_scale=1 / args.micro_batches)
    for step in range(args.steps):
        with session.step(step):
            micro_batches = [(tokens, labels_of(tokens, m, args.equal_labels))
                             for m, tokens in ((m, batch(m, step)) for m in range(args.micro_batches))]
            num_items = sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in micro_batches)
            for tokens, labels in micro_batches:
                if args.normalization == "global-tokens":  # the Trainer since #34191
                    loss = model(input_ids=tokens, labels=labels, num_items_in_batch=num_items).loss
                else:  # the Trainer before #34191: the model's mean loss, divided by the accumulation steps
                    loss = model(input_ids=tokens, labels=labels).loss / args.micro_batches
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
