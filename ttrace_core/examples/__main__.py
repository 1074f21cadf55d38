"""`python -m ttrace_core.examples WORKLOAD --config JSON`: one run of a bundled example, an ordinary command.

It records nothing by itself: `ttrace example` runs it under `ttrace record` (so `ttrace estimate` and
`ttrace localize` relaunch this same command), and so can you, for example under torchrun:

    ttrace record --out runs/tp2 -- torchrun --standalone --nproc-per-node 2 -m ttrace_core.examples torch-gpt --config '{"tp": 2}'

It spawns its own gloo ranks (free port, timeout) unless it already runs under torchrun. The
config is the example's RunConfig as JSON (missing fields take their defaults).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ttrace_core.launch import resolve, run_ranks, under_torchrun

WORKLOADS = {"torch-gpt": "ttrace_core.examples.torch_gpt.train", "megatron-gpt": "ttrace_core.examples.megatron_gpt.train"}
CONFIG_CLASSES = {"torch-gpt": "TorchGPTRunConfig", "megatron-gpt": "MegatronGPTRunConfig"}


def run_config(workload: str, config: dict):
    """The example's RunConfig from JSON-able fields (validated by its __post_init__)."""
    module = importlib.import_module(WORKLOADS[workload])
    return getattr(module, CONFIG_CLASSES[workload]).from_dict(config)


def launch(workload: str, config, *, timeout_s: float) -> None:
    entrypoint = f"{WORKLOADS[workload]}:run"
    if config.world_size == 1 and workload == "torch-gpt" and not under_torchrun():
        resolve(entrypoint)(config.to_dict())
    else:  # megatron needs a process group even on one rank
        run_ranks(entrypoint, config.to_dict(), config.world_size, timeout_s=timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttrace_core.examples", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--config", default="{}", help="the run's config as JSON, e.g. '{\"tp\": 2, \"sp\": true}'")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before spawned ranks are killed")
    args = parser.parse_args(argv)
    try:
        config = run_config(args.workload, json.loads(args.config))
    except (ValueError, TypeError) as error:
        print(f"ttrace: error: {args.workload} --config: {error}", file=sys.stderr)
        return 2
    launch(args.workload, config, timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
