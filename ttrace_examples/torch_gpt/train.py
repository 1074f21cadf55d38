"""One training run of the example GPT on this rank: the function `ttrace example torch-gpt` launches.

Every layout trains the same logical model on the same global batch: `num_micro_batches`
micro-batches per step, each generated from (seed, global micro-batch id), with weights generated
from (seed, parameter name) and sliced by each parameter's layout. The reference accumulates all
micro-batches on one rank; DDP/FSDP2 rank r takes micro-batches r, r + dp, ...; pipelining feeds
all of them through its schedule. The ttrace lines are marked `# ttrace`: the same public API a user's script calls
(`ttrace_core.attach`), with the example's own weight draw (weights="own") and layout declarations.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from ttrace_examples.torch_gpt.context_parallel import apply_context_parallel, sequence_chunk
from ttrace_examples.torch_gpt.model import GPT, GPTConfig, loss_fn
from ttrace_examples.torch_gpt.parallelize import TORCH_GPT_BUGS, apply_ddp, apply_fsdp, apply_tensor_parallel
import ttrace_core as ttrace
from ttrace_core.format.naming import LOSS_FUNCTION
from ttrace_core.record.generator import WeightPerturbation, local_from_full, normal_full, tokens_full
from ttrace_core.integrations.dtensor import declare_parallelize_plan, layout_from_dtensor
from ttrace_core.canonicalize.placements import coordinate_from_rank
from ttrace_core.format.schema import RunManifest
from ttrace_core.record.tracer import TracerConfig

PRECISIONS = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
ENTRYPOINT = "ttrace_examples.torch_gpt.train:run"


@dataclass(kw_only=True, slots=True)
class TorchGPTRunConfig:
    """One run of the example; `ttrace example torch-gpt` records it through `ttrace record`, which
    also says where (the session's run directory) and in which mode (record, perturb, rewrite)."""

    tp: int = 1
    sp: bool = False
    """Sequence parallelism on top of TP."""
    pp: int = 1
    dp: int = 1
    """DistributedDataParallel degree."""
    fsdp: int = 1
    """FSDP2 (fully_shard) degree."""
    cp: int = 1
    """Context-parallel degree: each rank holds a contiguous chunk of every sequence."""
    precision: str = "fp32"
    steps: int = 1
    seed: int = 0
    num_micro_batches: int = 4
    micro_batch_size: int = 2
    lr: float = 0.1
    bug: str | None = None
    stats_only: bool = False
    model: GPTConfig = field(default_factory=GPTConfig)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.model.num_layers < 1:
            raise ValueError(f"--steps {self.steps} --num-layers {self.model.num_layers}: both must be at least 1")
        degrees = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "fsdp": self.fsdp, "cp": self.cp}
        if any(d < 1 for d in degrees.values()):
            raise ValueError(f"parallel degrees must be >= 1, got {degrees}")
        if sum(d > 1 for d in degrees.values()) > 1:
            raise ValueError(f"torch-gpt runs one parallelism at a time (TP with or without SP, DDP, FSDP2, PP or CP), got {degrees}")
        if self.model.seq_len % self.cp:
            raise ValueError(f"seq_len {self.model.seq_len} is not a multiple of --cp {self.cp}")
        if self.sp and self.tp == 1:
            raise ValueError("--sp needs --tp 2 or more")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: choose from {sorted(PRECISIONS)}")
        data_parallel = self.dp * self.fsdp
        if self.num_micro_batches % data_parallel or self.num_micro_batches < self.pp:
            raise ValueError(f"num_micro_batches {self.num_micro_batches} must be a multiple of dp/fsdp ({data_parallel}) and >= pp")
        if self.model.num_layers % self.pp or self.model.num_heads % self.tp or self.model.vocab_size % self.tp:
            raise ValueError(f"the model ({self.model}) does not divide evenly over tp {self.tp} / pp {self.pp}")
        if self.bug is not None:
            if self.bug not in TORCH_GPT_BUGS:
                raise ValueError(f"unknown bug {self.bug!r}; `ttrace bugs` lists them: {sorted(TORCH_GPT_BUGS)}")
            needed = TORCH_GPT_BUGS[self.bug].requires
            if degrees[needed] == 1:
                raise ValueError(f"bug {self.bug!r} triggers only with --{needed} 2 or more")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.fsdp * self.cp

    @property
    def data_parallel_size(self) -> int:
        return self.dp * self.fsdp

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> TorchGPTRunConfig:
        """Also reads configs recorded by older versions (with `out`, `perturbation` fields, now the session's)."""
        known = {k: v for k, v in data.items() if k in TorchGPTRunConfig.__dataclass_fields__}
        return TorchGPTRunConfig(**{**known, "model": GPTConfig(**data.get("model", {}))})


