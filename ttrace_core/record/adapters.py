"""Part of stage 1 (record): what `attach` needs to know of the framework a model comes from.

An adapter answers, for one model: which module to trace, the tracer configuration and the run's
manifest it implies, each parameter's layout (to draw weights in full logical shape), which of the
step's scalars to capture (step_scalars.py), and what to declare once the tracer exists. Three
frameworks: PyTorch-native (DTensor / FSDP2 / DDP / torch.compile; layouts travel with the tensors),
Hugging Face Transformers' own tensor parallelism (DTensor parameters; the plain shards its parallel
styles hand between modules laid out by the model's plan, integrations/transformers.py), and
megatron-core (plain local tensors; layouts from megatron's attributes and parallel state,
integrations/megatron.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import nn

from ttrace_core.format.naming import global_fqn
from ttrace_core.format.schema import Layout, RunManifest, strip_wrappers
from ttrace_core.format.tracer_config import TracerConfig
from ttrace_core.integrations import fsdp1, megatron
from ttrace_core.integrations.megatron_moe import untraceable_expert_activations
from ttrace_core.integrations.torch_native import (
    compiled, compiled_in_place, compiled_modules, compiled_root_ddp, data_parallel_of, manifest_from_model,
)
from ttrace_core.record.generator import agreed_constants
from ttrace_core.record.step_scalars import (
    TORCH_CAPTURES, capture_megatron_aux_losses, capture_megatron_losses, capture_torch_clipping,
)



@dataclass(frozen=True, slots=True)
class TracerSelection:
    """What the user's attach() call says about tracing, whatever the framework."""

    include: tuple[str, ...]
    exclude: tuple[str, ...]
    loss_scale: float
    data_parallel: tuple[int, int] | None


class TorchAdapter:
    """A PyTorch-native model: layouts are DTensors' own, the loss is what backward starts from."""

    def __init__(self, model: nn.Module, role: str, world_size: int, selection: TracerSelection) -> None:
        self.model, self.role, self.world_size, self.selection = model, role, world_size, selection
        self.traced = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        # torch.compile(DDP(model)): DDP's `module.` sits below the compiled root, in every local name
        self.rename = (("module", ""),) if compiled_root_ddp(model) is not None else ()
        self.compiled = compiled_modules(self.traced, self._global_name)
        self.captures = TORCH_CAPTURES
        self.held = fsdp1.held_layouts(self.traced)
        """Local parameter name -> the flat range of it this rank holds (FSDP1's: integrations/fsdp1.py)."""

    def _global_name(self, local_fqn: str) -> str:
        return global_fqn(strip_wrappers(local_fqn), self.rename)

    @cached_property
    def config(self) -> TracerConfig:
        dp_rank, dp_size = data_parallel_of(self.model, self.selection.data_parallel)
        return TracerConfig(include=self.selection.include, exclude=self.selection.exclude,
                            loss_scale=self.selection.loss_scale, data_parallel_rank=dp_rank, data_parallel_size=dp_size,
                            exclude_activations=self._compiled_globs(), rename=self.rename,
                            compiled_boundaries=tuple(self._global_name(local) for local, module in
                                                      self.traced.named_modules() if compiled(module)))

    def _compiled_globs(self) -> tuple[str, ...]:
        """The activations torch.compile hides: all but the root's when the root is compiled, else the compiled
        modules' own (their names, each a glob of itself)."""
        if not self.compiled:
            return ()
        if compiled_in_place(self.traced):
            return ("*",)
        return ("?*",) if compiled(self.traced) else tuple(self.compiled)

    def manifest(self) -> RunManifest:
        return manifest_from_model(self.traced, self.role, self.world_size, self._global_name, self.held)

    def parameter_layout(self, name: str, param: torch.Tensor) -> Layout | None:
        return self.held.get(name)  # a DTensor carries its own; a plain tensor is whole unless FSDP1 cut it

    def constants(self) -> dict[str, float | None]:
        """Local name -> whether the parameter is a constant, agreed among the ranks, for the parameters a rank
        cannot tell from its own part (FSDP1's flat ranges; a collective then): initialize_weights keeps constants."""
        return agreed_constants(self.traced, self.held) if self.held else {}

    def after_weights(self, optimizer) -> None:
        """Nothing to refresh: a torch optimizer holds the parameters themselves."""

    def declare(self, tracer, optimizer) -> None:
        """Nothing to declare (DTensors say their layouts), but torchtitan's grouped MoE experts, whose
        activations are recorded by token (integrations/torchtitan.py `ExpertTokens`)."""
        from ttrace_core.integrations.torchtitan import ExpertTokens, has_grouped_experts

        if has_grouped_experts(self.traced):
            tracer.on_close(ExpertTokens(tracer, self.traced).close)
        for local, layout in self.held.items():
            tracer.declare_held(self._global_name(local), layout)


