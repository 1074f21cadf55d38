"""The run-time patches behind the bug zoo (bugs.py), written for megatron-core 0.16.1.

Each `apply_*` replaces exactly one attribute (a megatron function, method or module global) and
returns an undo function that puts the original object back, so `undo()` restores identity.
Apply a patch before building the model: a few of them (expert-grad-scale) act at construction.
Megatron is imported lazily, inside each `apply_*`, so listing the zoo does not import it.
The line that makes each patch wrong carries a `# BUG:` comment.
"""

from __future__ import annotations

import functools
import importlib
import re
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ttrace_core.integrations.patching import patch_attribute

Undo = Callable[[], None]


def _megatron(module: str) -> types.ModuleType:
    return importlib.import_module(f"megatron.core.{module}")


def replace(owner: Any, name: str, value: Any) -> Undo:
    """Set `owner.name = value`; the returned undo restores the original object (or deletes an override)."""
    if not hasattr(owner, name):
        raise ValueError(f"bug zoo: {getattr(owner, '__name__', owner)} has no attribute {name!r}; these patches "
                         "are written for megatron-core 0.16.1")
    return patch_attribute(owner, name, value)


def _model_name(name: str) -> str:
    """A parameter name inside DDP / Float16Module wrappers, as the bare GPTModel names it."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


# --- gradient sync: finalize_model_grads --------------------------------------------------------


@contextmanager
def _untagged(model: list[torch.nn.Module], skip: Callable[[str], bool]) -> Iterator[None]:
    """Hide the `.sequence_parallel` tag of the matching params while the TP all-reduce runs."""
    hidden = [param for chunk in model for name, param in chunk.named_parameters()
              if skip(_model_name(name)) and getattr(param, "sequence_parallel", False)]
    for param in hidden:
        param.sequence_parallel = False
    try:
        yield
    finally:
        for param in hidden:
            param.sequence_parallel = True


def _skip_sequence_parallel_allreduce(skip: Callable[[str], bool]) -> Undo:
    finalize = _megatron("distributed.finalize_model_grads")
    original = finalize._allreduce_non_tensor_model_parallel_grads

    @functools.wraps(original)
    def allreduce(model: list[torch.nn.Module], config: Any, tp_group: Any = None) -> None:
        # BUG: the matching params' partial (per-sequence-shard) grads are left un-reduced over TP.
        with _untagged(model, skip):
            original(model, config, tp_group)

    return replace(finalize, "_allreduce_non_tensor_model_parallel_grads", allreduce)


def apply_final_norm_grad_not_reduced() -> Undo:
    return _skip_sequence_parallel_allreduce(lambda name: name.startswith("decoder.final_layernorm."))


def apply_router_grad_not_reduced() -> Undo:
    router = re.compile(r"decoder\.layers\.\d+\.mlp\.router\.")
    return _skip_sequence_parallel_allreduce(lambda name: router.match(name) is not None)


def _skip_word_embedding_allreduce(*args: Any, **kwargs: Any) -> None:
    # BUG: the tied embedding's two partial grads (first and last stage) are never summed.
    return None


def apply_tied_embedding_grad_not_reduced() -> Undo:
    finalize = _megatron("distributed.finalize_model_grads")
    return replace(finalize, "_allreduce_word_embedding_grads", _skip_word_embedding_allreduce)


# --- gradient sync and scaling: DDP buckets -----------------------------------------------------


def _collective_size(bucket_group: Any) -> int:
    if bucket_group.ddp_config.use_distributed_optimizer:
        return bucket_group.intra_distributed_optimizer_instance_size
    return bucket_group.data_parallel_group.size()


def apply_grad_average_twice() -> Undo:
    buffers = _megatron("distributed.param_and_grad_buffer")
    original = buffers._ParamAndGradBucketGroup.start_grad_sync

    @functools.wraps(original)
    def start_grad_sync(self: Any, force_all_reduce: bool | None = False) -> None:
        if not (self.is_first_batch and self.grad_reduce_handle is not None):  # the original's no-op case
            for bucket in self.buckets:
                # BUG: a second 1/dp on top of the gradient_scaling_factor (or AVG) the reduction applies.
                bucket.grad_data /= _collective_size(self)
        original(self, force_all_reduce)

    return replace(buffers._ParamAndGradBucketGroup, "start_grad_sync", start_grad_sync)


def _misscale_expert_buffers(ddp: Any) -> None:
    if ddp.config.calculate_per_token_loss:
        return
    # BUG: expert grads get the dense params' pre-scaling computed with the expert-DP size (1 under
    # AVG, 1/expert_dp under SUM) instead of the DP size: wrong by dp / expert_dp.
    factor = 1.0 if ddp.ddp_config.average_in_collective else 1.0 / ddp.expt_dp_group.size()
    for buffer in ddp.expert_parallel_buffers:
        buffer.gradient_scaling_factor = factor
        for bucket in buffer.buckets:
            bucket.gradient_scaling_factor = factor


def apply_expert_grad_scale() -> Undo:
    ddp_module = _megatron("distributed.distributed_data_parallel")
    original = ddp_module.DistributedDataParallel.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _misscale_expert_buffers(self)

    return replace(ddp_module.DistributedDataParallel, "__init__", init)


def apply_expert_probs_twice() -> Undo:
    """Marks local expert 0 of expert-parallel rank 1 as each SequentialMLP is built; MLP.forward then
    applies that expert's routing probabilities a second time."""
    experts_module, mlp_module = _megatron("transformer.moe.experts"), _megatron("transformer.mlp")
    original_init, original_forward = experts_module.SequentialMLP.__init__, mlp_module.MLP.forward

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        from megatron.core import parallel_state

        if parallel_state.get_expert_model_parallel_rank() == 1 and len(self.local_experts):
            self.local_experts[0].probs_applied_twice = True

    @functools.wraps(original_forward)
    def forward(self: Any, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any):
        output, bias = original_forward(self, hidden_states, per_token_scale, **kwargs)
        if getattr(self, "probs_applied_twice", False) and per_token_scale is not None:
            # BUG: the expert scales its output by the routing probabilities it already applied.
            output = output * per_token_scale.unsqueeze(-1).to(output.dtype)
        return output, bias

    undo_init = replace(experts_module.SequentialMLP, "__init__", init)
    undo_forward = replace(mlp_module.MLP, "forward", forward)

    def undo() -> None:
        undo_forward()
        undo_init()
    return undo


