"""`python -m tests.real_bugs.megatron_launch CASE ROLE --config JSON`: one run of a megatron-core corpus case.

The run is `ttrace_examples.megatron_gpt.train` (the megatron-core example) with the case's recipe
applied first in every rank: `setup()` in both roles (the options that reach the bug: a model argument,
a loss, an optimizer setting), then `revert()` in the candidate only (the upstream fix taken out again).
`ttrace record` runs this command, so `ttrace localize` relaunches it with the same patches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

ENTRYPOINT = "tests.real_bugs.megatron_launch:rank_main"
ROLES = ("reference", "candidate")


def rank_main(payload: dict) -> None:
    """One rank: the recipe's patches, then the example's own training run."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from tests.real_bugs.megatron_cases import RECIPES
    from ttrace_core.integrations import megatron_cpu
    from ttrace_examples.megatron_gpt import train

    megatron_cpu.enable()  # the recipes patch megatron modules that megatron_cpu must have imported first
    recipe = RECIPES[payload["case"]]
    if recipe.setup is not None:
        recipe.setup()
    if payload["role"] == "candidate" and recipe.revert is not None:
        recipe.revert()
    train.run(payload["config"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real_bugs.megatron_launch", description=__doc__)
    parser.add_argument("case")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--config", default="{}", help="the example's MegatronGPTRunConfig as JSON")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    from ttrace_core.record.launch import ONE_RANK_PORT, run_ranks
    from ttrace_core.record.session import requested_precision
    from ttrace_examples.megatron_gpt.train import MegatronGPTRunConfig

    config = json.loads(args.config)
    if precision := requested_precision():  # `ttrace estimate --for-precision`
        config["precision"] = precision
    world_size = MegatronGPTRunConfig.from_dict(config).world_size
    payload = {"case": args.case, "role": args.role, "config": config}
    if world_size == 1:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or ONE_RANK_PORT)
        rank_main(payload)
    else:
        run_ranks(ENTRYPOINT, payload, world_size, timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