class TransformersAdapter(TorchAdapter):
    """A transformers model that transformers itself parallelized (`DistributedConfig(tp_size=...)`,
    `tp_plan="auto"`): its parameters are DTensors (or plain shards, laid out by their style), and the
    plain local tensors its parallel styles return are declared from the model's TP / EP plan."""

    def __init__(self, model: nn.Module, role: str, world_size: int, selection: TracerSelection) -> None:
        from ttrace_core.integrations.transformers import applied_plan

        super().__init__(model, role, world_size, selection)
        self.plan = applied_plan(self.traced)

    @cached_property
    def config(self) -> TracerConfig:
        config = super().config
        internals = self.plan.expert_parallel_internals
        return replace(config, exclude_activations=config.exclude_activations + internals) if internals else config

    def parameter_layout(self, name: str, param: torch.Tensor) -> Layout | None:
        from ttrace_core.integrations.transformers import parameter_layout

        return parameter_layout(self.plan, name, param)

    def declare(self, tracer, optimizer) -> None:
        from ttrace_core.integrations.transformers import declare_transformers_layouts

        declare_transformers_layouts(tracer, self.plan, self.traced.named_parameters())


class MegatronAdapter:
    """A megatron-core model (inside Megatron's DDP / Float16Module), or its list of chunks (virtual
    pipeline stages, each in its own DDP, as the interleaved schedule takes them): layouts, degrees and
    the loss scale come from megatron itself; the Megatron optimizer's step is wrapped (it has no step
    hooks). Chunks are traced as one nn.ModuleList (megatron.traced_model), each its own micro-batch clock."""

    captures = (capture_megatron_losses, capture_megatron_aux_losses, capture_torch_clipping)
    compiled: list[str] = []

    def __init__(self, model: nn.Module | list[nn.Module], optimizer, role: str, world_size: int,
                 selection: TracerSelection) -> None:
        self.model, self.optimizer, self.role, self.world_size, self.selection = model, optimizer, role, world_size, selection
        self.traced = megatron.traced_model(model)
        self.num_chunks = len(model) if isinstance(model, (list, tuple)) else 0

    @cached_property
    def config(self) -> TracerConfig:
        dp_rank, dp_size = self.selection.data_parallel or megatron.megatron_data_parallel()
        return megatron.megatron_tracer_config(
            include=self.selection.include, loss_scale=self.selection.loss_scale, rename=megatron.megatron_rename(self.traced),
            data_parallel_rank=dp_rank, data_parallel_size=dp_size, extra_exclude=self.selection.exclude,
            exclude_activations=untraceable_expert_activations(self.traced) + megatron.scattering_embeddings(self.traced),
            model_chunks=self.num_chunks)

    def manifest(self) -> RunManifest:
        return megatron.megatron_manifest(self.traced, self.optimizer, self.role, self.world_size)

    @cached_property
    def _layouts(self) -> dict[str, Layout]:
        return megatron.parameter_layouts(self.traced)

    def parameter_layout(self, name: str, param: torch.Tensor) -> Layout | None:
        return self._layouts.get(name)

    def constants(self) -> dict[str, float | None]:
        """None to agree on: every rank holds whole rows or columns of a parameter, and tells a constant by itself."""
        return {}

    def after_weights(self, optimizer) -> None:
        """A mixed-precision Megatron optimizer keeps fp32 copies of the parameters it was built from:
        refresh them from the weights just drawn, or its first step would bring the old ones back."""
        if hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()

    def declare(self, tracer, optimizer) -> None:
        megatron.declare_megatron_run(tracer, self.traced, optimizer)
