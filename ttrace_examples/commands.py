"""The `ttrace example` and `ttrace bugs` commands: the bundled workloads, recorded through `ttrace record`.

They plug into the `ttrace` command line through the `ttrace.commands` entry point (pyproject.toml):
the core CLI lists them without importing this package, and the library never depends on its examples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ttrace_core.cli.record import record_adaptively
from ttrace_core.errors import TtraceError


def _add_common_example_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on top of --tp")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (DDP)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bug", default=None, help="inject a known bug (see `ttrace bugs`)")
    parser.add_argument("--stats-only", action="store_true", help="store statistics instead of tensor values")
    parser.add_argument("--adaptive", default=None, metavar="REF_DIR",
                        help="statistics for every step, values only for the first step and the first whose statistics diverge "
                             "from REF_DIR's (two runs of the command)")
    parser.add_argument("--num-layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (global, over all DP ranks)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before spawned ranks are killed")
    parser.add_argument("--out", required=True, help="run directory to record into")


def add_example_parser(commands) -> None:
    example = commands.add_parser("example", help="record a trace of an example workload on CPU ranks (gloo)")
    workloads = example.add_subparsers(dest="workload", required=True,
                                       help="the workload to record; `ttrace example WORKLOAD --help` lists its flags")
    gpt = workloads.add_parser("torch-gpt", help="small GPT with PyTorch TP/SP, DDP, FSDP2 or pipelining")
    _add_common_example_flags(gpt)
    gpt.add_argument("--fsdp", type=int, default=1, help="FSDP2 degree")
    gpt.add_argument("--cp", type=int, default=1, help="context-parallel degree (sequence chunks per rank)")
    gpt.add_argument("--precision", default="fp32", choices=["fp64", "fp32", "bf16"])
    gpt.add_argument("--d-model", type=int, default=64, help="model width")
    megatron = workloads.add_parser("megatron-gpt", help="megatron-core GPTModel (local spec) with Megatron DDP/optimizer")
    _add_common_example_flags(megatron)
    megatron.add_argument("--dist-opt", action="store_true", help="Megatron's distributed optimizer")
    megatron.add_argument("--vpp", type=int, default=1,
                          help="virtual pipeline stages per pipeline rank (model chunks, interleaved 1F1B; needs --pp 2+)")
    megatron.add_argument("--precision", default="fp32", choices=["fp64", "fp32", "bf16", "fp8"],
                          help="fp8: bf16 with emulated FP8 GEMMs (quantize, dequantize, fp32 GEMM)")
    megatron.add_argument("--hidden-size", type=int, default=64)
    megatron.add_argument("--record-steps", type=int, default=None,
                          help="trace only the first N of --steps (every step trains and logs its loss)")
    megatron.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated linear unit)")
    megatron.add_argument("--tie-embeddings", action="store_true", help="share input embedding and output layer")
    megatron.add_argument("--llama", action="store_true",
                          help="Llama's architecture choices: RMSNorm, RoPE, SwiGLU, no linear biases (docs/porting.md)")
    megatron.add_argument("--num-query-groups", type=int, default=None,
                          help="key/value heads of grouped-query attention (default: one per attention head)")
    megatron.add_argument("--moe", action="store_true", help="MoE MLP (2 experts, top-2, all-gather dispatcher unless set below)")
    megatron.add_argument("--ep", type=int, default=1, help="expert-parallel degree (over the DP ranks; needs --moe)")
    megatron.add_argument("--num-experts", type=int, default=2, help="experts per MoE layer (with --moe)")
    megatron.add_argument("--topk", type=int, default=2, help="experts per token (with --moe)")
    megatron.add_argument("--dispatcher", default="allgather", choices=["allgather", "alltoall"],
                          help="megatron's MoE token dispatcher (with --moe)")
    hf_llama = workloads.add_parser("hf-llama", help="transformers' Llama on one process: the independent reference of "
                                                     "megatron-gpt --llama (compare with --map hf-llama--megatron-gpt); "
                                                     "with --moe Mixtral, of megatron-gpt --llama --moe "
                                                     "(--map hf-mixtral--megatron-gpt-moe)")
    for flag, kwargs in (("--steps", dict(type=int, default=1)), ("--seed", dict(type=int, default=0)),
                         ("--num-layers", dict(type=int, default=4, help="transformer blocks")),
                         ("--seq-len", dict(type=int, default=16, help="tokens per sequence")),
                         ("--micro-batches", dict(type=int, default=4, help="micro-batches per step")),
                         ("--hidden-size", dict(type=int, default=64)),
                         ("--num-query-groups", dict(type=int, default=None,
                                                     help="key/value heads (default: one per attention head)")),
                         ("--timeout", dict(type=float, default=600.0, help="seconds before the run is killed")),
                         ("--out", dict(required=True, help="run directory to record into"))):
        hf_llama.add_argument(flag, **kwargs)
    hf_llama.add_argument("--tie-embeddings", action="store_true", help="share input embedding and output layer")
    hf_llama.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                          help="bf16: bf16 parameters and compute, fp32 gradients and main weights (megatron's bf16)")
    hf_llama.add_argument("--moe", action="store_true", help="MixtralForCausalLM: routed SwiGLU experts (2, top-2 unless set below)")
    hf_llama.add_argument("--num-experts", type=int, default=2, help="experts per MoE layer (with --moe)")
    hf_llama.add_argument("--topk", type=int, default=2, help="experts per token (with --moe; 2 or more)")
    hf_llama.add_argument("--stats-only", action="store_true", help=argparse.SUPPRESS)
    hf_llama.add_argument("--adaptive", default=None, help=argparse.SUPPRESS)
    example.set_defaults(handler=run_example)


def _torch_gpt_config(args: argparse.Namespace):
    from ttrace_examples.torch_gpt.model import GPTConfig
    from ttrace_examples.torch_gpt.train import ENTRYPOINT, TorchGPTRunConfig

    return ENTRYPOINT, TorchGPTRunConfig(
        tp=args.tp, sp=args.sp, pp=args.pp, dp=args.dp, fsdp=args.fsdp, cp=args.cp,
        precision=args.precision, steps=args.steps, seed=args.seed, bug=args.bug, stats_only=args.stats_only,
        num_micro_batches=args.micro_batches,
        model=GPTConfig(num_layers=args.num_layers, d_model=args.d_model, seq_len=args.seq_len))


LLAMA_CHOICES = {"normalization": "RMSNorm", "position_embedding": "rope", "add_bias_linear": False}
"""`--llama` (with SwiGLU): the MegatronModelConfig fields that make megatron's GPTModel a Llama."""


