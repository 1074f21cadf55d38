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

from ttrace_core.errors import LaunchError
from ttrace_core.record.command import RANK_KILLED_EXIT
from ttrace_examples.launch import WORKLOADS, launch, run_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttrace_examples", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--config", default="{}", help="the run's config as JSON, e.g. '{\"tp\": 2, \"sp\": true}'")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before spawned ranks are killed")
    parser.add_argument("fields", nargs="*", metavar="FIELD=VALUE",
                        help="config fields on top of --config, e.g. tp=2 sp=true precision=bf16 model.num_layers=2 "
                             "(a value is read as JSON when it is, else as a string)")
    args = parser.parse_args(argv)
    try:
        config = run_config(args.workload, {**_with_fields(json.loads(args.config), args.fields), **_requested_overrides()})
    except (ValueError, TypeError) as error:
        print(f"ttrace: error: {args.workload} --config: {error}", file=sys.stderr)
        return 2
    try:
        launch(args.workload, config, timeout_s=args.timeout)
    except LaunchError as error:
        if not error.killed_by_signal:
            raise
        # A rank killed from outside (SIGKILL, the OOM killer), said the shell's way, so that a relaunch
        # (`ttrace localize`) tells a fault from a run that cannot go on (record/command.py).
        print(f"ttrace: error: {error}", file=sys.stderr)
        return RANK_KILLED_EXIT
    return 0


def _with_fields(config: dict, fields: list[str]) -> dict:
    """`config` with each FIELD=VALUE set; a dotted FIELD sets a nested one (model.num_layers=2)."""
    for item in fields:
        name, equals, text = item.partition("=")
        if not equals or not name:
            raise ValueError(f"{item!r}: write a field as FIELD=VALUE, e.g. tp=2")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *parents, last = name.split(".")
        node = config
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise ValueError(f"{item!r}: {parent} is not a group of fields")
        node[last] = value
    return config


def _requested_overrides() -> dict:
    """What the launching ttrace command asks to change: the precision, for `ttrace estimate --for-precision`."""
    from ttrace_core.record.session import requested_precision

    precision = requested_precision()
    return {"precision": precision} if precision else {}


if __name__ == "__main__":
    sys.exit(main())
