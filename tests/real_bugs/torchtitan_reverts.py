"""Upstream torchtitan fixes undone in this process only, for the real-bug corpus (torchtitan_cases.py).

Each revert puts the pinned torchtitan 0.3.0 back on its pre-fix code path, adapted minimally to where
that code lives in 0.3.0, and names the public pull request whose fix it undoes. Nothing in
site-packages changes: a class attribute is replaced before torchtitan builds its Trainer, and
the run is then torchtitan's own `main()` through the ttrace launcher:

    torchrun --nproc-per-node 2 tests/real_bugs/torchtitan_patched.py REVERT --module ttrace_examples.torchtitan ...

A control is a change that looks like a revert but computes the same numbers: ttrace must pass it.
"""

from __future__ import annotations

from collections.abc import Callable


def chunked_loss_grad_placement() -> None:
    """https://github.com/pytorch/torchtitan/pull/3412 ("[loss] Fix ChunkedCELoss + TP gradient placement
    mismatch"): before it, `GradAccumulator` labelled the buffer of the lm_head input's chunk gradients
    with the placement of the activation it was built from (Replicate under tensor parallelism without
    sequence parallelism) and dropped the chunk gradients' own placement (Partial(sum): a colwise, loss-
    parallel lm_head's input gradient is each TP rank's share). The decoder's backward then took one
    rank's share for the sum. Pre-fix lines restored: `self._placements = reference.placements` in
    `__init__`, and `add()` calling `to_local()` without reading the chunk's placement."""
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import GradAccumulator

    fixed_init, fixed_add = GradAccumulator.__init__, GradAccumulator.add

    def __init__(self, reference, **kwargs):
        fixed_init(self, reference, **kwargs)
        if isinstance(reference, DTensor):
            self._placements = reference.placements  # pre-#3412: the activation's placement

    def add(self, chunk_grad):
        if isinstance(chunk_grad, DTensor):
            chunk_grad = chunk_grad.to_local()  # pre-#3412: the chunk's own placement is not kept
        placements, self._placements = self._placements, None  # the fixed add's consistency check off
        try:
            fixed_add(self, chunk_grad)
        finally:
            self._placements = placements

    GradAccumulator.__init__, GradAccumulator.add = __init__, add


def chunked_loss_list_concat() -> None:
    """Control: `GradAccumulator` collects the chunk gradients in a list and concatenates them in
    `result()` (what its docstring says it replaced, for memory), keeping the chunks' own placement as
    the fixed code does. The same values in the same places: ttrace must pass it."""
    import torch
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import GradAccumulator

    fixed_init = GradAccumulator.__init__

    def __init__(self, reference, **kwargs):
        fixed_init(self, reference, **kwargs)
        self._chunks = []

    def add(self, chunk_grad):
        if isinstance(chunk_grad, DTensor):
            self._placements = chunk_grad.placements
            chunk_grad = chunk_grad.to_local()
        self._chunks.append(chunk_grad.to(self._buffer.dtype))
        self._next_idx += 1

    def result(self):
        local = torch.cat(self._chunks, dim=self.seq_dim)
        if self._device_mesh is None:
            return local
        return DTensor.from_local(local, self._device_mesh, self._placements, run_check=False)

    GradAccumulator.__init__, GradAccumulator.add, GradAccumulator.result = __init__, add, result


def moe_bias_tp_reduce() -> None:
    """https://github.com/pytorch/torchtitan/pull/4154 ("[spmd_types] fix MoE routing bias TP reduce"):
    before it, the MoE load-balancing hook did not sum the experts' token counts over the tensor-
    parallel axis when they were plain tensors, so with TP x EP each TP rank updated `expert_bias_E`
    from the tokens routed on its own sequence shard, the ranks' biases drifted apart, and routing
    differed by rank from the second step on. The fix's `if parallel_dims.ep_enabled and
    parallel_dims.tp > 1: all_reduce(..., tp group)` is skipped: the hook runs with a ParallelDims whose
    `tp` reads 1 (0.3.0 keeps the counts plain under partial_dtensor, so the pre-fix DTensor
    `full_tensor()` reduction does not apply either)."""
    import torchtitan.components.optimizer.optimizer as optimizer_module

    register = optimizer_module.register_moe_load_balancing_hook

    class WithoutTensorParallelReduce:
        def __init__(self, parallel_dims):
            self._parallel_dims = parallel_dims

        def __getattr__(self, name):
            return 1 if name == "tp" else getattr(self._parallel_dims, name)

    def register_moe_load_balancing_hook(*args, **kwargs):
        optimizers, model_parts, parallel_dims = args  # as Trainer.__init__ calls it
        return register(optimizers, model_parts, WithoutTensorParallelReduce(parallel_dims), **kwargs)

    # The model specs hold the function itself (ModelSpec.post_optimizer_build_fn), taken from these modules.
    import torchtitan.models.deepseek_v3 as deepseek_v3
    import torchtitan.models.qwen3 as qwen3

    for module in (optimizer_module, qwen3, deepseek_v3):
        module.register_moe_load_balancing_hook = register_moe_load_balancing_hook


def adamw_linear_first_step() -> None:
    """Setup, in both runs (not a revert): AdamW's eps raised to 1.0 in qwen3_moe_debug_2layers. AdamW's first
    step moves every element by about lr x sign(gradient), so a post-step weight whose gradient is round-off
    differs by 2 lr between two correct runs (the README's Adam limit: the clean TP2 x EP2 run failed two norm
    weights by update ratios 1.19 and 1.88 at step 0, and localize then judged that step). With eps far above
    the gradients the first step is about lr x gradient, linear, and round-off stays round-off."""
    import ttrace_examples.torchtitan.config_registry as registry  # what `--module ttrace_examples.torchtitan` loads

    built = registry.qwen3_moe_debug_2layers

    def qwen3_moe_debug_2layers():
        config = built()
        for group in config.optimizer.param_groups:
            group.optimizer_kwargs["eps"] = 1.0
        return config

    registry.qwen3_moe_debug_2layers = qwen3_moe_debug_2layers


SETUPS: dict[str, Callable[[], None]] = {"adamw-linear-first-step": adamw_linear_first_step}
"""Changes applied in both runs of a case (`--setup NAME`), before any revert."""

REVERTS: dict[str, Callable[[], None]] = {
    "none": lambda: None,
    "chunked-loss-grad-placement": chunked_loss_grad_placement,
    "chunked-loss-list-concat": chunked_loss_list_concat,
    "moe-bias-tp-reduce": moe_bias_tp_reduce,
}