def _megatron_gpt_config(args: argparse.Namespace):
    from ttrace_examples.megatron_gpt.train import ENTRYPOINT, MegatronGPTRunConfig, MegatronModelConfig

    return ENTRYPOINT, MegatronGPTRunConfig(
        tp=args.tp, sp=args.sp, pp=args.pp, vpp=args.vpp, dp=args.dp, dist_opt=args.dist_opt, ep=args.ep,
        precision=args.precision, steps=args.steps, seed=args.seed, bug=args.bug, stats_only=args.stats_only,
        record_steps=args.record_steps, num_micro_batches=args.micro_batches,
        model=MegatronModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, seq_len=args.seq_len,
                                  swiglu=args.swiglu or args.llama, tie_embeddings=args.tie_embeddings,
                                  num_experts=args.num_experts if args.moe else 0, moe_topk=args.topk,
                                  moe_dispatcher=args.dispatcher, num_query_groups=args.num_query_groups,
                                  **(LLAMA_CHOICES if args.llama else {})))


def _hf_llama_config(args: argparse.Namespace):
    """The megatron-gpt --llama run config this HF reference reproduces (the same flags build both)."""
    from ttrace_examples.hf_llama.train import ENTRYPOINT, check_reference_config
    from ttrace_examples.megatron_gpt.train import MegatronGPTRunConfig, MegatronModelConfig

    config = MegatronGPTRunConfig(
        steps=args.steps, seed=args.seed, num_micro_batches=args.micro_batches, precision=args.precision,
        model=MegatronModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, seq_len=args.seq_len,
                                  swiglu=True, tie_embeddings=args.tie_embeddings,
                                  num_experts=args.num_experts if args.moe else 0, moe_topk=args.topk,
                                  num_query_groups=args.num_query_groups, **LLAMA_CHOICES))
    check_reference_config(config)
    return ENTRYPOINT, config


def run_example(args: argparse.Namespace) -> int:
    """`ttrace record` of the example as an ordinary command (python -m ttrace_examples ...), so
    that estimate and localize relaunch it like any user's script."""
    from ttrace_examples.launch import record_example
    from ttrace_core.record.launch import under_torchrun

    builders = {"torch-gpt": _torch_gpt_config, "megatron-gpt": _megatron_gpt_config, "hf-llama": _hf_llama_config}
    try:
        _, config = builders[args.workload](args)
    except ValueError as error:
        raise TtraceError(f"{args.workload}: {error}") from error
    if under_torchrun():
        raise TtraceError(f"ttrace example starts its own ranks; to run the example under torchrun, record it with: "
                          f"ttrace record --out {args.out} -- torchrun --standalone --nproc-per-node {config.world_size} "
                          f"-m ttrace_examples {args.workload} --config '{json.dumps(config.to_dict())}'")
    if args.adaptive:
        config = dataclasses.replace(config, stats_only=True)
        return record_adaptively(args, lambda out: record_example(out, args.workload, config, timeout_s=args.timeout))
    out = record_example(args.out, args.workload, config, timeout_s=args.timeout)
    print(f"recorded {config.world_size} rank(s) into {out}")
    return 0


def run_bugs(args: argparse.Namespace) -> int:
    from ttrace_examples.megatron_gpt.bugs import MODEL_CODE_BUGS, ZOO
    from ttrace_examples.torch_gpt.parallelize import TORCH_GPT_BUGS

    for title, bugs in (("megatron-gpt zoo (ttrace example megatron-gpt --bug NAME):", ZOO),
                        ("megatron-gpt model-code bugs (--llama; caught against the HF reference, docs/porting.md):",
                         MODEL_CODE_BUGS)):
        print(title)
        for bug in bugs.values():
            print(f"  {bug.name:<26} {bug.bug_class:<15} {bug.upstream:<28} triggers: {' | '.join(bug.triggers)}")
            print(f"  {'':<26} culprit: {bug.culprit}; first divergence: {bug.first_divergence}; runs on {bug.runs_on}")
    print("torch-gpt (ttrace example torch-gpt --bug NAME):")
    for bug in TORCH_GPT_BUGS.values():
        print(f"  {bug.name:<26} needs --{bug.requires} 2+  culprit {bug.culprit}: {bug.description}")
    return 0


def add_bugs_parser(commands) -> None:
    bugs = commands.add_parser("bugs", help="list the injectable bugs of the example workloads",
                               description="List the bugs `ttrace example ... --bug NAME` can inject into the example "
                                           "workloads (megatron-gpt and torch-gpt): each one's culprit, where it first "
                                           "diverges and which layouts it needs. Takes no arguments.")
    bugs.set_defaults(handler=run_bugs)
