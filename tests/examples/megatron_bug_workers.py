"""Functions run on spawned gloo ranks by test_megatron_bugs.py. A failed assertion fails the rank.

Each bug is checked inside one worker from identical weights: a clean pass, the same pass with the
bug applied, and a third pass after undo() that must reproduce the clean one bitwise. The clean
pass is also checked against a single-rank (TP1, one stage, no DDP) computation where that is cheap.
Rank 0 prints one "EFFECT <bug>: ..." line per bug with the measured effect size.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ttrace_examples.megatron_gpt.bugs import apply_bug
from tests.integrations.megatron_workers import _stage_name
from ttrace_core.integrations import megatron_cpu

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

SEED = 1234
VOCAB, SEQ, BATCH = 128, 16, 2
DIFFERENT = 1e-3
"""A bug must move the quantity it targets by more than this, relative to the clean value."""


# --- setup -------------------------------------------------------------------------------------


def _start() -> None:
    assert megatron_cpu.enable(), "enable() must patch on a machine without CUDA"
    dist.init_process_group("gloo")
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # megatron-core 0.16.1's router reads te_general_gemm, bound only when TransformerEngine imports.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _finish() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _parallel(tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1 if ep > 1 else None)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def _config(tp: int = 1, pp: int = 1, sp: bool = False, layers: int = 2, **extra):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        finalize_model_grads_func=finalize_model_grads, **extra)


def _moe_config(ep: int = 1, **kwargs):
    # topk 2 of 2 experts: every token reaches both, the router weights them (smooth in the weights).
    # Expert biases break on CPU (an in-place add on a custom Function's view), hence no linear biases;
    # expert params get their own EP grad buffers only when the config itself says ep > 1.
    return _config(num_moe_experts=2, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                   add_bias_linear=False, expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=1 if ep > 1 else None, **kwargs)


def _gated_config(**kwargs):
    return _config(gated_linear_unit=True, activation_func=F.silu, **kwargs)


def _gpt(config, pre_process: bool = True, post_process: bool = True, spec=None, **extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = spec or get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=pre_process, post_process=post_process, **extra)


def _ddp(model, config, dist_opt: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
    return DistributedDataParallel(config, ddp_config, model)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _positions() -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


# --- weights -----------------------------------------------------------------------------------


def _reference_weights(model) -> dict[str, torch.Tensor]:
    """A TP1 model's weights with every bias made non-zero (megatron initializes them to 0)."""
    weights = {}
    for index, (name, param) in enumerate(model.named_parameters()):
        value = param.detach().clone()
        if name.endswith(".bias"):
            value += 0.1 * torch.randn(value.shape, generator=torch.Generator().manual_seed(index))
        weights[name] = value
    return weights


def _shard(full: torch.Tensor, param, gated_fc1: bool) -> torch.Tensor:
    """This TP rank's slice; a gated fc1 holds [gate_r; up_r] of the full [gate; up] on rank r."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return full
    size, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    parts = full.chunk(2, dim=0) if gated_fc1 else (full,)
    return torch.cat([part.chunk(size, dim=param.partition_dim)[rank] for part in parts], dim=param.partition_dim)


def _load(model, weights: dict[str, torch.Tensor], rename: Callable[[str], str] = str) -> None:
    gated = model.config.gated_linear_unit
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_shard(weights[rename(name)], param, gated and ".mlp.linear_fc1." in name))


def _full(name: str, tensor: torch.Tensor, param) -> torch.Tensor:
    """The unsharded tensor of a TP-partitioned dense param; expert params stay local."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False) or ".experts." in name:
        return tensor.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


# --- one forward/backward pass -----------------------------------------------------------------


@dataclass
class Pass:
    loss: torch.Tensor | None
    """Per-token losses of every micro-batch (None off the last pipeline stage)."""
    grads: dict[str, torch.Tensor]
    """Reduced grads (main_grad after finalize_model_grads), full for TP-sharded dense params."""
    watched: torch.Tensor | None = None
    """This rank's value of the watched activation (first micro-batch), if one was asked for."""


