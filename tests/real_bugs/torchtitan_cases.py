"""torchtitan cases of the real-bug corpus (corpus.py): torchtitan 0.3.0's own Trainer, as
tests/thirdparty/test_torchtitan.py runs it (`python -m ttrace_examples.torchtitan`, torchtitan's own CLI).

The candidate goes through torchtitan_patched.py, which undoes one upstream fix first
(torchtitan_reverts.py); the reference is torchtitan's unpatched Trainer on one rank, recorded once per
work directory's parent and shared by the cases of the same model and precision.

- llama3's debug model: 2 steps x 2 micro-batches of 2 x 256 tokens, chunked loss (8 lm_head calls per
  micro-batch), selective activation checkpointing, clipping at 1.0; the candidate is TP 2 with torchtitan's
  defaults (sequence parallelism, loss parallelism). About 40 s a run on 2 cores.
- qwen3's MoE debug model cut to 2 layers, 2 steps (the load-balancing bias acts from the second);
  the candidate is TP 2 x EP 2 on 2 ranks. Its grouped experts compute in bf16 whatever the training
  dtype, so its reference is `ttrace estimate`d in both precisions, and both runs take AdamW with eps 1.0
  (torchtitan_reverts.adamw_linear_first_step: AdamW's sign-like first step otherwise fails two post-step
  norm weights of the correct run by update ratios 1.2 and 1.9). Slow: benchmark only.

Precisions: "fp32" (`--training.mixed_precision_param float32`) and "bf16" (torchtitan's default: fp32
parameters, bf16 compute through fully_shard's mixed-precision policy, judged at bf16 tolerances).
"""

from __future__ import annotations

from pathlib import Path

from tests.real_bugs.corpus import RealBug
from tests.real_bugs.thirdparty_runs import HERE, estimate, record

PATCHED = HERE / "torchtitan_patched.py"
LAUNCHER = ["-m", "ttrace_examples.torchtitan"]
TRAINING = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
            "--training.steps", "2"]
MODELS = {"llama3": ["--module", "ttrace_examples.torchtitan", "--config", "llama3_debugmodel"],
          "qwen3-moe": ["--module", "ttrace_examples.torchtitan", "--config", "qwen3_moe_debug_2layers"]}
PRECISIONS = {"fp32": ["--training.mixed_precision_param", "float32"], "bf16": []}
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
TP2_EP2 = [*TP2, "--parallelism.expert_parallel_degree", "2"]
TIMEOUT = 600.0


def _recorder(model: str, revert: str, layout: list[str], setup: str | None = None):
    """Record the shared one-rank reference (torchtitan unpatched, or through `setup`) and this case's candidate
    (`setup`, then `revert` undone, on 2 ranks with the `layout` flags)."""

    def record_case(work: Path, precision: str) -> tuple[Path, Path]:
        flags = [*MODELS[model], *TRAINING, *PRECISIONS[precision]]
        patched = [str(PATCHED), *(["--setup", setup] if setup else [])]
        name = f"torchtitan-{model}-{precision}{'-' + setup if setup else ''}"
        reference = record(work.parent / "references" / name, 1, [*patched, "none", *flags] if setup else [*LAUNCHER, *flags],
                           timeout=TIMEOUT, reuse=True)
        if model == "qwen3-moe":
            estimate(reference, timeout=3 * TIMEOUT)
        candidate = record(work / "candidate", 2, [*patched, revert, *flags, *layout], timeout=TIMEOUT)
        return reference, candidate

    return record_case


CHUNKED_LOSS = "https://github.com/pytorch/torchtitan/pull/3412"
MOE_BIAS_TP_REDUCE = "https://github.com/pytorch/torchtitan/pull/4154"
BACKWARD_GLUE_AT_LOSS = "between lm_head (backward grad_input.0) and the model (backward grad_output.0)"

CASES: tuple[RealBug, ...] = (
    RealBug(
        name="torchtitan-chunked-loss-tp-grad-placement",
        framework="torchtitan",
        source=CHUNKED_LOSS,
        fix=CHUNKED_LOSS,
        reproduced_by="fix reverted",
        moe=False,
        summary="Under TP with a loss-parallel lm_head, the chunked loss's GradAccumulator labels the chunk "
                "gradients of lm_head's input with the activation's placement instead of their own "
                "Partial(sum), so the decoder's backward takes each TP rank's share for the whole gradient "
                "(llama3, TP2 with sequence and loss parallelism).",
        touched="the loss: ChunkedLossWrapper's GradAccumulator, which hands the gradient of lm_head's chunked "
                "inputs to the model's output (" + BACKWARD_GLUE_AT_LOSS + ")",
        expected_culprits=("between lm_head * and the model *",),
        record=_recorder("llama3", "chunked-loss-grad-placement", TP2),
    ),
    RealBug(
        name="torchtitan-chunked-loss-list-concat",
        framework="torchtitan",
        source=CHUNKED_LOSS,
        fix=None,
        reproduced_by="control",
        moe=False,
        summary="Control: GradAccumulator collects the chunk gradients in a list and concatenates them (what its "
                "pre-allocated buffer replaced), keeping their own placement: the same gradient (llama3, TP2).",
        touched="the loss: ChunkedLossWrapper's GradAccumulator",
        expected_culprits=(),
        record=_recorder("llama3", "chunked-loss-list-concat", TP2),
        control=True,
    ),
    RealBug(
        name="torchtitan-moe-bias-tp-reduce",
        framework="torchtitan",
        source=MOE_BIAS_TP_REDUCE,
        fix=MOE_BIAS_TP_REDUCE,
        reproduced_by="fix reverted",
        moe=True,
        summary="Under TP x EP, the MoE load-balancing hook updates expert_bias_E from each TP rank's own token "
                "counts (not summed over the TP axis), so the ranks' routing biases drift apart and routing "
                "differs by rank from the second step (qwen3 MoE, 2 layers, TP2 x EP2 on 2 ranks).",
        touched="the MoE load-balancing hook's update of layers.*.moe.expert_bias_E (an optimizer pre-step hook), "
                "which the MoE block hands its router as input.1",
        expected_culprits=("layers.*.moe", "layers.*.moe.router"),
        record=_recorder("qwen3-moe", "moe-bias-tp-reduce", TP2_EP2, setup="adamw-linear-first-step"),
        slow=True,
    ),
)
