"""transformers cases of the real-bug corpus (corpus.py): transformers 5.24's own expert parallelism, and
its Trainer's loss normalization under gradient accumulation.

The expert-parallel runs are tests/thirdparty/hf_tp_train.py (a tiny Qwen3-MoE from config, loaded with
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_reduce"))`,
AdamW, 2 steps of one micro-batch, traced with the README's lines only); the candidate goes through
transformers_patched.py, which undoes one upstream fix first (transformers_reverts.py). One micro-batch
per step: with two, transformers 5.24 all-reduces the q_norm / k_norm gradients at every backward
(docs/transformers.md), a bug of its own that would be the first divergence of every case.

The gradient-accumulation runs are hf_grad_accum_train.py (a tiny Llama, 2 micro-batches of unequal
label-token counts), whose loop normalizes the loss as the Trainer does since the fix, or as it did before.

Each reference is the same script on one rank, recorded once per work directory's parent and shared by
the cases. Precisions: "fp32" (the fixed fp32 tolerances) and "bf16" (`--dtype bfloat16`: parameters,
compute and AdamW in bf16; the reference is `ttrace estimate`d)."""

from __future__ import annotations

from pathlib import Path

from tests.real_bugs.corpus import RealBug
from tests.real_bugs.thirdparty_runs import HERE, ROOT, estimate, record

TRAIN = ROOT / "tests" / "thirdparty" / "hf_tp_train.py"
GRAD_ACCUM_TRAIN = HERE / "hf_grad_accum_train.py"
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


def _record_grad_accum(work: Path, precision: str) -> tuple[Path, Path]:
    """The Trainer's loss normalization since #34191 on one rank, and before it on TP2 (a tiny Llama, 2 micro-batches
    of 27 and 15 label tokens a row)."""
    flags = ["--dtype", DTYPES[precision], "--models", str(work.parent / "hf-models")]
    reference = record(work.parent / "references" / f"hf-llama-grad-accum-{precision}", 1, [str(GRAD_ACCUM_TRAIN), *flags],
                       timeout=TIMEOUT, reuse=True)
    if precision == "bf16":
        estimate(reference, timeout=3 * TIMEOUT)
    candidate = record(work / "candidate", 2, [str(GRAD_ACCUM_TRAIN), *flags, "--tp", "2",
                                               "--normalization", "micro-batch-mean"], timeout=TIMEOUT)
    return reference, candidate


EP_ROUTER_GRAD = "https://github.com/huggingface/transformers/pull/48205"
GRAD_ACCUM = "https://github.com/huggingface/transformers/pull/34191"

CASES: tuple[RealBug, ...] = (
    RealBug(
        name="transformers-grad-accum-loss-normalization",
        framework="transformers",
        source=GRAD_ACCUM,
        fix=GRAD_ACCUM,
        reproduced_by="fix reverted",
        moe=False,
        summary="With gradient accumulation over micro-batches of unequal label-token counts, each micro-batch's "
                "loss is its own mean divided by the accumulation steps instead of its sum over the step's "
                "token count, so tokens of short micro-batches weigh more (a tiny Llama, TP2; the Trainer's "
                "pre-fix normalization in hf_grad_accum_train.py's loop, the pinned ForCausalLMLoss' mean branch).",
        touched="the loss: its normalization (the Trainer's num_items_in_batch, ForCausalLMLoss -> fixed_cross_entropy)",
        expected_culprits=("the loss function",),
        record=_record_grad_accum,
    ),
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
