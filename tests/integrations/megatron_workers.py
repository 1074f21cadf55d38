"""Functions run on spawned gloo ranks by test_megatron_cpu.py. A failed assertion fails the rank.

Each worker runs megatron on CPU (megatron_cpu.enable()), then tears the parallel state down and
builds a plain single-stage TP1 reference in the same ranks, with the same weights: under
use_cpu_initialization megatron draws each full master weight and slices it, so TP1 and TP2
models built from the same seed are identical (tp_matches_tp1 asserts it); the other workers
copy the weights over explicitly.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ttrace_core.integrations import megatron_cpu

RANK_IMPORTS = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
                "megatron.core.pipeline_parallel")
"""What these ranks import (record/launch.py imports it once, before it forks them)."""

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

SEED = 1234
VOCAB, SEQ, BATCH = 128, 16, 2


def _start() -> None:
    assert megatron_cpu.enable(), "enable() must patch on a machine without CUDA"
    dist.init_process_group("gloo")


def _parallel(tp: int, pp: int = 1) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def _config(tp: int = 1, pp: int = 1, sp: bool = False, layers: int = 2, **extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, **extra)


def _gpt(config, pre_process: bool = True, post_process: bool = True, **extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=pre_process, post_process=post_process, **extra)


def _batch(seed: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _positions(batch: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(batch, -1)


def _per_token_loss(model, seed: int) -> torch.Tensor:
    inputs, labels = _batch(seed)
    return model(inputs, _positions(inputs.shape[0]), None, labels=labels)


def _full(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """The unsharded tensor of a TP-partitioned param (all local specs here use stride 1)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _full_params(model, main: bool = False) -> dict[str, torch.Tensor]:
    """Full weights; with `main`, the fp32 master copies a mixed-precision optimizer keeps."""
    return {name: _full(p.main_param if main else p, p) for name, p in model.named_parameters()}


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {name: _full(p.grad, p) for name, p in model.named_parameters()}


def _load(model, weights: dict[str, torch.Tensor], rename: Callable[[str], str] = str) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[rename(name)])


def _allreduce_sequence_parallel_grads(model) -> list[str]:
    """What finalize_model_grads does for `.sequence_parallel` params: sum their grads over TP."""
    from megatron.core import parallel_state

    tagged = [(n, p) for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
    for _, param in tagged:
        dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    return [name for name, _ in tagged]


def _assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    error = (actual - expected).abs().max().item()
    bound = atol + rtol * expected.abs().max().item()
    assert error <= bound, f"{name}: max |diff| {error:.3g} > {bound:.3g} (rank {dist.get_rank()})"


# --- TP (optionally with sequence parallel) vs TP1 ---------------------------------------------


def tp_matches_tp1(config: dict) -> None:
    """TP2 forward+backward (± sequence parallel) equals a TP1 model built from the same seed."""
    _start()
    try:
        sp = config["sequence_parallel"]
        _parallel(tp=2)
        model = _gpt(_config(tp=2, sp=sp))
        loss = _per_token_loss(model, seed=7)
        loss.mean().backward()
        tagged = _allreduce_sequence_parallel_grads(model) if sp else []
        params, grads = _full_params(model), _full_grads(model)
        _parallel(tp=1)
        reference = _gpt(_config())
        expected = _per_token_loss(reference, seed=7)
        expected.mean().backward()
        _check_tp(sp, tagged, params, grads, loss.detach(), expected.detach(), reference)
    finally:
        dist.destroy_process_group()


def _check_tp(sp: bool, tagged: list[str], params: dict, grads: dict, loss: torch.Tensor,
              expected: torch.Tensor, reference) -> None:
    for name, value in reference.named_parameters():
        assert torch.equal(params[name], value.detach()), f"{name}: TP2 weights differ from the TP1 ones"
    assert loss.shape == expected.shape == (BATCH, SEQ), f"per-token loss shape {tuple(loss.shape)}"
    relative = ((loss - expected).abs() / expected.abs()).max().item()
    assert relative <= 1e-5, f"per-token loss differs from TP1 by {relative:.3g} relative"
    for name, value in reference.named_parameters():
        _assert_close(f"grad of {name}", grads[name], value.grad, rtol=2e-5, atol=1e-9)
    if sp:
        norms = [n for n, _ in reference.named_parameters() if "layernorm" in n]
        assert norms and set(norms) <= set(tagged), f"norm params not tagged .sequence_parallel: {set(norms) - set(tagged)}"


# --- DDP + Megatron optimizer ------------------------------------------------------------------


def _loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach(), "per token": per_token.detach().float()}


