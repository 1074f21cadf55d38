"""Bugs in the model code itself, as a port of Llama into megatron-core makes them: patches for the bug zoo
(bugs.py, bug class "model-code"), written for megatron-core 0.16.1 and the `--llama` model.

Unlike the zoo's layout bugs, each computes the same wrong function on one rank and on several: the
patch is written against the logical model (a TP rank that needs another rank's part of a tensor gathers
it), so the candidate at TP1 and at TP2 agree with each other, and the same-code one-rank reference,
which runs the same patched code, passes them. Only an independent implementation of the model, the HF
reference of docs/porting.md, can see them. Each `apply_*` returns the undo function; the line that makes a
patch wrong carries a `# BUG:` comment.
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ttrace_examples.megatron_gpt.bug_patches import Undo, replace


def _megatron(module: str) -> types.ModuleType:
    return importlib.import_module(f"megatron.core.{module}")


def _tp_group_rank_size() -> tuple[Any, int, int]:
    ps = _megatron("parallel_state")
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


class _GatherTensorParallel(torch.autograd.Function):
    """All TP ranks' shards of a tensor, concatenated along `dim`; each rank then uses its own part of the
    whole, so the backward sums every rank's gradient of it and keeps this rank's shard."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int) -> torch.Tensor:
        group, rank, size = _tp_group_rank_size()
        ctx.dim, ctx.rank, ctx.size, ctx.group = dim, rank, size, group
        if size == 1:
            return local.clone()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        if ctx.size > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None


def _gather(local: torch.Tensor, dim: int) -> torch.Tensor:
    return _GatherTensorParallel.apply(local, dim)


# --- a square projection applied transposed -----------------------------------------------------------

def _transposed_projection(self: Any, input_: torch.Tensor, original: Any) -> tuple[torch.Tensor, None]:
    """RowParallelLinear.forward of the attention's output projection, its logical weight applied transposed."""
    if self.bias is not None or getattr(self, "_ttrace_square", False) is False:
        return original(input_)
    ps = _megatron("tensor_parallel.mappings")
    _, rank, size = _tp_group_rank_size()
    full = _gather(self.weight, dim=1)  # [out, in]: every rank's columns
    block = full.shape[1] // size
    # BUG: the [out, in] weight used as [in, out] (a port from a checkpoint that stores the projection
    # transposed, and a square matrix takes it without a shape error): this rank's columns of W^T.
    local = full[rank * block:(rank + 1) * block, :].t()
    partial = F.linear(input_, local)
    if self.sequence_parallel:
        return ps.reduce_scatter_to_sequence_parallel_region(partial), None
    return ps.reduce_from_tensor_model_parallel_region(partial), None


def apply_projection_transposed() -> Undo:
    """Marks every attention's linear_proj as it is built (square: heads x head_dim == hidden); its forward
    then applies the transposed weight."""
    attention, layers = _megatron("transformer.attention"), _megatron("tensor_parallel.layers")
    original_init, original_forward = attention.SelfAttention.__init__, layers.RowParallelLinear.forward

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        proj = self.linear_proj
        proj._ttrace_square = proj.input_size == proj.output_size

    @functools.wraps(original_forward)
    def forward(self: Any, input_: torch.Tensor, *args: Any, **kwargs: Any):
        if getattr(self, "_ttrace_square", None) is None:
            return original_forward(self, input_, *args, **kwargs)
        return _transposed_projection(self, input_, lambda x: original_forward(self, x, *args, **kwargs))

    undo_init = replace(attention.SelfAttention, "__init__", init)
    undo_forward = replace(layers.RowParallelLinear, "forward", forward)

    def undo() -> None:
        undo_forward()
        undo_init()
    return undo


# --- rotary layout: interleaved where the model is half-split ---------------------------------------------

