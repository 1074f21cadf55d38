"""One training run of a megatron-core GPT on this rank: what `ttrace example megatron-gpt` launches.

GPTModel with the local (non-TransformerEngine) spec, Megatron DDP, the Megatron optimizer and
`get_forward_backward_func` over micro-batches, on CPU ranks through megatron_cpu. Every layout
trains the same logical model on the same global batch: weights come from (seed, global parameter
name) sliced by each parameter's TP layout, micro-batches from (seed, global micro-batch id).
The reference is this same script on one process with every degree 1. The ttrace lines are marked
`# ttrace`; a test counts them.
"""

from __future__ import annotations

import json
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import ttrace_core as ttrace
from ttrace_core.record.generator import WeightPerturbation, normal_full, tokens_full
from ttrace_core.canonicalize.shards import shard
from ttrace_core.integrations import megatron_cpu
from ttrace_examples.megatron_gpt import features
from ttrace_core.integrations.megatron import megatron_rename, parameter_layouts, unwrap
from ttrace_core.format.naming import global_fqn

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

ENTRYPOINT = "ttrace_examples.megatron_gpt.train:run"
RANK_IMPORTS = ("megatron.core", "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
                "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.pipeline_parallel")
"""What every rank imports (record/launch.py imports it once before forking the ranks)."""
LOSSES_FILE = "losses.json"
# fp8: bf16 parameters and compute (Float16Module) with the four transformer GEMMs in emulated FP8
# (per-tensor current scaling, e4m3 forward / e5m2 gradients, amax reduced over TP), as TE runs it.
# fp64: the oracle of the Dynamo-style baseline in benchmarks/detection.py (grads kept in fp64 too).
PRECISIONS = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class MegatronModelConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    """A multiple of the TP degree: no vocab padding."""
    seq_len: int = 16
    """A multiple of the TP degree under sequence parallelism."""
    swiglu: bool = False
    """SwiGLU MLP (megatron's gated_linear_unit): fc1 holds [gate; up] per TP rank."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer (summed across the first and last stage under PP)."""
    num_experts: int = 0
    """MoE with this many experts; 0 is a dense MLP."""
    moe_topk: int = 2
    """Experts per token (at most num_experts)."""
    moe_dispatcher: str = "allgather"
    """megatron's token dispatcher: "allgather" or "alltoall"."""
    # --- Llama's architecture choices (`--llama`; the HF Llama reference of docs/porting.md builds the same model) ---
    normalization: str = "LayerNorm"
    """megatron's `normalization`: "LayerNorm" or "RMSNorm"."""
    position_embedding: str = "learned_absolute"
    """GPTModel's position_embedding_type: "learned_absolute" or "rope" (half-split rotary, megatron's default)."""
    num_query_groups: int | None = None
    """Key/value heads under grouped-query attention (None: one per attention head); a multiple of the TP degree."""
    ffn_hidden_size: int | None = None
    """The MLP's intermediate size (None: megatron's 4 x hidden_size)."""
    add_bias_linear: bool = True
    """Biases on every linear (Llama has none)."""
    norm_epsilon: float = 1e-5
    """megatron's layernorm_epsilon (Llama's rms_norm_eps)."""
    rotary_base: int = 10000
    """RoPE's theta (with position_embedding "rope")."""

    def __post_init__(self) -> None:
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {self.normalization!r}: choose LayerNorm or RMSNorm")
        if self.position_embedding not in ("learned_absolute", "rope"):
            raise ValueError(f"position_embedding {self.position_embedding!r}: choose learned_absolute or rope")
        if self.num_query_groups is not None and (self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups):
            raise ValueError(f"num_query_groups {self.num_query_groups} must divide num_attention_heads {self.num_attention_heads}")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass(kw_only=True, slots=True)
