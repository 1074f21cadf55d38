"""`python -m ttrace_examples WORKLOAD --config JSON`: one run of a bundled example, an ordinary command.

It records nothing by itself: `ttrace example` runs it under `ttrace record` (so `ttrace estimate` and
`ttrace localize` relaunch this same command), and so can you, for example under torchrun:

    ttrace record --out runs/tp2 -- torchrun --standalone --nproc-per-node 2 -m ttrace_examples torch-gpt --config '{"tp": 2}'

It spawns its own gloo ranks (free port, timeout) unless it already runs under torchrun. The
config is the example's RunConfig as JSON (missing fields take their defaults).
"""

from __future__ import annotations

import argparse
import json
import sys

from ttrace_examples.launch import WORKLOADS, launch, run_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttrace_examples", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--config", default="{}", help="the run's config as JSON, e.g. '{\"tp\": 2, \"sp\": true}'")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before spawned ranks are killed")
    args = parser.parse_args(argv)
    try:
        config = run_config(args.workload, {**json.loads(args.config), **_requested_overrides()})
    except (ValueError, TypeError) as error:
        print(f"ttrace: error: {args.workload} --config: {error}", file=sys.stderr)
        return 2
    launch(args.workload, config, timeout_s=args.timeout)
    return 0


def _requested_overrides() -> dict:
    """What the launching ttrace command asks to change: the precision, for `ttrace estimate --for-precision`."""
    from ttrace_core.record.session import requested_precision

    precision = requested_precision()
    return {"precision": precision} if precision else {}


if __name__ == "__main__":
    sys.exit(main())