class _Interleaved:
    """A TransformerConfig that reads rotary_interleaved as True, every other field as the config's."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        # BUG: rotary pairs taken as interleaved (x0 y0 x1 y1 ..), where Llama's weights and HF pair the
        # halves of each head (x0 x1 .. | y0 y1 ..).
        return True if name == "rotary_interleaved" else getattr(self._config, name)


def apply_rotary_interleaved() -> Undo:
    """The attention applies rotary in the interleaved layout, with frequencies laid out to match (a
    consistent GPT-J-style rotary): the same model on every layout, not Llama's."""
    attention = _megatron("transformer.attention")
    rotary = _megatron("models.common.embeddings.rotary_pos_embedding")
    original_apply, original_init = attention.apply_rotary_pos_emb, rotary.RotaryEmbedding.__init__

    @functools.wraps(original_apply)
    def apply(t: torch.Tensor, freqs: torch.Tensor, config: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return original_apply(t, freqs, _Interleaved(config), *args, **kwargs)

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.rotary_interleaved = True  # BUG: (see _Interleaved) the frequencies repeated pairwise

    undo_apply = replace(attention, "apply_rotary_pos_emb", apply)
    undo_init = replace(rotary.RotaryEmbedding, "__init__", init)

    def undo() -> None:
        undo_init()
        undo_apply()
    return undo


# --- grouped-query attention: the wrong key/value group per query head -----------------------------------

def apply_gqa_tiled_groups() -> Undo:
    """Core attention gives query head h the key/value group h mod G (the groups tiled, `repeat`) instead of
    h div (H / G) (`repeat_interleave`, megatron's and HF's). A TP rank holds only its own groups, so it
    gathers every rank's keys and values first: the same logical function at every TP degree."""
    dot_product = _megatron("transformer.dot_product_attention")
    original = dot_product.DotProductAttention.forward

    @functools.wraps(original)
    def forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if heads == groups:
            return original(self, query, key, value, *args, **kwargs)
        _, rank, size = _tp_group_rank_size()
        all_keys, all_values = _gather(key, dim=2), _gather(value, dim=2)  # [s, b, G, d]
        global_heads = torch.arange(rank * heads, (rank + 1) * heads, device=key.device)
        # BUG: head h reads group h % G; the model's grouping is h // (H / G).
        chosen = global_heads % (groups * size)
        key, value = all_keys.index_select(2, chosen), all_values.index_select(2, chosen)
        self.num_query_groups_per_partition = heads  # the keys and values are per head now: no repeat
        try:
            return original(self, query, key, value, *args, **kwargs)
        finally:
            self.num_query_groups_per_partition = groups

    return replace(dot_product.DotProductAttention, "forward", forward)


# --- RMSNorm: epsilon outside the square root ---------------------------------------------------------

class _EpsOutsideRMSNorm(torch.nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root_mean_square = x.pow(2).mean(-1, keepdim=True).sqrt()
        # BUG: x / (sqrt(mean(x^2)) + eps) where RMSNorm is x / sqrt(mean(x^2) + eps).
        return x / (root_mean_square + self.eps) * self.weight


def apply_norm_eps_outside_sqrt() -> Undo:
    """megatron's local-spec RMSNorm (WrappedTorchNorm -> torch.nn.RMSNorm) with epsilon added outside the
    root: the norm is built as before (megatron_cpu's tags for sequence parallelism kept), then computes so."""
    torch_norm = _megatron("transformer.torch_norm")
    original = torch_norm.WrappedTorchNorm.__new__

    @functools.wraps(original)
    def new(cls: Any, config: Any, *args: Any, **kwargs: Any):
        norm = original(cls, config, *args, **kwargs)
        if isinstance(norm, torch.nn.RMSNorm):
            norm.__class__ = _EpsOutsideRMSNorm
        return norm

    return replace(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new))


# --- MoE routing: the top-k probabilities not renormalized -------------------------------------------------

def apply_router_topk_unnormalized() -> Undo:
    """megatron's top-k router takes the softmax over all experts and keeps the top k as they are: Mixtral's
    (and megatron's default) routing renormalizes them over the chosen k. A port that reads a DeepSeek-style
    router setting onto Mixtral's weights computes it; every token is routed alike on every layout."""
    router = _megatron("transformer.moe.router")
    original = router.topk_routing_with_score_function

    @functools.wraps(original)
    def routing(logits: torch.Tensor, topk: int, *args: Any, use_pre_softmax: bool = False, **kwargs: Any):
        # BUG: the softmax over every expert before the top-k, and no renormalization over the chosen k after it.
        return original(logits, topk, *args, use_pre_softmax=True, **kwargs)

    return replace(router, "topk_routing_with_score_function", routing)