def _skip_param_all_gather(self: Any, force_sync: bool = False) -> None:
    # BUG: after the distributed optimizer's step no all-gather: each DP rank keeps stale values
    # in every parameter shard it does not own.
    self.param_gather_handle = None
    self.param_gather_dispatched = True


def apply_skip_param_all_gather() -> Undo:
    buffers = _megatron("distributed.param_and_grad_buffer")
    return replace(buffers._ParamAndGradBucketGroup, "start_param_sync", _skip_param_all_gather)


def apply_loss_scale_global_microbatches() -> Undo:
    schedules = _megatron("pipeline_parallel.schedules")
    parallel_state = _megatron("parallel_state")
    original = schedules.forward_step_calc_loss

    @functools.wraps(original)
    def forward_step_calc_loss(model: Any, output_tensor: Any, loss_func: Any, config: Any, vp_stage: Any,
                               collect_non_loss_data: bool, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
        # BUG: divides the loss by the global micro-batch count (local x DP) although DDP averages over DP too.
        num_global = num_microbatches * parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        return original(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data, num_global,
                        *args, **kwargs)

    return replace(schedules, "forward_step_calc_loss", forward_step_calc_loss)


# --- layers -------------------------------------------------------------------------------------


def _vocab_embedding_forward(self: Any, input_: torch.Tensor) -> torch.Tensor:
    """VocabParallelEmbedding.forward of megatron-core 0.16.1; only the mask line differs."""
    layers = _megatron("tensor_parallel.layers")
    if self.tp_group.size() > 1:
        masked_input = input_.clone() - self.vocab_start_index
        # BUG (Slapo): the range check runs on ids already shifted to this rank's local range.
        input_mask = (masked_input < self.vocab_start_index) | (masked_input >= self.vocab_end_index)
        masked_input[input_mask] = 0
    else:
        masked_input = input_
    if self.deterministic_mode:
        output_parallel = self.weight[masked_input]
    else:
        output_parallel = torch.nn.functional.embedding(masked_input, self.weight)
    if self.tp_group.size() > 1:
        output_parallel[input_mask, :] = 0.0
    if self.reduce_scatter_embeddings:
        output_parallel = output_parallel.transpose(0, 1).contiguous()
        return layers.reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
    return layers.reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


def apply_vocab_embedding_shifted_mask() -> Undo:
    layers = _megatron("tensor_parallel.layers")
    return replace(layers.VocabParallelEmbedding, "forward", _vocab_embedding_forward)


def apply_row_parallel_bias_per_rank() -> Undo:
    layers = _megatron("tensor_parallel.layers")
    original = layers.RowParallelLinear.forward

    @functools.wraps(original)
    def forward(self: Any, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.bias is None or self.explicit_expert_comm or self.config._cpu_offloading_context is not None:
            return original(self, input_)
        input_parallel = input_ if self.input_is_parallel else \
            layers.scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        # BUG: the bias goes into every rank's partial sum, so the reduction below counts it tp times.
        output_parallel = self._forward_impl(
            input=input_parallel, weight=self.weight, bias=self.bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion, allreduce_dgrad=False,
            sequence_parallel=False, tp_group=None, grad_output_buffer=None)
        if self.sequence_parallel:
            return layers.reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group), None
        return layers.reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group), None

    return replace(layers.RowParallelLinear, "forward", forward)