def _forward_step(data: Iterator, model) -> tuple[torch.Tensor, Callable]:
    inputs, labels = next(data)
    per_token = model(inputs, _positions(), None, labels=labels)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return output.mean(), {"per token": output.detach()}

    return per_token, loss_func


def _train_pass(ddp, batches: list, watch: tuple[str, str] | None = None) -> Pass:
    """Forward/backward/finalize over `batches`; `watch` = (module fqn, "input" | "output") records
    that module's first positional input or first output."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    seen: list[torch.Tensor] = []
    handle = _watch(ddp.module, watch, seen) if watch else None
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp],
            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    finally:
        if handle is not None:
            handle.remove()
    loss = torch.stack([output["per token"] for output in outputs]) if outputs else None
    grads = {name: _full(name, param.main_grad, param) for name, param in ddp.module.named_parameters()}
    return Pass(loss, grads, seen[0] if seen else None)


def _watch(model, watch: tuple[str, str], seen: list[torch.Tensor]):
    fqn, slot = watch

    def hook(module, args: tuple, output) -> None:
        value = args[0] if slot == "input" else output[0] if isinstance(output, tuple) else output
        seen.append(value.detach().clone())

    return model.get_submodule(fqn).register_forward_hook(hook)


def _with_bug(name: str, run: Callable[[], Pass]) -> tuple[Pass, Pass]:
    """(clean, buggy) results of `run`; a third, post-undo run must equal the clean one bitwise."""
    clean = run()
    undo = apply_bug(name)
    try:
        buggy = run()
    finally:
        undo()
    again = run()
    assert _same(again, clean), f"{name}: after undo() the run differs from the clean one"
    return clean, buggy


def _same(a: Pass, b: Pass) -> bool:
    same_loss = (a.loss is None and b.loss is None) or torch.equal(a.loss, b.loss)
    same_watched = (a.watched is None and b.watched is None) or torch.equal(a.watched, b.watched)
    return same_loss and same_watched and all(torch.equal(a.grads[n], b.grads[n]) for n in b.grads)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _report(name: str, what: str, value: float) -> None:
    if dist.get_rank() == 0:
        print(f"EFFECT {name}: {what} = {value:.3g}", flush=True)


def _matching(grads: dict[str, torch.Tensor], pattern: str) -> list[str]:
    names = [name for name in grads if re.search(pattern, name)]
    assert names, f"no parameter matches {pattern!r}"
    return names


def _worst(a: Pass, b: Pass, names: list[str]) -> float:
    return max(_relative(a.grads[n], b.grads[n]) for n in names)


def _assert_close(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float = 2e-5) -> None:
    relative = _relative(actual, expected)
    assert relative <= rtol, f"{what}: differs by {relative:.3g} relative (rank {dist.get_rank()})"


def _assert_moves(name: str, what: str, relative: float) -> None:
    _report(name, what, relative)
    assert relative > DIFFERENT, f"{name}: {what} moved only {relative:.3g} (rank {dist.get_rank()})"


def _reference(config, batches: list, weights: dict | None = None,
               **gpt_kwargs) -> tuple[dict[str, torch.Tensor], Pass]:
    """Single-rank model, no DDP: weights (given, or drawn with non-zero biases), per-token losses and
    grads of the mean loss."""
    model = _gpt(config, **gpt_kwargs)
    weights = weights if weights is not None else _reference_weights(model)
    _load(model, weights)
    losses = [model(inputs, _positions(), None, labels=labels) for inputs, labels in batches]
    torch.stack([loss.mean() for loss in losses]).mean().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return weights, Pass(torch.stack([loss.detach() for loss in losses]), grads)


def _tp_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _tp_max(value: float) -> float:
    """The largest of the TP ranks' values (a bug may show on one rank only)."""
    return max(part.item() for part in _tp_gather(torch.tensor(value)))


