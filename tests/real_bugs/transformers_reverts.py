"""Upstream transformers fixes undone in this process only, for the real-bug corpus (transformers_cases.py).

Each revert puts the pinned transformers 5.24 back on its pre-fix code path, adapted minimally to where
that code lives in 5.24, and names the public pull request whose fix it undoes. Nothing in
site-packages changes: a method is replaced before the model is loaded, then tests/thirdparty/
hf_tp_train.py (the README's lines, no declaration) trains:

    torchrun --nproc-per-node 2 tests/real_bugs/transformers_patched.py REVERT --arch qwen3_moe --tp 2 --ep 2 ...

A control is a change that looks like a revert but computes the same numbers: ttrace must pass it.
"""

from __future__ import annotations

from collections.abc import Callable


def _all_reduce_ep_call(*, weight_grads: str) -> Callable:
    """`AllReduceEP.__call__` of transformers 5.24 (distributed/expert_parallel.py), with the gradient of the
    routing weights all-reduced as 5.24 does ("all_reduce_backward"), through a DTensor whose local part
    says its gradient is Partial ("dtensor_partial"), or not at all ("none", the pre-fix code)."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from transformers.distributed.parallel_utils import _AllReduceBackward, _AllReduceForward

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        ep_group = self.ep_mesh.get_group()
        hidden_states = _AllReduceBackward.apply(hidden_states, ep_group)
        if weight_grads == "all_reduce_backward":
            top_k_weights = _AllReduceBackward.apply(top_k_weights, ep_group)
        elif weight_grads == "dtensor_partial":
            top_k_weights = DTensor.from_local(top_k_weights, self.ep_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
        off_rank = (top_k_index // self.num_local_experts) != self.ep_mesh.get_local_rank()
        local_index = torch.where(off_rank, self.num_local_experts, top_k_index % self.num_local_experts)
        expert_output = self.experts_forward(hidden_states, local_index, top_k_weights.masked_fill(off_rank, 0.0))
        return _AllReduceForward.apply(expert_output, ep_group)

    return __call__


def ep_router_grad_partial() -> None:
    """https://github.com/huggingface/transformers/pull/48205 ("Fix expert-parallel training: NaN gradients
    and missing gradient contributions", its bug 2): each EP rank masks the routes to other ranks'
    experts, so its routing-weight gradient covers only its own experts' slots, and before the fix the
    per-rank partials were never summed: the router (and everything upstream of each MoE block through
    the scores) trained on one rank's share. The fix added an all-reduce-backward on the router scores;
    in 5.24 it is `top_k_weights = _AllReduceBackward.apply(top_k_weights, ep_group)` in
    `AllReduceEP.__call__` (the EP group sharing one batch), which this revert leaves out."""
    from transformers.distributed.expert_parallel import AllReduceEP

    AllReduceEP.__call__ = _all_reduce_ep_call(weight_grads="none")


def ep_router_grad_dtensor_partial() -> None:
    """Control: the routing weights' gradient is summed over the EP group the DTensor way, as torchtitan
    fixed the same bug in its router (https://github.com/pytorch/torchtitan/pull/2388:
    `to_local(grad_placements=Partial())`), instead of by transformers' `_AllReduceBackward`: the same
    sum of the same partials, so ttrace must pass it. (Masking the weights *before* the all-reduce is not
    such a control: the all-reduce's backward runs first, and the mask then drops the other ranks' slots
    again, which is the bug.)"""
    from transformers.distributed.expert_parallel import AllReduceEP

    AllReduceEP.__call__ = _all_reduce_ep_call(weight_grads="dtensor_partial")


def ep_sentinel_weight_mask() -> None:
    """Control: https://github.com/huggingface/transformers/pull/48689 ("Keep the expert-parallel sentinel
    slots out of the router gradient", fixing https://github.com/huggingface/transformers/issues/48687)
    undone in `batched_mm_experts_forward`: the routing weights of sentinel slots are no longer masked in
    the experts. On the AllReduceEP path the weights reach the experts already masked by an out-of-place
    `masked_fill`, whose backward zeroes those slots' gradient anyway, so the revert changes no number
    there: ttrace must pass it (the bug needs a path that hands the experts unmasked sentinel weights)."""
    import transformers.integrations.moe as moe

    fixed = moe.batched_mm_experts_forward

    def batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        is_expert_parallel = self._is_expert_parallel
        try:
            self._is_expert_parallel = False  # skips the sentinel mask (and the clamp: done here instead)
            clamped = top_k_index.clamp(0, self.num_experts - 1) if is_expert_parallel else top_k_index
            return fixed(self, hidden_states, clamped, top_k_weights)
        finally:
            self._is_expert_parallel = is_expert_parallel

    moe.ALL_EXPERTS_FUNCTIONS["batched_mm"] = batched_mm_experts_forward  # what the experts' forward dispatches to


REVERTS: dict[str, Callable[[], None]] = {
    "ep-router-grad-partial": ep_router_grad_partial,
    "ep-router-grad-dtensor-partial": ep_router_grad_dtensor_partial,
    "ep-sentinel-weight-mask": ep_sentinel_weight_mask,
}
