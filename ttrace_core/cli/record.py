"""The CLI's recording command: `ttrace record` (any command whose script calls `ttrace_core.attach`),
plain or `--adaptive` (workflows/adaptive.py). `ttrace example` comes from the ttrace_examples package."""

from __future__ import annotations

import argparse


def record_adaptively(args: argparse.Namespace, record_stats) -> int:
    """`--adaptive REF_DIR`: statistics for every step, then values for the steps that matter."""
    from ttrace_core.api import read_manifest, record_adaptively as capture_adaptively

    read_manifest(args.adaptive)  # one clear line for a reference that is not a run, before anything runs
    capture = capture_adaptively(args.adaptive, args.out, record_stats, timeout_s=args.timeout)
    found = f"statistics first diverge at {capture.stats_divergence}" if capture.stats_divergence else \
        "no statistic diverges"
    costs = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in capture.seconds.items())
    print(f"recorded {capture.run_dir} adaptively: statistics for steps {capture.steps}, values for steps "
          f"{capture.value_steps} ({found}); {costs}")
    return 0


def run_record(args: argparse.Namespace) -> int:
    from ttrace_core.api import record

    command = args.user_command[1:] if args.user_command[:1] == ["--"] else args.user_command
    if args.adaptive:
        return record_adaptively(args, lambda out: record(out, command, seed=args.seed, stats_only=True, role=args.role,
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
    record.set_defaults(handler=run_record)