def _tp_sum(tensor: torch.Tensor) -> torch.Tensor:
    return torch.stack(_tp_gather(tensor)).sum(dim=0)


def _assert_unchanged(name: str, clean: Pass, buggy: Pass, names: list[str]) -> None:
    changed = [n for n in names if not torch.equal(buggy.grads[n], clean.grads[n])]
    assert not changed, f"{name}: grads that should not move did: {changed}"


def _assert_same_loss(name: str, clean: Pass, buggy: Pass) -> None:
    assert torch.equal(buggy.loss, clean.loss), f"{name}: the forward (loss) changed"


# --- TP / SP -----------------------------------------------------------------------------------


def tensor_parallel_bugs(config: dict) -> None:
    """TP2 (+SP) bugs on a dense, a SwiGLU and a MoE GPT; dense and SwiGLU checked against TP1."""
    _start()
    try:
        batches = [_batch(7)]
        _parallel(tp=1)
        dense_weights, dense_expected = _reference(_config(), batches)
        gated_weights, gated_expected = _reference(_gated_config(), batches)
        undo = apply_bug("swiglu-tp-shard")
        try:  # TP1 has no odd TP rank: the bug must not change anything there
            _, gated_tp1_buggy = _reference(_gated_config(), batches, gated_weights)
        finally:
            undo()
        assert torch.equal(gated_tp1_buggy.loss, gated_expected.loss), "swiglu-tp-shard changed a TP1 run"
        fp8_reference = _reference(_config(), batches, spec=_fp8_spec()) if config["fp8"] else None
        _parallel(tp=2)
        _dense_tp_bugs(dense_weights, dense_expected, batches)
        _swiglu_bug(gated_weights, gated_expected, batches)
        _router_bug(batches)
        if fp8_reference is not None:
            _fp8_bug(*fp8_reference, batches)
    finally:
        _finish()


def _dense_tp_bugs(weights: dict, expected: Pass, batches: list) -> None:
    config = _config(tp=2, sp=True)
    model = _gpt(config)
    _load(model, weights)
    ddp = _ddp(model, config)
    clean = _train_pass(ddp, batches)
    _assert_close("TP2+SP per-token loss vs TP1", clean.loss, expected.loss, rtol=1e-5)
    for name, grad in expected.grads.items():
        _assert_close(f"TP2+SP grad of {name} vs TP1", clean.grads[name], grad)
    run = lambda: _train_pass(ddp, batches)  # noqa: E731
    _final_norm_bug(run)
    for name, watch in (("vocab-embedding-mask", ("embedding.word_embeddings", "output")),
                        ("row-parallel-bias-per-rank", ("decoder.layers.0.self_attention.linear_proj", "output"))):
        clean, buggy = _with_bug(name, lambda: _train_pass(ddp, batches, watch))  # noqa: B023
        _assert_moves(name, f"{watch[0]} {watch[1]}, max rel diff", _relative(buggy.watched, clean.watched))
        _assert_moves(name, "per-token loss, max rel diff", _relative(buggy.loss, clean.loss))
    _wgrad_only_bug("sp-gather-wrong-dim", run, moved=r"(linear_qkv|linear_fc1|output_layer)\.weight$",
                    kept=r"(linear_proj|linear_fc2)\.weight$|layernorm")
    _wgrad_only_bug("attn-dq-wrong", run, moved=r"layers\.\d+\.self_attention\.linear_qkv\.weight$",
                    kept=r"^output_layer\.weight$|final_layernorm|layers\.1\.mlp\.")