class _CompletedWork:
    """What an async collective returns, for one that already ran synchronously."""

    def wait(self) -> bool:
        return True


def apply_sp_gather_wrong_dim() -> Undo:
    layers = _megatron("tensor_parallel.layers")
    original = layers.dist_all_gather_func

    def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group: Any = None,
                               async_op: bool = False) -> Any:
        # Only the wgrad re-gather in LinearWithGradAccumulationAndAsyncCommunication.backward is async.
        if not async_op:
            return original(output, input_, group=group, async_op=async_op)
        chunks = [torch.empty_like(input_) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, input_.contiguous(), group=group)
        # BUG (TE #530): the sequence chunks are concatenated along the last (hidden) dim and the
        # result is reinterpreted as the [s, b, h] buffer a dim-0 all-gather would have filled.
        output.copy_(torch.cat(chunks, dim=-1).reshape(output.shape))
        return _CompletedWork()

    return replace(layers, "dist_all_gather_func", all_gather_into_tensor)


class _WrongHeadQueryGrad(torch.autograd.Function):
    """Identity forward; backward hands each head the gradient of the next head (rolled on dim 2)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor) -> torch.Tensor:
        return query.clone()

    @staticmethod
    def backward(ctx: Any, grad_query: torch.Tensor) -> torch.Tensor:
        # BUG: dQ of head h is taken from head h+1 ([sq, b, heads, head_dim]).
        return grad_query.roll(1, dims=2)


def apply_attention_wrong_dq() -> Undo:
    attention = _megatron("transformer.dot_product_attention")
    original = attention.DotProductAttention.forward

    @functools.wraps(original)
    def forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        return original(self, _WrongHeadQueryGrad.apply(query), key, value, *args, **kwargs)

    return replace(attention.DotProductAttention, "forward", forward)


def _glu_halves(mlp: Any, fc1_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1_output, 2, dim=-1)
    # BUG: odd TP ranks read their local [gate_r; up_r] as [up; gate], as if sliced from the full [gate; up].
    if mlp.linear_fc1.tp_group.rank() % 2 == 1:
        gate, up = up, gate
    if (clamp := mlp.config.activation_func_clamp_value) is not None:
        gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
    return gate, up


def apply_swiglu_tp_shard() -> Undo:
    mlp_module = _megatron("transformer.mlp")
    original = mlp_module.MLP.forward

    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        config = self.config
        if not config.gated_linear_unit:
            return original(self, hidden_states, per_token_scale, **kwargs)
        if config.bias_activation_fusion or config.use_te_activation_func or per_token_scale is not None:
            raise ValueError("swiglu-tp-shard replays MLP.forward's unfused GLU path: set bias_activation_fusion="
                             "False and use_te_activation_func=False (and no per_token_scale)")
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        gate, up = _glu_halves(self, intermediate)
        return self.linear_fc2(config.activation_func(gate) * (up + config.glu_linear_offset))

    return replace(mlp_module.MLP, "forward", forward)


# --- not runnable here / other integrations -----------------------------------------------------


def apply_cp_attention_backward() -> Undo:
    raise NotImplementedError(
        "cp-attn-backward: megatron-core's context parallelism needs TransformerEngine attention, which cannot "
        "run on CPU; run it on the PyTorch-native workload: ttrace example torch-gpt --cp 2 --bug cp-attn-backward")


def _data_parallel_group() -> Any:
    parallel_state = _megatron("parallel_state")
    return parallel_state.get_data_parallel_group() if parallel_state.model_parallel_is_initialized() else None


def apply_fp8_amax_wrong_group() -> Undo:
    try:
        fp8 = importlib.import_module("ttrace_core.integrations.fp8")
    except ImportError as error:
        raise NotImplementedError(f"fp8-amax-wrong-group needs ttrace_core.integrations.fp8 ({error})") from error
    original = getattr(fp8, "reduced_amaxes", None)
    if not callable(original):
        raise NotImplementedError("fp8-amax-wrong-group: ttrace_core.integrations.fp8 has no reduced_amaxes(tensors, "
                                  "group), the amax all-reduce this bug redirects")

    @functools.wraps(original)
    def reduced_amaxes(tensors: list[torch.Tensor], group: Any) -> torch.Tensor:
        # BUG: amaxes are reduced over the data-parallel group instead of the recipe's (TP) group,
        # so TP ranks quantize their shards with different scales.
        return original(tensors, _data_parallel_group())

    return replace(fp8, "reduced_amaxes", reduced_amaxes)