def _forward_step(data: Iterator, model) -> tuple[torch.Tensor, Callable]:
    inputs, labels = next(data)
    return model(inputs, _positions(inputs.shape[0]), None, labels=labels), _loss_func


def _optimizer_config(**extra):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, adam_eps=1e-3, clip_grad=1.0, **extra)


def _train_step(ddp_model, optimizer, batches: list) -> tuple[float, float]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp_model],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    success, grad_norm, _ = optimizer.step()
    assert success, "optimizer.step() reported a failed update"
    loss = torch.stack([d["lm loss"] for d in losses]).mean()
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size(), grad_norm


def ddp_optimizer_step(config: dict) -> None:
    """One DDP + get_megatron_optimizer(adam, clip_grad=1) step equals torch AdamW on a TP1 copy."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    _start()
    try:
        tp, dist_opt, bf16 = config["tp"], config["distributed_optimizer"], config["bf16"]
        _parallel(tp=tp)
        model_config = _config(tp=tp, bf16=bf16, finalize_model_grads_func=finalize_model_grads)
        model = _gpt(model_config)
        initial = _full_params(model)
        wrapped = Float16Module(model_config, model) if bf16 else model
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
        ddp_model = DistributedDataParallel(model_config, ddp_config, wrapped)
        optimizer = get_megatron_optimizer(_optimizer_config(bf16=bf16, use_distributed_optimizer=dist_opt), [ddp_model])
        dp_rank = dist.get_rank() // tp
        loss, grad_norm = _train_step(ddp_model, optimizer, [_batch(100 + dp_rank)])
        updated = _full_params(model, main=bf16)
        _parallel(tp=1)
        dp_size = dist.get_world_size() // tp
        expected, unclipped = _reference_step(initial, dp_size), _reference_step(initial, dp_size, clip=False)
        _check_step(config, loss, grad_norm, initial, updated, expected, unclipped)
    finally:
        dist.destroy_process_group()


def _reference_step(initial: dict, dp_size: int, clip: bool = True) -> dict:
    """Same step in plain torch: TP1 model, mean loss over every DP rank's batch, clip, AdamW."""
    reference = _gpt(_config())
    _load(reference, initial)
    per_rank = []
    for dp_rank in range(dp_size):
        inputs, labels = _batch(100 + dp_rank)
        per_rank.append(reference(inputs, _positions(BATCH), None, labels=labels).mean())
    loss = torch.stack(per_rank).mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0 if clip else float("inf"))
    config = _optimizer_config()
    torch.optim.AdamW(reference.parameters(), lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                      eps=config.adam_eps, weight_decay=0.0).step()
    params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), "params": params}


def _worst_relative_move(updated: dict, target: dict, initial: dict) -> float:
    """max over params of max|updated - target| / max|target - initial|: 0 is a perfect match."""
    return max((updated[n].float() - value).abs().max().item() / (value - initial[n]).abs().max().item()
               for n, value in target.items())


