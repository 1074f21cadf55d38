"""A tiny Hugging Face model trained with transformers' own tensor parallelism, the way a user writes it.

    torchrun --standalone --nproc-per-node 2 hf_tp_train.py --arch llama --tp 2
    torchrun --standalone --nproc-per-node 4 hf_tp_train.py --arch qwen3_moe --tp 2 --dp 2

The model is built from a small config, saved with save_pretrained (once per rank, into its own
directory: the network only reaches PyPI, and nothing is shared between ranks), then loaded with
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=...))`, which
applies the model's own `base_model_tp_plan` (and FSDP2 over it). Micro-batch m of a step is drawn
from seed m; local micro-batch k of data-parallel rank r is micro-batch k * dp + r.

`--bug NAME:MODULE` (tests only) breaks one module the way a wrong collective would (hf_bugs.py).
"""

import argparse
import os
from pathlib import Path

import torch

import ttrace_core as ttrace

VOCAB, SEQ, BATCH = 128, 32, 2


ARCHITECTURES = {"qwen2": "Qwen2Config", "mistral": "MistralConfig", "olmo2": "Olmo2Config", "phi3": "Phi3Config",
                 "glm4": "Glm4Config", "starcoder2": "Starcoder2Config", "cohere": "CohereConfig", "gpt_oss": "GptOssConfig",
                 "mixtral": "MixtralConfig"}
"""Other decoder families, each with its own `base_model_tp_plan` (benchmarks/thirdparty_transformers_archs.py runs them)."""


def tiny_config(arch: str):
    import transformers
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(intermediate_size=128, **common)
    if arch == "gemma3":  # q_norm and k_norm on the heads transposed in front of the sequence; a sliding layer
        return Gemma3TextConfig(intermediate_size=128, head_dim=16, sliding_window=16, pad_token_id=0, **common)
    if arch in ARCHITECTURES:
        experts = dict(num_local_experts=4, num_experts_per_tok=2) if arch in ("mixtral", "gpt_oss") else {}
        own = dict(head_dim=16, sliding_window=16, intermediate_size=32) if arch == "gpt_oss" else {}
        return getattr(transformers, ARCHITECTURES[arch])(**{"intermediate_size": 128, "pad_token_id": 0, **common,
                                                             **experts, **own})
    return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          head_dim=16, decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=0.01,
                          **common)


def model_dir(root: Path, arch: str) -> Path:
    """This rank's copy of the tiny checkpoint (built from seed 0, the same on every rank)."""
    path = root / f"{arch}-rank{os.environ.get('RANK', '0')}"
    if not (path / "config.json").exists():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(path)
    return path


def batch(micro_batch: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + micro_batch)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=("llama", "gemma3", "qwen3_moe", *ARCHITECTURES), default="llama")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (the model's base_model_ep_plan)")
    parser.add_argument("--ep-implementation", default="auto", help="DistributedConfig.ep_implementation")
    parser.add_argument("--experts", default=None, help="experts_implementation (default: transformers' choice)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--models", default="models")
    parser.add_argument("--bug", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, DistributedConfig

    path = model_dir(Path(args.models).resolve(), args.arch)
    expert_parallel = dict(ep_size=args.ep, ep_implementation=args.ep_implementation) if args.ep > 1 else {}
    distributed = (DistributedConfig(tp_size=args.tp, fsdp_size=args.dp, **expert_parallel)
                   if args.tp * args.dp > 1 else None)
    experts = {"experts_implementation": args.experts} if args.experts else {}
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=distributed, dtype=getattr(torch, args.dtype),
                                                 **experts)
    model.train()
    if args.bug:
        from hf_bugs import inject  # beside this script

        inject(model, args.bug)
    mesh = getattr(model, "_device_mesh", None)
    dp_rank = mesh["fsdp"].get_local_rank() if mesh is not None and args.dp > 1 else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = ttrace.attach(model, optimizer, loss_scale=args.dp / args.micro_batches)
    for step in range(args.steps):
        with session.step(step):
            for local in range(args.micro_batches // args.dp):
                tokens = batch(local * args.dp + dp_rank, step)
                loss = model(input_ids=tokens, labels=tokens).loss
                (loss * args.dp / args.micro_batches).backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