def _final_norm_bug(run: Callable[[], Pass]) -> None:
    name = "sp-final-norm-grad"
    clean, buggy = _with_bug(name, run)
    norm = _matching(clean.grads, r"^decoder\.final_layernorm\.")
    _assert_same_loss(name, clean, buggy)
    _assert_unchanged(name, clean, buggy, [n for n in clean.grads if n not in norm])
    for n in norm:  # each rank kept its own sequence shard's partial grad: the parts sum to the reduced one
        _assert_close(f"{name}: TP sum of the partial grads of {n}", _tp_sum(buggy.grads[n]), clean.grads[n])
    _assert_moves(name, "final_layernorm grad, max rel diff", _worst(buggy, clean, norm))


def _wgrad_only_bug(name: str, run: Callable[[], Pass], moved: str, kept: str) -> None:
    """A backward-only bug: loss bitwise equal, `kept` grads bitwise equal, `moved` grads off."""
    clean, buggy = _with_bug(name, run)
    _assert_same_loss(name, clean, buggy)
    _assert_unchanged(name, clean, buggy, _matching(clean.grads, kept))
    _assert_moves(name, f"grads /{moved}/, max rel diff", _worst(buggy, clean, _matching(clean.grads, moved)))


def _swiglu_bug(weights: dict, expected: Pass, batches: list) -> None:
    name = "swiglu-tp-shard"
    config = _gated_config(tp=2)
    model = _gpt(config)
    _load(model, weights)
    ddp = _ddp(model, config)
    watch = ("decoder.layers.0.mlp.linear_fc2", "input")
    clean, buggy = _with_bug(name, lambda: _train_pass(ddp, batches, watch))
    _assert_close("TP2 SwiGLU per-token loss vs TP1", clean.loss, expected.loss, rtol=1e-5)
    _assert_close("TP2 SwiGLU fc1 grad vs TP1", clean.grads["decoder.layers.0.mlp.linear_fc1.weight"],
                  _shard_back(expected.grads["decoder.layers.0.mlp.linear_fc1.weight"]))
    _assert_moves(name, f"{watch[0]} {watch[1]} (odd rank), max rel diff",
                  _tp_max(_relative(buggy.watched, clean.watched)))
    _assert_moves(name, "linear_fc1 grads, max rel diff", _worst(buggy, clean, _matching(clean.grads, "linear_fc1")))
    _report(name, "per-token loss, max rel diff", _relative(buggy.loss, clean.loss))


def _shard_back(full: torch.Tensor, size: int = 2) -> torch.Tensor:
    """The TP1 [gate; up] fc1 tensor in the order TP2's gathered [gate_0; up_0; gate_1; up_1] has."""
    gate, up = full.chunk(2, dim=0)
    return torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(size), up.chunk(size))])


def _router_bug(batches: list) -> None:
    name = "sp-router-replica"
    config = _moe_config(tp=2, sp=True)
    ddp = _ddp(_gpt(config), config)
    clean, buggy = _with_bug(name, lambda: _train_pass(ddp, batches))
    routers = _matching(clean.grads, r"mlp\.router\.weight$")
    _assert_same_loss(name, clean, buggy)
    _assert_unchanged(name, clean, buggy, [n for n in clean.grads if n not in routers])
    for n in routers:
        replicas = _tp_gather(clean.grads[n])
        assert torch.equal(replicas[0], replicas[1]) and replicas[0].abs().max() > 0, f"{n}: clean TP replicas differ"
        _assert_close(f"{name}: TP sum of the partial grads of {n}", _tp_sum(buggy.grads[n]), clean.grads[n])
        buggy_replicas = _tp_gather(buggy.grads[n])
        _assert_moves(name, f"{n} grad, rank 0 vs rank 1 rel diff", _relative(buggy_replicas[0], buggy_replicas[1]))
    _assert_moves(name, "router grads, max rel diff", _worst(buggy, clean, routers))


def _fp8_spec():
    from ttrace_core.integrations import fp8

    return fp8.fp8_gpt_layer_local_spec(fp8.Fp8Recipe())


