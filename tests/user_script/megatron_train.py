"""A megatron-core user's training script, as such scripts are usually written: GPTModel with the local
spec, Megatron DDP, the Megatron optimizer (Adam, gradient clipping at 0.05, which engages on every
step), `get_forward_backward_func`, on CPU ranks with gloo under torchrun. megatron_train_traced.py is
this script with ttrace added; a test counts the lines that differ.

    torchrun --nproc-per-node 2 megatron_train.py --tp 2 [--sp] [--pp 2] [--sinks] [--bf16] [--bug module|grad-norm]
"""

import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from ttrace_core.integrations import megatron_cpu

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 128, 16, 2, 4


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--sinks", action="store_true", help="learnable attention sinks (softmax_type='learnable')")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--recompute", action="store_true", help="full activation recompute, one layer at a time")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bug", choices=["module", "grad-norm"])
    return parser.parse_args()


def build(args):
    parallel_state.initialize_model_parallel(args.tp, args.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, sequence_parallel=args.sp,
        bf16=args.bf16, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, softmax_type="learnable" if args.sinks else "vanilla",
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if args.recompute else {}))
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    if args.bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, adam_eps=1e-3, weight_decay=0.0,
                                                       clip_grad=0.05, bf16=args.bf16), [ddp])
    return ddp, optimizer


def inject(bug, ddp, optimizer):
    """The silent bugs a test asks for: a module computing a wrong output on TP rank 1, or a gradient
    norm that leaves TP rank 1's share of the fc1 weights out."""
    if bug is None or parallel_state.get_tensor_model_parallel_rank() != 1:
        return
    if bug == "module":
        fc2 = dict(ddp.named_modules())["module.decoder.layers.1.mlp.linear_fc2"]
        fc2.register_forward_hook(lambda module, args, output: (output[0] * 1.001, output[1]))
    else:
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            # megatron-core 0.19 renamed get_main_grads_for_grad_norm() to get_grads_for_grad_norm(group=None).
            name = next(n for n in ("get_main_grads_for_grad_norm", "get_grads_for_grad_norm") if hasattr(inner, n))
            setattr(inner, name, lambda *args, f=getattr(inner, name): [g for g in f(*args) if g.shape != (128, 64)])


def batches(step):
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:], "positions": positions} for t in tokens]


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["positions"], None, labels=batch["labels"])
    return output, lambda per_token: (per_token.float().mean(), {"loss": per_token.float().mean().detach()})


def train_step(ddp, optimizer, step):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches(step)), model=[ddp],
                                         num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                         forward_only=False)
    _, grad_norm, _ = optimizer.step()
    if losses and dist.get_rank() == int(os.environ["WORLD_SIZE"]) - 1:
        print(f"step {step} loss {sum(float(x['loss']) for x in losses) / len(losses):.6f} grad norm {grad_norm:.6f}")


def main():
    args = parse_args()
    megatron_cpu.enable()
    dist.init_process_group("gloo")
    ddp, optimizer = build(args)
    inject(args.bug, ddp, optimizer)
    for step in range(args.steps):
        train_step(ddp, optimizer, step)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