class MegatronGPTRunConfig:
    """One run of the example; `ttrace example megatron-gpt` records it through `ttrace record`, which
    also says where (the session's run directory) and in which mode (record, perturb, rewrite)."""

    tp: int = 1
    sp: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    pp: int = 1
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (megatron's virtual_pipeline_model_parallel_size): the
    model is built as this many chunks per rank and trained with the interleaved 1F1B schedule."""
    dp: int = 1
    dist_opt: bool = False
    """Megatron's distributed optimizer (shards optimizer state over DP)."""
    ep: int = 1
    """Expert parallelism over the data-parallel ranks (needs --moe; dp must be a multiple)."""
    precision: str = "fp32"
    steps: int = 1
    seed: int = 0
    num_micro_batches: int = 4
    micro_batch_size: int = 2
    lr: float = 0.01
    adam_eps: float = 1e-3
    """Adam (the distributed optimizer supports nothing else) with a large eps: the update stays a
    smooth function of the gradient, so round-off in near-zero gradients is not blown up to +-lr."""
    bug: str | None = None
    stats_only: bool = False
    record_steps: int | None = None
    """Trace only the first this many steps (None: all); every step trains and logs its loss."""
    # --- feature-matrix fields (features.py; benchmarks/feature_matrix.py, docs/findings.md) ---
    moe_aux_loss: str | None = None
    """megatron's moe_router_load_balancing_type: aux_loss, seq_aux_loss or global_aux_loss (None: off)."""
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0
    """The router's z-loss coefficient (0: off)."""
    moe_shared_expert_size: int = 0
    """A shared expert of this intermediate size beside the routed ones (0: none)."""
    mtp_num_layers: int = 0
    """Multi-token prediction layers (0: none)."""
    per_token_loss: bool = False
    """megatron's calculate_per_token_loss: gradients divided by the step's global token count."""
    moe_global_aux_loss_dp_scaled: bool = False
    """A control, not a megatron option: global_aux_loss scaled by the DP size (features.py)."""
    # --- end of feature-matrix fields ---
    model: MegatronModelConfig = field(default_factory=MegatronModelConfig)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.model.num_layers < 1:
            raise ValueError(f"--steps {self.steps} --num-layers {self.model.num_layers}: both must be at least 1")
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"parallel degrees must be >= 1, got tp {self.tp} pp {self.pp} dp {self.dp}")
        if self.sp and self.tp == 1:
            raise ValueError("--sp needs --tp 2 or more")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: choose from {sorted(PRECISIONS)}")
        if self.ep > 1 and (not self.model.num_experts or self.dp % self.ep or self.model.num_experts % self.ep):
            raise ValueError(f"--ep {self.ep} needs --moe and divides both dp ({self.dp}) and the experts ({self.model.num_experts})")
        if self.num_micro_batches % self.dp:
            raise ValueError(f"num_micro_batches {self.num_micro_batches} is not a multiple of dp {self.dp}")
        if self.vpp < 1 or (self.vpp > 1 and self.pp == 1):
            raise ValueError(f"--vpp {self.vpp} needs --pp 2 or more (1 for no virtual pipeline)")
        if self.vpp > 1 and (self.num_micro_batches // self.dp) % self.pp:
            # megatron's interleaved schedule runs micro-batches in groups of pp per virtual stage
            raise ValueError(f"--vpp {self.vpp}: the micro-batches per DP rank "
                             f"({self.num_micro_batches // self.dp}) must be a multiple of pp {self.pp}")
        m = self.model
        if m.num_layers % (self.pp * self.vpp) or m.query_groups % self.tp or m.vocab_size % self.tp or m.seq_len % self.tp:
            raise ValueError(f"the model ({m}) does not divide evenly over tp {self.tp} / pp {self.pp} x vpp {self.vpp}")
        if self.bug is not None:
            from ttrace_examples.megatron_gpt.bugs import ALL_BUGS

            if self.bug not in ALL_BUGS:
                raise ValueError(f"unknown bug {self.bug!r}; `ttrace bugs` lists the zoo: {', '.join(sorted(ALL_BUGS))}")
        features.check_features(self)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> MegatronGPTRunConfig:
        """Also reads configs recorded by older versions (with `out`, `perturbation` fields, now the session's)."""
        known = {k: v for k, v in data.items() if k in MegatronGPTRunConfig.__dataclass_fields__}
        return MegatronGPTRunConfig(**{**known, "model": MegatronModelConfig(**data.get("model", {}))})


def transformer_config(config: MegatronGPTRunConfig):
    from megatron.core.transformer import TransformerConfig

    m, dtype = config.model, PRECISIONS[config.precision]
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        use_cpu_initialization=True, tensor_model_parallel_size=config.tp, pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
        **_interleaved_p2p_fields(config),
        sequence_parallel=config.sp, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gated_linear_unit=m.swiglu, activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        normalization=m.normalization, num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
        layernorm_epsilon=m.norm_epsilon,
        **({} if m.add_bias_linear or m.num_experts else {"add_bias_linear": False}),  # (MoE sets it itself)
        **_moe_fields(config), **features.feature_transformer_fields(config))


