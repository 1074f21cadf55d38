"""`ttrace` command line: example, estimate, compare, localize, inspect, bugs, report, dashboard.

Exit codes: 0 the runs are equivalent (or the command succeeded), 1 a divergence was found (localize:
a culprit was named), 2 bad input (one line that names the file or tensor and says why), 3 an
internal error, 4 (localize) a divergence that the replay does not explain or does not reproduce.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

from ttrace_core.errors import TtraceError, TtraceInternalError
from ttrace_core.tolerances import (
    DEFAULT_ALPHA, DEFAULT_EXACT_INPUTS_K, DEFAULT_THEOREM_C, DEFAULT_THEOREM_K, TOLERANCE_KINDS,
)


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(text: str) -> int:
    """"512M", "4G", "1.5GiB" or a plain number of bytes (argparse's type for --max-memory)."""
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in _SIZE_UNITS else ""
    try:
        value = float(number[:len(number) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write it like 512M or 4G") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size; write it like 512M or 4G")
    return int(value)


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


def _add_example_parser(commands) -> None:
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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttrace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_example_parser(commands)
    compare = commands.add_parser("compare", help="compare a candidate run against a reference run")
    compare.add_argument("reference")
    compare.add_argument("candidate")
    compare.add_argument("--json", default=None, metavar="PATH",
                         help="write the full comparison as strict JSON here (NaN/inf as null); '-': to stdout, "
                              "and the table to stderr")
    compare.add_argument("--worst", type=int, default=10, help="how many worst offenders to list")
    compare.add_argument("--ignore-dtype", action="store_true", help="compare values even when dtypes differ")
    compare.add_argument("--partial", action="store_true",
                         help="when the evidence is incomplete (a step, a tensor or a replica missing), give a verdict on "
                              "what was recorded: 'partial' and how much, exit 0 if it all passes (default: exit 1)")
    compare.add_argument("--progress", action="store_true", help="draw the progress bar even when stderr is not a terminal")
    compare.add_argument("--tolerance", default="auto", choices=TOLERANCE_KINDS,
                         help="auto: perturbation when the reference holds an estimate (`ttrace estimate`), else dtype")
    compare.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="perturbation: tolerance = alpha x deviation")
    compare.add_argument("--theorem-k", type=float, default=DEFAULT_THEOREM_K, help="theorem: k in k * C^depth * eps")
    compare.add_argument("--theorem-c", type=float, default=DEFAULT_THEOREM_C, help="theorem: C in k * C^depth * eps")
    compare.add_argument("--max-memory", type=byte_size, default=None, metavar="SIZE",
                         help="bytes one tensor's comparison may take (512M, 4G); larger tensors are compared slab by slab")
    compare.add_argument("--workers", type=int, default=1,
                         help="compare in N local worker processes, each a part of the tensors (under torchrun every "
                              "rank is a worker, on any number of nodes)")
    compare.add_argument("--rebuild", action="store_true",
                         help="recompute even when the cached comparison table (under CAND/.ttrace) is up to date")
    compare.add_argument("--exact-inputs-k", type=float, default=DEFAULT_EXACT_INPUTS_K,
                         help="perturbation/theorem: a tensor whose inputs and weights were bitwise equal to the "
                              "reference's is also held to k * sqrt(n) * eps, n partial results (0: off)")
    estimate = commands.add_parser("estimate", help="re-run the reference with perturbed weights to derive per-tensor tolerances")
    estimate.add_argument("reference")
    estimate.add_argument("--samples", type=int, default=4, help="perturbed re-runs (the deviation is their maximum)")
    estimate.add_argument("--relative", type=float, default=None,
                          help="perturbation size (default: the unit round-off of the run's compute dtype)")
    estimate.add_argument("--timeout", type=float, default=600.0, help="seconds before a re-run's ranks are killed")
    estimate.add_argument("--for-precision", default=None, choices=["fp32", "bf16", "fp8"],
                          help="re-run the reference in this precision (fp8 on a bf16 reference), for candidates that "
                               "compute in it: their tolerances then include its quantization")
    localize = commands.add_parser("localize", help="relaunch the candidate with module inputs rewritten to the reference's, name the culprit")
    localize.add_argument("reference")
    localize.add_argument("candidate")
    localize.add_argument("--module", default=None, help="rewrite and judge only this module and its descendants")
    localize.add_argument("--json", default=None, metavar="PATH",
                          help="write the localization as strict JSON here (NaN/inf as null); '-': to stdout, "
                               "and the report to stderr")
    localize.add_argument("--timeout", type=float, default=600.0, help="seconds before the replay's ranks are killed")
    localize.add_argument("--rerun", action="store_true", help="replay again even when a finished replay of these runs exists")
    localize.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # run in this process (what the job runs)
    localize.add_argument("--replay-dir", default=None, help=argparse.SUPPRESS)
    inspect = commands.add_parser("inspect", help="list what a run directory holds")
    inspect.add_argument("run_dir")
    inspect.add_argument("--tensors", action="store_true", help="list every logical tensor")
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
    commands.add_parser("bugs", help="list the injectable bugs of the example workloads")
    report = commands.add_parser("report", help="write a self-contained HTML report, or a Markdown summary for a review")
    report.add_argument("reference")
    report.add_argument("candidate")
    report.add_argument("-o", "--out", default=None, help="write the HTML report here (opens offline, no Python needed)")
    report.add_argument("--markdown", action="store_true", help="print a short Markdown summary (verdict, first "
                                                                  "divergence, culprit, evidence)")
    dashboard = commands.add_parser("dashboard", help="browse comparisons of the runs under ROOT in a web dashboard")
    dashboard.add_argument("root", nargs="?", default=".", help="folder holding run directories (searched recursively)")
    dashboard.add_argument("--port", type=int, default=8501)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    return parser


def _check_output_path(path: str | None, flag: str) -> None:
    """Refuse an output file whose folder is missing before any work is done, not after it."""
    if path is None or (path == "-" and flag == "--json"):
        return
    if Path(path).is_dir():
        raise TtraceError(f"{flag} {path}: is a directory; pass a file name")
    if not Path(path).resolve().parent.is_dir():
        raise TtraceError(f"{flag} {path}: folder {Path(path).resolve().parent} does not exist; create it first")


def _human_stream(args: argparse.Namespace):
    """Where the human-readable report goes: stderr when `--json -` has stdout for the JSON."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


def _write_json(destination: str, text: str) -> None:
    if destination == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        Path(destination).write_text(text)


def _run_example(args: argparse.Namespace) -> int:
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


def _run_compare(args: argparse.Namespace) -> int:
    from ttrace_core.api import CompareSettings, run_comparison
    from ttrace_core.report import ProgressBar, render_comparison

    settings = CompareSettings(tolerance=args.tolerance, alpha=args.alpha, theorem_k=args.theorem_k,
                               theorem_c=args.theorem_c, exact_inputs_k=args.exact_inputs_k, ignore_dtype=args.ignore_dtype,
                               partial=args.partial, max_memory=args.max_memory)
    _check_output_path(args.json, "--json")
    progress = ProgressBar(enabled=args.progress or sys.stderr.isatty())
    if args.workers > 1:
        from ttrace_core.partition import run_workers

        result = run_workers(args.reference, args.candidate, settings, workers=args.workers, rebuild=args.rebuild)
    elif _under_torchrun():
        result = _compare_under_torchrun(args, settings)
        if result is None:  # not rank 0: rank 0 prints and writes
            return 0
    else:
        result = run_comparison(args.reference, args.candidate, settings, progress=progress, rebuild=args.rebuild)
    print(render_comparison(result, num_worst=args.worst), file=_human_stream(args))
    if args.json:
        _write_json(args.json, result.to_json())
    return 0 if result else 1


def _under_torchrun() -> bool:
    from ttrace_core.launch import under_torchrun

    return under_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _compare_under_torchrun(args: argparse.Namespace, settings):
    """Every rank of `torchrun ... -m ttrace_core compare` compares its part (partition.py); rank 0 gets the result."""
    import torch.distributed as dist

    from ttrace_core.api import run_comparison

    dist.init_process_group("gloo")
    try:
        result = run_comparison(args.reference, args.candidate, settings, rebuild=args.rebuild)
        return result if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def _run_report(args: argparse.Namespace) -> int:
    from ttrace_core.api import localization, replay_job, run_comparison
    from ttrace_core.report import render_markdown

    if not args.out and not args.markdown:
        raise TtraceError("report: nothing to write; pass -o report.html for the HTML report, --markdown for a "
                          "summary, or both")
    _check_output_path(args.out, "-o")
    result = run_comparison(args.reference, args.candidate)
    if args.out:
        # The HTML is drawn by the dashboard's figure builders (app/report.py): the render stage, which
        # may use plotly; the core itself never imports it.
        try:
            from app.report import write_report
        except ModuleNotFoundError as error:
            raise TtraceError(f"the HTML report is drawn by the dashboard wing, which is not importable ({error}); "
                              "install its dependencies: pip install 'ttrace[dashboard]' -c requirements.txt") from error
        path = write_report(args.reference, args.candidate, args.out)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB); it opens offline in any browser")
    if args.markdown:
        job = replay_job(args.reference, args.candidate)
        print(render_markdown(result, localization(job) if job is not None else None))
    return 0 if result else 1


def _run_dashboard(args: argparse.Namespace) -> int:
    from ttrace_core.dashboard import serve

    return serve(args.root, port=args.port, host=args.host)


def _run_estimate(args: argparse.Namespace) -> int:
    from ttrace_core.estimate import estimate_reference, write_estimate

    estimate = estimate_reference(args.reference, num_samples=args.samples, relative=args.relative, timeout_s=args.timeout,
                                  for_precision=args.for_precision)
    path = write_estimate(args.reference, estimate)
    relatives = sorted(d.relative for d in estimate.tensors.values() if math.isfinite(d.relative))
    median = relatives[len(relatives) // 2] if relatives else float("nan")
    crossed = f" in {estimate.precision}" if estimate.precision != estimate.reference_precision else ""
    print(f"estimated {len(estimate.tensors)} tensors from {estimate.num_samples} re-runs{crossed} with weights perturbed by "
          f"U[-{estimate.relative:.3g}, {estimate.relative:.3g}] ({estimate.seconds:.0f} s); median relative deviation "
          f"{median:.3g}, largest {relatives[-1] if relatives else float('nan'):.3g}; stored in {path}")
    return 0


def _localize_here(args: argparse.Namespace) -> int:
    """The replay itself, in this process: what a localize job runs."""
    from ttrace_core.api import run_comparison
    from ttrace_core.localize import localize
    from ttrace_core.report import render_localization

    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[progress] {message} (t={time.perf_counter() - started:.1f} s)", flush=True)

    _check_output_path(args.json, "--json")
    original = run_comparison(args.reference, args.candidate)
    result = localize(args.reference, args.candidate, module=args.module, timeout_s=args.timeout, original=original,
                      replay_dir=args.replay_dir, progress=progress)
    progress("done")
    print(render_localization(result), file=_human_stream(args))
    if args.json:
        _write_json(args.json, result.to_json())
    return result.exit_code


def _run_localize(args: argparse.Namespace) -> int:
    """Submit the replay as a job (or reuse the finished one), follow its log, print its verdict."""
    if args.here:
        return _localize_here(args)
    from ttrace_core.api import localization, submit_replay
    from ttrace_core.report import render_localization

    _check_output_path(args.json, "--json")
    job = submit_replay(args.reference, args.candidate, args.module, timeout_s=args.timeout, rerun=args.rerun)
    if job.cached:
        print(f"(cached replay: {job.directory})", file=_human_stream(args))
    status = job.wait()
    result = localization(job)
    if result is None:
        tail = "\n".join(job.log_tail(15))
        error_line = next((line for line in reversed(job.log_tail(15)) if line.startswith("ttrace: error:")), None)
        if error_line:
            print(error_line, file=sys.stderr)
            return 2
        raise TtraceInternalError(f"the localize job {status.state} ({status.message}); its log ends with:\n{tail}")
    print(render_localization(result), file=_human_stream(args))
    if args.json:
        _write_json(args.json, result.to_json())
    return result.exit_code


def _run_record(args: argparse.Namespace) -> int:
    from ttrace_core.record import record

    command = args.user_command[1:] if args.user_command[:1] == ["--"] else args.user_command
    if args.adaptive:
        return _record_adaptively(args, lambda out: record(out, command, seed=args.seed, stats_only=True, role=args.role,
                                                           timeout_s=args.timeout))
    out = record(args.out, command, seed=args.seed, stats_only=args.stats_only, role=args.role, timeout_s=args.timeout)
    print(f"recorded {out}")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from ttrace_core.report import render_run
    from ttrace_core.store import RunReader

    with RunReader(args.run_dir) as reader:
        print(render_run(reader, list_tensors=args.tensors))
    return 0


def _run_bugs(args: argparse.Namespace) -> int:
    from ttrace_core.examples.megatron_gpt.bugs import ZOO
    from ttrace_core.examples.torch_gpt.parallelize import TORCH_GPT_BUGS

    print("megatron-gpt zoo (ttrace example megatron-gpt --bug NAME):")
    for bug in ZOO.values():
        print(f"  {bug.name:<26} {bug.bug_class:<15} {bug.upstream:<28} triggers: {' | '.join(bug.triggers)}")
        print(f"  {'':<26} culprit: {bug.culprit}; first divergence: {bug.first_divergence}; runs on {bug.runs_on}")
    print("torch-gpt (ttrace example torch-gpt --bug NAME):")
    for bug in TORCH_GPT_BUGS.values():
        print(f"  {bug.name:<26} needs --{bug.requires} 2+  culprit {bug.culprit}: {bug.description}")
    return 0


REPORT_IT = "this is a bug in ttrace: please report it on the ttrace issue tracker"


def _internal_error(error: Exception) -> int:
    """A bug of ttrace's own: say so, with the traceback for the report."""
    traceback.print_exc()
    print(f"ttrace: internal error: {type(error).__name__}: {error}; {REPORT_IT} with the traceback above",
          file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a damaged trace's names may not be valid UTF-8: print them escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = _build_parser().parse_args(argv)
    handlers = {"example": _run_example, "estimate": _run_estimate, "compare": _run_compare, "localize": _run_localize,
                "inspect": _run_inspect, "bugs": _run_bugs, "dashboard": _run_dashboard,
                "report": _run_report, "record": _run_record}
    try:
        code = handlers[args.command](args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at the interpreter's exit
        return code
    except TtraceError as error:
        print(f"ttrace: error: {error}".replace("\n", " "), file=sys.stderr)
        return 2
    except TtraceInternalError as error:
        print(f"ttrace: internal error: {error}\n{REPORT_IT} with the output above", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("ttrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`ttrace ... | head`): stop quietly, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 141
    except OSError as error:
        if error.filename is None:
            return _internal_error(error)
        # A path the user gave (or its folder) cannot be read or written: input or environment, not a bug.
        print(f"ttrace: error: {error.filename}: {error.strerror or error}; check the path, its folder and "
              "their permissions", file=sys.stderr)
        return 2
    except Exception as error:
        return _internal_error(error)


if __name__ == "__main__":
    sys.exit(main())