def init_weights(model: nn.Module, seed: int, dtype: torch.dtype, perturbation: WeightPerturbation | None = None) -> None:
    """Give every parameter its logical value from (seed, fqn), sliced by the parameter's own layout."""
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            leaf = fqn.rsplit(".", 1)[-1]
            is_norm = ".ln" in f".{fqn}"
            if is_norm and leaf == "weight":
                full = normal_full(seed, fqn, tuple(param.shape), mean=1.0, std=0.1)
            else:
                std = 0.3 if "emb" in fqn else 0.02 if leaf == "bias" else 0.08
                full = normal_full(seed, fqn, tuple(param.shape), std=std)
            if perturbation is not None:
                full = perturbation.apply(seed, fqn, full)
            full = full.to(dtype)
            if isinstance(param, torch.distributed.tensor.DTensor):
                param.to_local().copy_(local_from_full(full, layout_from_dtensor(param)))
            else:
                param.copy_(full)


def micro_batch(config: TorchGPTRunConfig, global_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (config.micro_batch_size, config.model.seq_len + 1)
    tokens = tokens_full(config.seed, f"batch.{global_id}", shape, config.model.vocab_size)
    return tokens[:, :-1], tokens[:, 1:]


def _mesh(config: TorchGPTRunConfig):
    from torch.distributed.device_mesh import init_device_mesh

    for name in ("tp", "pp", "dp", "fsdp", "cp"):
        if getattr(config, name) > 1:
            return init_device_mesh("cpu", (getattr(config, name),), mesh_dim_names=(name,))
    return None


def manifest_for(config: TorchGPTRunConfig, role: str) -> RunManifest:
    degrees = {"tp": config.tp, "sp": int(config.sp), "pp": config.pp, "dp": config.dp, "fsdp": config.fsdp, "cp": config.cp}
    axes = [name for name in ("tp", "pp", "dp", "fsdp", "cp") if degrees[name] > 1]
    mesh_shape = [degrees[name] for name in axes]
    return RunManifest(role=role, world_size=config.world_size, degrees=degrees, precision=config.precision,
                       seed=config.seed, model={**config.model.to_dict(), "num_micro_batches": config.num_micro_batches,
                                                "micro_batch_size": config.micro_batch_size, "lr": config.lr},
                       entrypoint={"factory": ENTRYPOINT, "config": config.to_dict()},
                       mesh_shape=mesh_shape, mesh_axis_names=axes,
                       rank_coordinates=[list(coordinate_from_rank(r, tuple(mesh_shape))) for r in range(config.world_size)])


def run(config_dict: dict) -> None:
    config = TorchGPTRunConfig.from_dict(config_dict)
    torch.manual_seed(config.seed)
    if config.world_size > 1:
        dist.init_process_group("gloo")
    try:
        _train(config)
        if dist.is_initialized():
            dist.barrier()
    finally:
        # No collective here: after a failure on one rank a barrier would wait forever for the
        # ranks still training; exiting lets the launcher stop them at once.
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TorchGPTRunConfig) -> None:
    dtype = PRECISIONS[config.precision]
    mesh = _mesh(config)
    model = GPT(config.model).to(dtype)
    if config.pp > 1:
        model.keep_stage(mesh.get_local_rank(), config.pp)
    plan = apply_tensor_parallel(model, mesh, sequence_parallel=config.sp, bug=config.bug) if config.tp > 1 else {}
    if config.fsdp > 1:
        apply_fsdp(model, mesh)
    init_weights(model, config.seed, dtype, ttrace.weight_perturbation())  # ttrace
    if config.cp > 1:
        apply_context_parallel(model, mesh, seq_len=config.model.seq_len, bug=config.bug)
    uses_ddp = config.dp > 1 or config.cp > 1
    wrapped = apply_ddp(model, bug=config.bug, group=mesh.get_group()) if uses_ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    local_micro_batches = config.num_micro_batches // config.data_parallel_size
    dp_rank = mesh.get_local_rank() if config.data_parallel_size > 1 else 0
    role = "candidate" if config.world_size > 1 else "reference"
    # Backward tensors are scaled like the loss: by 1/(local micro-batches), and by cp because each
    # CP rank averages its loss over its own 1/cp of the tokens.
    loss_scale = 1.0 if config.pp > 1 else config.cp / local_micro_batches
    tracer_config = TracerConfig(exclude=("",), loss_scale=loss_scale,  # ttrace
                                 data_parallel_rank=dp_rank, data_parallel_size=config.data_parallel_size,
                                 stats_only=config.stats_only)
    session = ttrace.attach(model, optimizer, weights="own", config=tracer_config,  # ttrace
                            manifest=manifest_for(config, role))  # ttrace
    declare_parallelize_plan(session, plan, mesh)  # ttrace
    if config.cp > 1:  # every module boundary is a sequence chunk; gradients follow their tensors
        for slots in ("input.*", "output.*"):
            session.declare("*", slots, [Shard(1)], mesh)  # ttrace
        # Each rank's loss averages its own chunk; with loss_scale's factor cp the chunks' values sum to the loss.
        session.declare(LOSS_FUNCTION, "scalar.loss", ["P(sum)"], mesh)  # ttrace
    step_fn = _pipeline_step_fn(config, model, mesh) if config.pp > 1 else None
    for step in range(config.steps):
        with session.step(step):  # ttrace
            optimizer.zero_grad()
            if step_fn is not None:
                step_fn()
            else:
                _accumulate(config, wrapped, local_micro_batches, dp_rank, mesh)
            optimizer.step()
    session.close()  # ttrace


