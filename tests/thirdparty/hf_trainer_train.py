"""A tiny Llama trained by the Hugging Face `transformers.Trainer`, the way a user writes it, with one ttrace line.

    python hf_trainer_train.py --accumulation 4                                          # the reference
    torchrun --standalone --nproc-per-node 2 hf_trainer_train.py --accumulation 2       # DDP (accelerate, gloo)

The Trainer builds the optimizer, wraps the model in DDP, draws the batches (one seeded sampler; accelerate hands
batch k x P + p to process p of P) and normalizes the loss by the step's token count. Each example's labels end in
a run of ignored padding (-100) of its own length, so the token counts of micro-batches and processes differ.
`--local-tokens` sets `average_tokens_across_devices=False`: each process then divides by its own token count,
which makes its gradients differ from one process's (the Trainer's documented reason for the default).
`--arch qwen3_moe` trains a tiny Qwen3-MoE (router aux loss on); `--gradient-checkpointing`, `--label-smoothing F`,
`--bf16` and `--compile BACKEND` (torch_compile with that backend) are the Trainer's own options. `--bug MODULE` (tests only, not what a user writes) makes process 1 scale MODULE's output by 1.01.
"""

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig, Trainer, TrainingArguments

import ttrace_core as ttrace

VOCAB, SEQ = 128, 32


class Examples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        input_ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        labels = input_ids.clone()
        labels[SEQ - int(torch.randint(0, SEQ // 2, (1,), generator=generator)):] = -100
        return {"input_ids": input_ids, "labels": labels}


def tiny_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(intermediate_size=128, **common)
    return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          head_dim=16, decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=0.01,
                          **common)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--local-tokens", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--arch", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--compile", default=None, metavar="BACKEND")
    parser.add_argument("--bug", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(args.arch))
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    training = TrainingArguments(output_dir="trainer-output", per_device_train_batch_size=2,
                                 gradient_accumulation_steps=args.accumulation, max_steps=args.steps,
                                 learning_rate=1e-3, max_grad_norm=1.0, use_cpu=True, bf16=args.bf16, seed=0,
                                 gradient_checkpointing=args.gradient_checkpointing,
                                 label_smoothing_factor=args.label_smoothing,
                                 average_tokens_across_devices=not args.local_tokens, report_to=[],
                                 save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                                 ddp_backend="gloo" if distributed else None,
                                 torch_compile=args.compile is not None, torch_compile_backend=args.compile)
    if args.bug and int(os.environ.get("RANK", "0")) == 1:
        model.get_submodule(args.bug).register_forward_hook(lambda module, inputs, output: output * 1.01)
    trainer = Trainer(model=model, args=training, train_dataset=Examples())
    ttrace.attach_trainer(trainer)
    trainer.train()


if __name__ == "__main__":
    main()