def _interleaved_p2p_fields(config: MegatronGPTRunConfig) -> dict:
    """Under --vpp, the p2p settings Megatron-LM's training gives the interleaved schedule by default
    (overlap_p2p_comm on, hence batch_p2p_comm off): separate sends and receives in even/odd rank
    order (p2p_communication._p2p_ops). megatron-core's own default, one batch_isend_irecv, posts a
    rank's two sends to its one neighbour at pp 2 in an order the neighbour does not receive them in:
    on gloo the activation of one chunk lands in the other's gradient buffer (same shape, no error;
    Megatron-LM #750, #1450). attach warns about that configuration (megatron.interleaved_p2p_hazard)."""
    return dict(overlap_p2p_comm=True, batch_p2p_comm=False) if config.vpp > 1 else {}


def _moe_fields(config: MegatronGPTRunConfig) -> dict:
    if not config.model.num_experts:
        return {}
    # The default, top-2 of 2 experts, sends every token to every expert, so routing is smooth in the
    # weights and round-off cannot flip a token to another expert. With more experts than top-k, a
    # token whose k-th and (k+1)-th scores are within round-off of each other can be routed apart.
    # No linear biases: the CPU MoE path lacks them.
    m = config.model
    return dict(num_moe_experts=m.num_experts, moe_router_topk=min(m.moe_topk, m.num_experts),
                moe_token_dispatcher_type=m.moe_dispatcher, add_bias_linear=False, expert_model_parallel_size=config.ep,
                moe_router_pre_softmax=m.moe_topk == 1,  # megatron asks for it at top-1 (softmax over one expert is 1)
                expert_tensor_parallel_size=1 if config.ep > 1 else None)


def init_weights(model: torch.nn.Module, seed: int, rename: tuple[tuple[str, str], ...],
                 perturbation: WeightPerturbation | None = None) -> None:
    """Every parameter from (seed, global name), in full logical shape, sliced by its TP layout."""
    with torch.no_grad():
        for fqn, layout in parameter_layouts(model).items():
            param, name = model.get_parameter(fqn), global_fqn(fqn, rename)
            full = _logical_weight(seed, name, layout.global_shape)
            if perturbation is not None:
                full = perturbation.apply(seed, name, full)
            param.copy_(shard(full, layout).to(param.dtype))


def _logical_weight(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        return normal_full(seed, name, shape, mean=1.0, std=0.1)
    std = 0.3 if "embedding" in name else 0.02 if leaf == "bias" else 0.08
    return normal_full(seed, name, shape, std=std)


def micro_batch(config: MegatronGPTRunConfig, global_id: int) -> dict[str, torch.Tensor]:
    m = config.model
    tokens = tokens_full(config.seed, f"batch.{global_id}", (config.micro_batch_size, m.seq_len + 1), m.vocab_size)
    positions = torch.arange(m.seq_len).expand(config.micro_batch_size, m.seq_len)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "positions": positions}


