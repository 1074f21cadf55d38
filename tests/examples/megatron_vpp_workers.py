"""Ranks spawned by test_megatron_vpp.py: the megatron-gpt example with one virtual pipeline chunk's
gradient reduction broken, recorded like any candidate (the session comes from the test's environment).

The patch is this test's, not the zoo's: the zoo's layouts run at the detection benchmark's sizes, and
pp 2 x vpp 2 needs a multiple of 4 layers and 2 micro-batches per DP rank.
"""

from __future__ import annotations

import functools
import warnings

RANK_IMPORTS = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
                "megatron.core.pipeline_parallel")
"""What these ranks import (record/launch.py imports it once, before it forks them)."""

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

UNREDUCED_VP_STAGE = 1
"""The chunk whose data-parallel gradient all-reduce is skipped: the last virtual stage."""


def train_with_one_chunk_unreduced(config: dict) -> None:
    """The example's run, with DistributedDataParallel.finish_grad_sync a no-op for the chunk of virtual
    stage UNREDUCED_VP_STAGE: finalize_model_grads loops over every model chunk, and this one's buckets
    are neither scaled by 1/dp nor all-reduced, so each DP rank steps those layers with its own gradient."""
    from megatron.core.distributed import DistributedDataParallel

    from ttrace_core.integrations.megatron import unwrap
    from ttrace_examples.megatron_gpt import train

    original = DistributedDataParallel.finish_grad_sync

    @functools.wraps(original)
    def finish_grad_sync(self, *args, **kwargs) -> None:
        if getattr(unwrap(self), "vp_stage", None) == UNREDUCED_VP_STAGE:
            return  # BUG: this chunk's DP reduction never runs
        original(self, *args, **kwargs)

    DistributedDataParallel.finish_grad_sync = finish_grad_sync
    try:
        train.run(config)
    finally:
        DistributedDataParallel.finish_grad_sync = original