def _fp8_bug(weights: dict, expected: Pass, batches: list) -> None:
    name = "fp8-amax-wrong-group"
    config = _config(tp=2)
    model = _gpt(config, spec=_fp8_spec())
    _load(model, weights)
    ddp = _ddp(model, config)
    watch = ("decoder.layers.0.self_attention.linear_qkv", "output")
    clean, buggy = _with_bug(name, lambda: _train_pass(ddp, batches, watch))
    _assert_close("TP2 fp8 per-token loss vs TP1 fp8", clean.loss, expected.loss, rtol=1e-5)
    _assert_moves(name, f"{watch[0]} {watch[1]} (worst TP rank), max rel diff",
                  _tp_max(_relative(buggy.watched, clean.watched)))
    _report(name, "per-token loss, max rel diff", _relative(buggy.loss, clean.loss))


# --- DP / distributed optimizer / expert parallel ----------------------------------------------


def data_parallel_bugs(config: dict) -> None:
    """DP2 bugs (grad averaging, loss scale, distributed optimizer) and the EP2 expert-scaling bug."""
    _start()
    try:
        _parallel(tp=1)
        all_batches = [_batch(100 + rank) for rank in range(dist.get_world_size())]
        batches = [all_batches[dist.get_rank()]]
        weights, expected = _reference(_config(), all_batches)  # mean over both ranks' batches = DDP's average
        _dp_grad_bugs(weights, expected, batches)
        _distopt_bug(weights, expected, batches)
        moe_weights, moe_expected = _reference(_moe_config(), all_batches)
        _parallel(tp=1, ep=2)
        _expert_bug(moe_weights, moe_expected, batches)
    finally:
        _finish()


def _dp_grad_bugs(weights: dict, expected: Pass, batches: list) -> None:
    config = _config()
    model = _gpt(config)
    _load(model, weights)
    ddp = _ddp(model, config)
    run = lambda: _train_pass(ddp, batches)  # noqa: E731
    for name in ("dp-grad-avg-twice", "loss-scale-dp-cp"):
        clean, buggy = _with_bug(name, run)
        for n, grad in clean.grads.items():
            _assert_close(f"DP2 grad of {n} vs one process", grad, expected.grads[n])
            _assert_close(f"{name}: dp x buggy grad of {n}", 2 * buggy.grads[n], grad, rtol=1e-6)
        _assert_moves(name, "grads, max rel diff", _worst(buggy, clean, list(clean.grads)))


LR, ADAM_EPS = 1e-2, 1e-3


def _adam_model(weights: dict):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = _config()
    model = _gpt(config)
    _load(model, weights)
    ddp = _ddp(model, config, dist_opt=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, adam_eps=ADAM_EPS, weight_decay=0.0, clip_grad=0.0, params_dtype=torch.float32,
        use_distributed_optimizer=True), [ddp])
    return ddp, optimizer


def _optimizer_step(ddp, optimizer, batches: list) -> None:
    optimizer.zero_grad()
    _train_pass(ddp, batches)
    success, _, _ = optimizer.step()
    assert success, "optimizer.step() reported a failed update"


def _distopt_bug(weights: dict, expected: Pass, batches: list) -> None:
    name = "distopt-stale-params"
    clean_ddp, clean_optimizer = _adam_model(weights)
    _optimizer_step(clean_ddp, clean_optimizer, batches)
    buggy_ddp, buggy_optimizer = _adam_model(weights)
    undo = apply_bug(name)
    try:
        _optimizer_step(buggy_ddp, buggy_optimizer, batches)
    finally:
        undo()
    clean = {n: p.detach().clone() for n, p in clean_ddp.module.named_parameters()}
    buggy = {n: p.detach().clone() for n, p in buggy_ddp.module.named_parameters()}
    stale = 0
    for n, value in clean.items():
        grad = expected.grads[n]  # Adam's first step (bias-corrected): lr * g / (|g| + eps)
        _assert_close(f"dist-opt Adam step of {n} vs one process", value,
                      weights[n] - LR * grad / (grad.abs() + ADAM_EPS))
        updated, kept = buggy[n] == value, buggy[n] == weights[n]
        assert bool((updated | kept).all()), f"{name}: {n} holds values that are neither updated nor stale"
        stale += int((kept & ~updated).sum())
    assert stale > 0, f"{name}: no stale parameter element on rank {dist.get_rank()}"
    _assert_moves(name, "post-step params, max rel diff", max(_relative(buggy[n], clean[n]) for n in clean))
    step2_clean, step2_buggy = _train_pass(clean_ddp, batches), _train_pass(buggy_ddp, batches)
    _assert_moves(name, "step-2 per-token loss, max rel diff", _relative(step2_buggy.loss, step2_clean.loss))


