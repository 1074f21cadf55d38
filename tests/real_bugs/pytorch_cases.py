"""PyTorch-distributed cases of the real-bug corpus (corpus.py): small PyTorch-native trainers attached
with `ttrace.attach`, launched by torchrun under `ttrace record`; the reference is the same script on
one process. The scripts live in scripts/; a case's flags select the pre-fix code path or a control.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tests.real_bugs.corpus import RealBug
from tests.real_bugs.runner import python_command, record_command, torchrun_command

SCRIPTS = Path(__file__).resolve().parent / "scripts"
MOE_EP = SCRIPTS / "torch_moe_ep.py"


def record_moe_ep(candidate_flags: tuple[str, ...], work: Path, precision: str) -> tuple[Path, Path]:
    """The one-rank reference and the EP 2 candidate of torch_moe_ep.py with `candidate_flags`."""
    reference = record_command(work / "reference", python_command(str(MOE_EP), "--precision", precision))
    candidate = record_command(work / "candidate", torchrun_command(2, MOE_EP, "--ep", "2", "--precision", precision,
                                                                      *candidate_flags))
    return reference, candidate


def _moe_case(name: str, flags: tuple[str, ...], **fields) -> RealBug:
    return RealBug(name=name, framework="pytorch", moe=True, record=functools.partial(record_moe_ep, flags), **fields)


CASES: tuple[RealBug, ...] = (
    _moe_case(
        "torch-fsdp2-divide-factor-one-rank", ("--revert-pr-167178",),
        source="https://github.com/pytorch/pytorch/pull/167178",
        fix="https://github.com/pytorch/pytorch/pull/167178",
        reproduced_by="fix reverted",
        summary="EP over the whole world (torchtitan llama4's layout): the experts' FSDP2 group has one rank, and "
                "FSDP2's foreach_reduce skipped gradient_divide_factor there, so expert grads are world-size times "
                "too large while every activation and dense grad is right.",
        touched="gradient reduction of moe.experts.* (FSDP2 foreach_reduce, one-rank reduce-scatter group)",
        expected_culprits=("moe.experts*",)),
    _moe_case(
        "torch-control-expert-grads-divided-by-hand", ("--revert-pr-167178", "--divide-expert-grads"),
        source="https://github.com/pytorch/pytorch/pull/167178", fix=None, reproduced_by="control", control=True,
        summary="Control: the pre-fix FSDP2 with the expert grads divided by the DP size by hand before the "
                "optimizer step; numerically the fix, written differently.",
        touched="none (equivalent to the fix)", expected_culprits=()),
    _moe_case(
        "torch-control-expert-product-reordered", ("--scale-hidden",),
        source="https://github.com/pytorch/pytorch/pull/167178", fix=None, reproduced_by="control", control=True,
        summary="Control: the router weight applied to the experts' hidden activations instead of their output, "
                "the same product in another order (rounded differently).",
        touched="none (an equivalent reordering)", expected_culprits=()),
)
