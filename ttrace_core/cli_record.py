"""The CLI's recording commands: `ttrace example` (the bundled workloads) and `ttrace record` (any
command whose script calls `ttrace_core.attach`), each plain or `--adaptive` (adaptive.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

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
    workloads = example.add_subparsers(dest="workload", required=True)
    gpt = workloads.add_parser("torch-gpt", help="small GPT with PyTorch TP/SP, DDP, FSDP2 or pipelining")
    _add_common_example_flags(gpt)
    gpt.add_argument("--fsdp", type=int, default=1, help="FSDP2 degree")
    gpt.add_argument("--cp", type=int, default=1, help="context-parallel degree (sequence chunks per rank)")
    gpt.add_argument("--precision", default="fp32", choices=["fp64", "fp32", "bf16"])
    gpt.add_argument("--d-model", type=int, default=64, help="model width")
    megatron = workloads.add_parser("megatron-gpt", help="megatron-core GPTModel (local spec) with Megatron DDP/optimizer")
    _add_common_example_flags(megatron)
    megatron.add_argument("--dist-opt", action="store_true", help="Megatron's distributed optimizer")
    megatron.add_argument("--precision", default="fp32", choices=["fp64", "fp32", "bf16", "fp8"],
                          help="fp8: bf16 with emulated FP8 GEMMs (quantize, dequantize, fp32 GEMM)")
    megatron.add_argument("--hidden-size", type=int, default=64)
    megatron.add_argument("--record-steps", type=int, default=None,
                          help="trace only the first N of --steps (every step trains and logs its loss)")
    megatron.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated linear unit)")
    megatron.add_argument("--tie-embeddings", action="store_true", help="share input embedding and output layer")
    megatron.add_argument("--moe", action="store_true", help="MoE MLP with 2 experts (top-2, all-gather dispatcher)")
    megatron.add_argument("--ep", type=int, default=1, help="expert-parallel degree (over the DP ranks; needs --moe)")


def _torch_gpt_config(args: argparse.Namespace):
    from ttrace_core.examples.torch_gpt.model import GPTConfig
    from ttrace_core.examples.torch_gpt.train import ENTRYPOINT, TorchGPTRunConfig

    return ENTRYPOINT, TorchGPTRunConfig(
        tp=args.tp, sp=args.sp, pp=args.pp, dp=args.dp, fsdp=args.fsdp, cp=args.cp,
        precision=args.precision, steps=args.steps, seed=args.seed, bug=args.bug, stats_only=args.stats_only,
        num_micro_batches=args.micro_batches,
        model=GPTConfig(num_layers=args.num_layers, d_model=args.d_model, seq_len=args.seq_len))


def _megatron_gpt_config(args: argparse.Namespace):
    from ttrace_core.examples.megatron_gpt.train import ENTRYPOINT, MegatronGPTRunConfig, MegatronModelConfig

    return ENTRYPOINT, MegatronGPTRunConfig(
        tp=args.tp, sp=args.sp, pp=args.pp, dp=args.dp, dist_opt=args.dist_opt, ep=args.ep,
        precision=args.precision, steps=args.steps, seed=args.seed, bug=args.bug, stats_only=args.stats_only,
        record_steps=args.record_steps, num_micro_batches=args.micro_batches,
        model=MegatronModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, seq_len=args.seq_len,
                                  swiglu=args.swiglu, tie_embeddings=args.tie_embeddings, num_experts=2 if args.moe else 0))


def run_example(args: argparse.Namespace) -> int:
    """`ttrace record` of the example as an ordinary command (python -m ttrace_core.examples ...), so
    that estimate and localize relaunch it like any user's script."""
    from ttrace_core.examples.launch import record_example
    from ttrace_core.launch import under_torchrun

    builders = {"torch-gpt": _torch_gpt_config, "megatron-gpt": _megatron_gpt_config}
    try:
        _, config = builders[args.workload](args)
    except ValueError as error:
        raise TtraceError(f"{args.workload}: {error}") from error
    if under_torchrun():
        raise TtraceError(f"ttrace example starts its own ranks; to run the example under torchrun, record it with: "
                          f"ttrace record --out {args.out} -- torchrun --standalone --nproc-per-node {config.world_size} "
                          f"-m ttrace_core.examples {args.workload} --config '{json.dumps(config.to_dict())}'")
    if args.adaptive:
        config = dataclasses.replace(config, stats_only=True)
        return _record_adaptively(args, lambda out: record_example(out, args.workload, config, timeout_s=args.timeout))
    out = record_example(args.out, args.workload, config, timeout_s=args.timeout)
    print(f"recorded {config.world_size} rank(s) into {out}")
    return 0


def _record_adaptively(args: argparse.Namespace, record_stats) -> int:
    from ttrace_core.adaptive import capture_adaptively
    from ttrace_core.store import read_manifest

    read_manifest(args.adaptive)  # one clear line for a reference that is not a run, before anything runs
    capture = capture_adaptively(args.adaptive, args.out, record_stats, timeout_s=args.timeout)
    found = f"statistics first diverge at {capture.stats_divergence}" if capture.stats_divergence else \
        "no statistic diverges"
    costs = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in capture.seconds.items())
    print(f"recorded {capture.run_dir} adaptively: statistics for steps {capture.steps}, values for steps "
          f"{capture.value_steps} ({found}); {costs}")
    return 0


def run_record(args: argparse.Namespace) -> int:
    from ttrace_core.record import record

    command = args.user_command[1:] if args.user_command[:1] == ["--"] else args.user_command
    if args.adaptive:
        return _record_adaptively(args, lambda out: record(out, command, seed=args.seed, stats_only=True, role=args.role,
                                                           timeout_s=args.timeout))
    out = record(args.out, command, seed=args.seed, stats_only=args.stats_only, role=args.role, timeout_s=args.timeout)
    print(f"recorded {out}")
    return 0


def add_record_parser(commands) -> None:
    record = commands.add_parser("record", help="run your training command with tracing on (its script calls "
                                                "ttrace_core.attach): ttrace record --out DIR -- torchrun ... train.py")
    record.add_argument("--out", required=True, help="run directory to record into")
    record.add_argument("--seed", type=int, default=0, help="seed of the weights drawn from (seed, parameter name)")
    record.add_argument("--stats-only", action="store_true", help="store statistics instead of tensor values")
    record.add_argument("--adaptive", default=None, metavar="REF_DIR",
                        help="statistics for every step, values only for the first step and the first whose statistics diverge "
                             "from REF_DIR's (two runs of the command)")
    record.add_argument("--role", choices=["reference", "candidate"], default=None,
                        help="default: reference on one rank, candidate on more")
    record.add_argument("--timeout", type=float, default=3600.0, help="seconds before the command is killed")
    record.add_argument("user_command", nargs=argparse.REMAINDER, help="-- then the command, e.g. torchrun ... train.py")