def _expert_name(rank: int) -> Callable[[str], str]:
    """EP2 parameter name -> one-process name: rank r's local expert 0 is global expert r."""
    return lambda name: name.replace(".local_experts.0.", f".local_experts.{rank}.")


def _expert_bug(weights: dict, expected: Pass, batches: list) -> None:
    name = "expert-grad-scale"
    config = _moe_config(ep=2)
    rename = _expert_name(dist.get_rank())
    clean_model, buggy_model = _gpt(config), _gpt(config)
    _load(clean_model, weights, rename)
    _load(buggy_model, weights, rename)
    clean_ddp = _ddp(clean_model, config)
    undo = apply_bug(name)  # acts when DDP allocates the expert grad buffers
    try:
        buggy_ddp = _ddp(buggy_model, config)
    finally:
        undo()
    clean, buggy = _train_pass(clean_ddp, batches), _train_pass(buggy_ddp, batches)
    experts = _matching(clean.grads, r"\.experts\.")
    for n, grad in clean.grads.items():
        _assert_close(f"DP2 EP2 grad of {n} vs one process", grad, expected.grads[rename(n)])
    _assert_same_loss(name, clean, buggy)
    _assert_unchanged(name, clean, buggy, [n for n in clean.grads if n not in experts])
    for n in experts:  # dp / expert_dp = 2 / 1
        _assert_close(f"{name}: buggy grad of {n} / 2", buggy.grads[n] / 2, clean.grads[n], rtol=1e-6)
    _assert_moves(name, "expert grads, max rel diff", _worst(buggy, clean, experts))


# --- pipeline ----------------------------------------------------------------------------------


def pipeline_bugs(config: dict) -> None:
    """PP2 with tied embeddings (1F1B over 2 micro-batches) against one stage."""
    from megatron.core import parallel_state

    _start()
    try:
        name = "pp-tied-embedding-grad"
        batches = [_batch(200 + index) for index in range(2)]
        _parallel(tp=1)
        weights, expected = _reference(_config(), batches, share_embeddings_and_output_weights=True)
        _parallel(tp=1, pp=2)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        model_config = _config(pp=2)
        model = _gpt(model_config, pre_process=stage == 0, post_process=stage == 1,
                     share_embeddings_and_output_weights=True)
        rename = _stage_name(stage, layers_per_stage=1)
        _load(model, weights, rename)
        ddp = _ddp(model, model_config)
        clean, buggy = _with_bug(name, lambda: _train_pass(ddp, batches))
        for n, grad in clean.grads.items():
            _assert_close(f"stage {stage} grad of {n} vs one stage", grad, expected.grads[rename(n)])
        tied = [_matching(clean.grads, r"^(embedding\.word_embeddings|output_layer)\.weight$")[0]]
        _assert_unchanged(name, clean, buggy, [n for n in clean.grads if n not in tied])
        summed = buggy.grads[tied[0]].clone()
        dist.all_reduce(summed, group=parallel_state.get_embedding_group())
        _assert_close(f"{name}: sum of the stages' partial grads of {tied[0]}", summed, clean.grads[tied[0]])
        _assert_moves(name, f"stage {stage} {tied[0]} grad, max rel diff", _worst(buggy, clean, tied))
    finally:
        _finish()
