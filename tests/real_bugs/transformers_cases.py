"""transformers cases of the real-bug corpus (corpus.py): transformers 5.24's own expert parallelism.

Every run is tests/thirdparty/hf_tp_train.py (a tiny Qwen3-MoE from config, loaded with
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_reduce"))`,
AdamW, 2 steps of one micro-batch, traced with the README's lines only); the candidate goes through
transformers_patched.py, which undoes one upstream fix first (transformers_reverts.py). The reference is
the same script on one rank, recorded once per work directory's parent and shared by the cases.

One micro-batch per step: with two, transformers 5.24 all-reduces the q_norm / k_norm gradients at every
backward (docs/transformers.md), a bug of its own that would be the first divergence of every case.

Precisions: "fp32" (the fixed fp32 tolerances) and "bf16" (`--dtype bfloat16`: parameters, compute and
AdamW in bf16; the reference is `ttrace estimate`d).
"""

from __future__ import annotations

from pathlib import Path

from tests.real_bugs.corpus import RealBug
from tests.real_bugs.thirdparty_runs import HERE, ROOT, estimate, record

TRAIN = ROOT / "tests" / "thirdparty" / "hf_tp_train.py"
PATCHED = HERE / "transformers_patched.py"
MODEL = ["--arch", "qwen3_moe", "--micro-batches", "1", "--steps", "2"]
EXPERT_PARALLEL = ["--tp", "2", "--ep", "2", "--ep-implementation", "all_reduce"]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
TIMEOUT = 300.0


def _recorder(revert: str, *extra: str):
    """Record the shared one-rank reference and this case's candidate: 2 ranks, TP2 x EP2, `revert` undone."""

    def record_case(work: Path, precision: str) -> tuple[Path, Path]:
        flags = [*MODEL, *extra, "--dtype", DTYPES[precision]]
        models = ["--models", str(work.parent / "hf-models")]  # the tiny checkpoint, built once per rank
        references = work.parent / "references"
        reference = record(references / f"hf-qwen3-moe-{precision}{'-'.join(['', *extra[1::2]])}", 1,
                           [str(TRAIN), *flags, *models], timeout=TIMEOUT, reuse=True)
        if precision == "bf16":
            estimate(reference, timeout=3 * TIMEOUT)
        candidate = record(work / "candidate", 2, [str(PATCHED), revert, *flags, *EXPERT_PARALLEL, *models],
                           timeout=TIMEOUT)
        return reference, candidate

    return record_case


EP_ROUTER_GRAD = "https://github.com/huggingface/transformers/pull/48205"

CASES: tuple[RealBug, ...] = (
    RealBug(
        name="transformers-ep-router-grad-partial",
        framework="transformers",
        source=EP_ROUTER_GRAD,
        fix=EP_ROUTER_GRAD,
        reproduced_by="fix reverted",
        moe=True,
        summary="Under expert parallelism each rank's routing-weight gradient covers only its own experts' "
                "slots and the per-rank partials are not summed: the router and everything upstream of each "
                "MoE block train on one EP rank's share (Qwen3-MoE, TP2 x EP2, AllReduceEP).",
        touched="model.layers.*.mlp.experts (AllReduceEP: the all-reduce of the routing weights' gradient)",
        expected_culprits=("model.layers.*.mlp.experts",),
        record=_recorder("ep-router-grad-partial"),
    ),
    RealBug(
        name="transformers-ep-router-grad-dtensor-partial",
        framework="transformers",
        source=EP_ROUTER_GRAD,
        fix=None,
        reproduced_by="control",
        moe=True,
        summary="Control: the routing weights' gradient is summed over the EP group through a DTensor "
                "(`to_local(grad_placements=Partial())`, torchtitan's fix of the same bug) instead of "
                "transformers' `_AllReduceBackward`: the same sum.",
        touched="model.layers.*.mlp.experts",
        expected_culprits=(),
        record=_recorder("ep-router-grad-dtensor-partial"),
        control=True,
    ),
    RealBug(
        name="transformers-ep-sentinel-mask-revert",
        framework="transformers",
        source="https://github.com/huggingface/transformers/issues/48687",
        fix=None,
        reproduced_by="control",
        moe=True,
        summary="Control: the sentinel-slot mask of https://github.com/huggingface/transformers/pull/48689 taken "
                "out of `batched_mm_experts_forward`; on the AllReduceEP path the weights arrive masked by an "
                "out-of-place masked_fill, so no number changes.",
        touched="model.layers.*.mlp.experts",
        expected_culprits=(),
        record=_recorder("ep-sentinel-weight-mask", "--experts", "batched_mm"),
        control=True,
    ),
)