def _check_step(config: dict, loss: float, grad_norm: float, initial: dict, updated: dict, expected: dict,
                unclipped: dict) -> None:
    # bf16: the model computes in bf16 and its master weights start from bf16-rounded values.
    tolerance, update_tolerance = (5e-3, 0.15) if config["bf16"] else (1e-5, 1e-3)
    assert abs(loss - expected["loss"]) <= tolerance * expected["loss"], f"loss {loss} != reference {expected['loss']}"
    assert expected["grad_norm"] > 1.0, "the reference grad norm must exceed clip_grad=1 so clipping is exercised"
    assert abs(grad_norm - expected["grad_norm"]) <= tolerance * expected["grad_norm"], \
        f"grad norm {grad_norm} != reference {expected['grad_norm']}"
    off = _worst_relative_move(updated, expected["params"], initial)
    assert off <= update_tolerance, f"updated weights differ from torch AdamW after clipping by {off:.3g} of a step"
    # adam_eps=1e-3 makes the step depend on the grad scale, so skipping the clip would be caught:
    off_unclipped = _worst_relative_move(updated, unclipped["params"], initial)
    assert off_unclipped > 0.3, f"the step matches an unclipped one ({off_unclipped:.3g})"


# --- pipeline parallel vs one stage ------------------------------------------------------------


def _reference_pipeline(batches: list) -> tuple[list[torch.Tensor], dict, dict]:
    """Single-stage model: per-token losses per micro-batch, weights, grads of the mean loss."""
    reference = _gpt(_config(layers=4), share_embeddings_and_output_weights=True)
    losses = [reference(inputs, _positions(BATCH), None, labels=labels) for inputs, labels in batches]
    torch.stack([loss.mean() for loss in losses]).mean().backward()
    named = dict(reference.named_parameters())
    return [loss.detach() for loss in losses], {n: p.detach().clone() for n, p in named.items()}, \
        {n: p.grad.clone() for n, p in named.items()}


def _stage_name(stage: int, layers_per_stage: int) -> Callable[[str], str]:
    """Stage parameter name -> single-stage name: layers are numbered per stage, the head is tied."""
    def rename(name: str) -> str:
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
        if match:
            return f"decoder.layers.{int(match[1]) + stage * layers_per_stage}.{match[2]}"
        return "embedding.word_embeddings.weight" if name == "output_layer.weight" else name

    return rename


def pipeline_matches_single_stage(config: dict) -> None:
    """PP2 (1F1B over several micro-batches, tied embeddings) equals one 4-layer stage."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _start()
    try:
        batches = [_batch(200 + i) for i in range(config["microbatches"])]
        _parallel(tp=1)
        expected, weights, expected_grads = _reference_pipeline(batches)
        _parallel(tp=1, pp=2)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        model = _gpt(_config(pp=2, layers=4, pipeline_dtype=torch.float32), pre_process=stage == 0,
                     post_process=stage == 1, share_embeddings_and_output_weights=True)
        rename = _stage_name(stage, layers_per_stage=2)
        _load(model, weights, rename)
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
        _check_pipeline(stage, model, outputs, expected, expected_grads, rename)
    finally:
        dist.destroy_process_group()


def _check_pipeline(stage: int, model, outputs: list, expected: list, expected_grads: dict,
                    rename: Callable[[str], str]) -> None:
    from megatron.core import parallel_state

    if stage == 1:
        assert len(outputs) == len(expected), f"{len(outputs)} micro-batch losses, expected {len(expected)}"
        for index, (output, reference) in enumerate(zip(outputs, expected)):
            relative = ((output["per token"] - reference).abs() / reference.abs()).max().item()
            assert relative <= 1e-5, f"micro-batch {index}: per-token loss differs by {relative:.3g} relative"
    named = dict(model.named_parameters())
    tied = named.get("embedding.word_embeddings.weight", named.get("output_layer.weight"))
    # The tied embedding's grad is split between the stages; finalize_model_grads sums it like this.
    dist.all_reduce(tied.grad, group=parallel_state.get_embedding_group())
    for name, param in named.items():
        _assert_close(f"stage {stage} grad of {name}", param.grad, expected_grads[rename(name)], rtol=2e-5, atol=1e-9)