def _accumulate(config: TorchGPTRunConfig, model: nn.Module, local_micro_batches: int, dp_rank: int, mesh) -> None:
    for local_index in range(local_micro_batches):
        inputs, targets = micro_batch(config, local_index * config.data_parallel_size + dp_rank)
        if config.cp > 1:
            inputs, targets = (sequence_chunk(t, mesh.get_local_rank(), config.cp) for t in (inputs, targets))
        last = local_index == local_micro_batches - 1
        sync = model.no_sync() if (config.dp > 1 or config.cp > 1) and not last else nullcontext()
        with sync:
            loss = loss_fn(model(inputs), targets) / local_micro_batches
            loss.backward()


def _pipeline_step_fn(config: TorchGPTRunConfig, stage_module: nn.Module, mesh):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage_index = mesh.get_local_rank()
    # Static shapes: without them the stage infers shapes with an extra real forward and backward,
    # which is not a micro-batch of the step.
    model, dtype = config.model, PRECISIONS[config.precision]
    tokens = torch.empty(config.micro_batch_size, model.seq_len, dtype=torch.int64, device="meta")
    hidden = torch.empty(config.micro_batch_size, model.seq_len, model.d_model, dtype=dtype, device="meta",
                         requires_grad=True)
    logits = torch.empty(config.micro_batch_size, model.seq_len, model.vocab_size, dtype=dtype, device="meta")
    stage = PipelineStage(stage_module, stage_index, config.pp, torch.device("cpu"), group=mesh.get_group(),
                          input_args=tokens if stage_index == 0 else hidden,
                          output_args=logits if stage_index == config.pp - 1 else hidden)
    # The schedule splits the global batch into micro-batches along dim 0 and divides the
    # parameter gradients by their number, as gradient accumulation over loss / M does.
    schedule = ScheduleGPipe(stage, n_microbatches=config.num_micro_batches, loss_fn=loss_fn)
    batches = [micro_batch(config, index) for index in range(config.num_micro_batches)]
    inputs = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])

    def step() -> None:
        if stage_index == 0:
            schedule.step(inputs)
        elif stage_index == config.pp - 1:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()
    return step