def forward_step(data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model

    batch = next(data_iterator)
    per_token_loss = model(batch["tokens"], batch["positions"], None, labels=batch["labels"])

    if get_attr_wrapped_model(model, "config").calculate_per_token_loss:
        return per_token_loss, features.per_token_loss_func

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    return per_token_loss, loss_func


def _in_process_group(config: MegatronGPTRunConfig, body) -> None:
    megatron_cpu.enable()
    if config.bug is not None:  # the candidate only: the reference runs unpatched
        from ttrace_examples.megatron_gpt.bugs import apply_bug

        apply_bug(config.bug)
    features.apply_upstream_patches(config)
    dist.init_process_group("gloo")
    try:
        body(config)
        dist.barrier()
    finally:
        # No collective here: after a failure on one rank a barrier would wait for the others forever.
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run(config_dict: dict) -> None:
    _in_process_group(MegatronGPTRunConfig.from_dict(config_dict), _train)


def layer_spec(config: MegatronGPTRunConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    moe = dict(num_experts=config.model.num_experts, moe_grouped_gemm=False) if config.model.num_experts else {}
    if config.precision != "fp8":
        return get_gpt_layer_local_spec(**moe)
    from ttrace_core.integrations.fp8 import Fp8Recipe, fp8_gpt_layer_local_spec

    return fp8_gpt_layer_local_spec(Fp8Recipe(scaling="current", format="hybrid"), **moe)


def _build(config: MegatronGPTRunConfig):
    """(DDP model, optimizer, local -> global renames) of a run without virtual pipeline stages."""
    chunks, optimizer = build_chunks(config)
    if len(chunks) != 1:
        raise ValueError(f"--vpp {config.vpp}: the model is {len(chunks)} chunks; call build_chunks")
    return chunks[0], optimizer, megatron_rename(chunks[0])


def build_chunks(config: MegatronGPTRunConfig):
    """This rank's model as megatron users build it: one GPTModel per virtual pipeline stage (one
    without --vpp), each with its own layers (vp_stage sets their global layer numbers), embedding on
    the first stage's first chunk, output layer on the last stage's last chunk, each inside its own
    Megatron DDP, and one Megatron optimizer over all of them. Returns (DDP chunks, optimizer)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel_state.initialize_model_parallel(config.tp, config.pp, expert_model_parallel_size=config.ep,
                                             virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
                                             expert_tensor_parallel_size=1 if config.ep > 1 else None)
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    tconfig = transformer_config(config)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=config.precision != "fp64",
                                               use_distributed_optimizer=config.dist_opt)
    vp_stages = list(range(config.vpp)) if config.vpp > 1 else [None]
    # As Megatron-LM's training.py does: only the first chunk's grad buffer is bucketed.
    chunks = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=_model_chunk(config, tconfig, vp_stage),
                                      disable_bucketing=index > 0) for index, vp_stage in enumerate(vp_stages)]
    no_sync = [chunk.no_sync for chunk in chunks]
    tconfig.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=config.lr, adam_eps=config.adam_eps, weight_decay=0.0, clip_grad=0.0, bf16=tconfig.bf16,
        params_dtype=PRECISIONS[config.precision], use_distributed_optimizer=config.dist_opt), chunks)
    return chunks, optimizer


def _model_chunk(config: MegatronGPTRunConfig, tconfig, vp_stage: int | None) -> torch.nn.Module:
    """The GPTModel of one virtual pipeline stage (the whole stage when vp_stage is None), its weights
    drawn from their global names, in Float16Module under bf16."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    model = GPTModel(tconfig, layer_spec(config), vocab_size=config.model.vocab_size,
                     max_sequence_length=config.model.seq_len,
                     pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                     post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                     share_embeddings_and_output_weights=config.model.tie_embeddings, vp_stage=vp_stage,
                     position_embedding_type=config.model.position_embedding, rotary_base=config.model.rotary_base,
                     **features.gpt_model_kwargs(config, tconfig, layer_spec(config), vp_stage))
    if config.precision == "fp64":  # the local spec's torch norms ignore params_dtype
        model = model.double()
    init_weights(model, config.seed, megatron_rename(model), ttrace.weight_perturbation())  # ttrace
    return Float16Module(tconfig, model) if tconfig.bf16 else model


def _train(config: MegatronGPTRunConfig) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks, optimizer = build_chunks(config)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    local_micro_batches = config.num_micro_batches // dp_size
    ddp = chunks[0] if len(chunks) == 1 else chunks  # the list of chunks under --vpp
    session = ttrace.attach(ddp, optimizer, weights="own")  # ttrace
    if session.one_module_replay:  # `ttrace localize --module`: only that module runs, on recorded inputs
        session.replay_one_module(ddp if len(chunks) > 1 else unwrap(ddp))
        return
    forward_backward = get_forward_backward_func()
    losses = []
    for step in range(config.steps):
        batches = [micro_batch(config, local * dp_size + dp_rank) for local in range(local_micro_batches)]
        recorded = config.record_steps is None or step < config.record_steps
        with session.step(step) if recorded else nullcontext():  # ttrace
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            # The interleaved schedule reads one data iterator per chunk.
            data = iter(batches) if len(chunks) == 1 else [iter(batches) for _ in chunks]
            reduced = forward_backward(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                       num_microbatches=local_micro_batches, seq_length=config.model.seq_len,
                                       micro_batch_size=config.micro_batch_size, forward_only=False)
            optimizer.step()
        losses.append(_global_loss(reduced))
    session.close()  # ttrace
    if session.run_dir is not None:
        _write_losses(session.run_dir, losses)


def _global_loss(reduced: list[dict]) -> float | None:
    """The step's mean loss over all micro-batches of all DP ranks (None off the last stage)."""
    from megatron.core import parallel_state

    if not parallel_state.is_pipeline_last_stage():
        return None
    local = torch.stack([r["loss"] for r in reduced]).double().mean().reshape(1)
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return float(local) / parallel_state.get_data_parallel_world_size()


def _write_losses(run_dir: Path, losses: list[float | None]) -> None:
    """losses.json beside the trace: the per-step loss curve (the loss-curve baseline reads it)."""
    from megatron.core import parallel_state

    first_of_last_stage = (parallel_state.is_pipeline_last_stage() and parallel_state.get_data_parallel_rank() == 0
                           and parallel_state.get_tensor_model_parallel_rank() == 0)
    if first_of_last_stage:
        Path(run_dir, LOSSES_FILE).write_text(json.dumps({"losses": losses}))
