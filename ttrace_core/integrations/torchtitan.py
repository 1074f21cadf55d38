"""torchtitan adapter for `attach`: what a torchtitan Trainer says about its run, as layout metadata.

Produces layout metadata (stage 1, record) from torchtitan's own objects, for the launcher that traces
torchtitan's Trainer (`python -m ttrace_examples.torchtitan ARGS`, ttrace_examples/torchtitan/launcher.py):

- the data-parallel rank and size: torchtitan's "batch" mesh (dp_replicate x dp_shard; the tensor and
  context parallel ranks of one replica read the same batch);
- the loss scale: torchtitan divides each micro-batch's summed token loss by the step's global count
  of valid tokens, which for full sequences (the packed text datasets) is 1 / (dp x gradient
  accumulation steps x pipeline micro-batches) of a mean loss;
- what attach cannot infer from DTensors: torchtitan's grouped MoE experts compute on plain tensors
  of tokens permuted by expert (and under expert parallelism gathered from the ranks of the EP group):
  they are recorded by token and per expert (record/token_rows.py, `ExpertTokens`), and under tensor
  parallelism each expert's output is a partial sum over the tp mesh; under context parallelism each
  rank's loss is its sequence chunk's share, summed over the cp mesh.

It also makes torchtitan runnable on a machine with no accelerator (torchtitan 0.3.0 picks "cuda"
whenever none is found): `use_cpu_without_accelerator()` before torchtitan is imported (gloo, a CPU
device module with no-op memory statistics, no process-group timeout change where torch has no
`torch.distributed.set_timeout`), and `sum_reductions_for_gloo(trainer)` (FSDP2's gradient
reduction as a plain sum: gloo has no PREMUL_SUM). torchtitan is imported only inside functions.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from ttrace_core.format.tracer_config import TracerConfig
from ttrace_core.integrations.patching import patch_attribute

_CPU_DEVICE_MODULE = "torchtitan.tools.utils"
EXPERT_INTERNALS = "*.moe.routed_experts.inner_experts"
"""torchtitan's grouped experts (models/common/moe.py): plain-tensor activations, computed in bf16."""
EACH_EXPERT = EXPERT_INTERNALS + ".*"
"""Where each expert of the grouped experts is recorded (token_rows.expert_fqn)."""


# ---- torchtitan on a machine without an accelerator ----------------------------------------------

def _cpu_device_module() -> types.SimpleNamespace:
    """What torchtitan asks of its `device_module` (torch.cuda's API), answered for the CPU: one device,
    no memory statistics (torchtitan logs -0.00GiB), no-op synchronization."""
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    properties = types.SimpleNamespace(name="cpu", total_memory=total_memory)
    return types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        set_device=lambda device: None, synchronize=lambda device=None: None, empty_cache=lambda: None,
        get_device_name=lambda device=None: "cpu", get_device_properties=lambda device=None: properties,
        memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    )


def use_cpu_without_accelerator() -> bool:
    """Make torchtitan run on the CPU when this machine has no accelerator; True when it did.

    torchtitan reads its device once, at the import of torchtitan.tools.utils (`_get_available_device_type()
    or "cuda"`), and other modules copy it: so this must run before torchtitan is imported."""
    import torch._utils as torch_utils

    if torch_utils._get_available_device_type() is not None:
        return False
    if _CPU_DEVICE_MODULE in sys.modules and getattr(sys.modules[_CPU_DEVICE_MODULE], "device_type", None) == "cpu":
        return True  # done already (a wrapper script called it before main())
    if _CPU_DEVICE_MODULE in sys.modules:
        raise RuntimeError("torchtitan was imported before the launcher could point it at the CPU; "
                           "run it as `python -m ttrace_examples.torchtitan ...`")
    find_type, find_module = torch_utils._get_available_device_type, torch_utils._get_device_module
    cpu_module = _cpu_device_module()
    torch_utils._get_available_device_type = lambda: "cpu"
    torch_utils._get_device_module = lambda device_type: cpu_module if device_type == "cpu" else find_module(device_type)
    try:
        import torchtitan.tools.utils  # noqa: F401 - reads the device now
    finally:
        torch_utils._get_available_device_type, torch_utils._get_device_module = find_type, find_module
    if not hasattr(torch.distributed, "set_timeout"):
        # torchtitan lowers every process group's timeout after the first step through an API this
        # torch lacks: the timeouts stay as set at init (--comm.init_timeout_seconds).
        import torchtitan.distributed.utils as distributed_utils

        patch_attribute(distributed_utils, "set_pg_timeouts", lambda *args, **kwargs: None)
    return True


def sum_reductions_for_gloo(trainer: Any) -> None:
    """FSDP2 under torchtitan reduce-scatters gradients with ReduceOp.PREMUL_SUM (torchtitan sets a gradient
    divide factor of 1: its loss is already divided by the global token count), which gloo does not
    implement. FSDP's own switch makes it a plain SUM followed by the same division (by 1): same values."""
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


# ---- what attach cannot infer ---------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class Declaration:
    """A layout attach cannot infer: `session.declare(fqn_glob, slot_glob, placements, mesh)`."""

    fqn_glob: str
    slot_glob: str
    placements: list[str]
    mesh: Any
    """The torchtitan DeviceMesh the placements are over."""


@dataclass(kw_only=True, slots=True)
class TrainerTracing:
    """What `attach` needs to know of one torchtitan Trainer beyond what its DTensors say."""

    loss_scale: float
    data_parallel: tuple[int, int]
    config: TracerConfig | None = None
    """A full tracer configuration when the default one would be wrong (expert parallelism); None otherwise."""
    declarations: list[Declaration] = field(default_factory=list)
    untraced: str = ""
    """Why this run cannot be traced at all (several model parts); empty when it can."""


def data_parallel_of(trainer: Any) -> tuple[int, int]:
    """(rank, size) among the replicas that read different data: torchtitan's "batch" mesh."""
    parallel_dims = trainer.parallel_dims
    if not parallel_dims.dp_enabled:
        return 0, 1
    mesh = parallel_dims.get_mesh("batch")
    return mesh.get_local_rank(), mesh.size()


def loss_scale_of(trainer: Any) -> float:
    """What each micro-batch's mean token loss is multiplied by before backward (see the module docstring)."""
    _, dp_size = data_parallel_of(trainer)
    pipeline = trainer.num_pipeline_parallel_microbatches if trainer.parallel_dims.pp_enabled else 1
    return 1.0 / (dp_size * trainer.gradient_accumulation_steps * pipeline)


def trainer_tracing(trainer: Any) -> TrainerTracing:
    """The layout metadata of a built torchtitan Trainer."""
    parallel_dims = trainer.parallel_dims
    tracing = TrainerTracing(loss_scale=loss_scale_of(trainer), data_parallel=data_parallel_of(trainer))
    if len(trainer.model_parts) != 1:
        tracing.untraced = (f"{len(trainer.model_parts)} model parts on this rank (a looped pipeline schedule): "
                            "attach traces one model")
    if parallel_dims.tp_enabled and not parallel_dims.ep_enabled:
        # Tensor-parallel grouped experts hold a slice of every expert's hidden width: each expert's output,
        # and the gradient of its input, is this rank's partial sum. Rank 1 of 2 holds hidden units F/2:F.
        tracing.declarations += [Declaration(fqn_glob=glob, slot_glob=slot, placements=["P(sum)"],
                                             mesh=parallel_dims.get_mesh("tp"))
                                 for glob in (EXPERT_INTERNALS, EACH_EXPERT) for slot in ("output.0", "grad_input.0")]
    if parallel_dims.cp_enabled:
        # Each context-parallel rank's loss covers its own sequence chunk: the micro-batch's loss is their sum.
        tracing.declarations.append(Declaration(fqn_glob="(loss)", slot_glob="scalar.loss", placements=["P(sum)"],
                                                mesh=parallel_dims.get_mesh("cp")))
    return tracing


# ---- grouped experts, traced by token ------------------------------------------------------------

def has_grouped_experts(model) -> bool:
    """Whether the model holds torchtitan's routed experts (RoutedExperts: a token dispatcher and grouped experts)."""
    return any(type(m).__name__ == "RoutedExperts" and hasattr(m, "token_dispatcher") for m in model.modules())


class ExpertTokens:
    """Tells the tracer which token and which expert each row of every grouped-experts call holds.

    torchtitan's token dispatchers (models/common/token_dispatcher.py) are stateless: `dispatch` returns
    what `combine` needs. So each dispatch is run a second time on one column of token ids (plus one, so
    that a padding row, zero, reads as -1), with the same routing: the ids land exactly where the hidden
    states did, through the local reorder, the expert-parallel all-to-all and the expert-major permute.
    The dispatch's collectives run again on every rank of the EP group, in the same order."""

    def __init__(self, tracer, model) -> None:
        self._tracer = tracer
        self._undo: list = []
        roots = []
        for local_fqn, module in model.named_modules():
            if type(module).__name__ != "RoutedExperts" or not hasattr(module, "token_dispatcher"):
                continue
            experts_fqn = tracer.global_fqn(f"{local_fqn}.inner_experts")
            roots.append(experts_fqn)
            self._watch(module.token_dispatcher, tracer.global_fqn(local_fqn), experts_fqn)
        tracer.route_tokens(roots)

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _watch(self, dispatcher, routed_fqn: str, experts_fqn: str) -> None:
        dispatch = dispatcher.dispatch

        def watched(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
            result = dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            if self._tracer.recording():
                self._tracer.guarded(lambda: self._expect_rows(
                    dispatch, routed_fqn, experts_fqn, (x_TD.shape[0], topk_scores_TK, topk_expert_ids_TK,
                                                        num_local_tokens_per_expert_E), result[1]))
            return result

        dispatcher.dispatch = watched
        self._undo.append(lambda: delattr(dispatcher, "dispatch"))

    def _expect_rows(self, dispatch, routed_fqn: str, experts_fqn: str, given: tuple, counts: torch.Tensor) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        from ttrace_core.canonicalize.token_rows import TokenRows, token_ids
        from ttrace_core.integrations.torch_native import micro_batches_of_group

        tracer = self._tracer
        entry = tracer.current_forward_call(routed_fqn)
        if entry is None:
            return
        micro_batch, call = entry
        num_tokens, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E = given
        layout = tracer.state.forward_layouts.get((routed_fqn, micro_batch, call, "input.0"))
        shape = layout_local_tokens(layout, num_tokens)
        ids, tokens_per_micro_batch = token_ids(micro_batch, shape, layout)
        ep_mesh = getattr(dispatch.__self__, "ep_mesh", None)
        micro_batches = micro_batches_of_group(micro_batch, None if ep_mesh is None else ep_mesh.get_group())
        # Outside every dispatch mode: selective activation checkpointing caches the collectives a region
        # runs and hands them back, in order, when it recomputes the region (without this second dispatch).
        with torch.no_grad(), _disable_current_modes():
            routed, shadow_counts, _ = dispatch((ids.reshape(-1, 1) + 1).to(torch.float64), topk_scores_TK.detach(),
                                                topk_expert_ids_TK, num_local_tokens_per_expert_E)
        permuted = routed.reshape(-1).round().to(torch.int64) - 1
        counts = torch.as_tensor(counts).to(torch.int64)
        if not torch.equal(counts, torch.as_tensor(shadow_counts).to(torch.int64)) or int(counts.sum()) != permuted.numel():
            raise ValueError(f"{experts_fqn}: token ids dispatched like the hidden states came out in another "
                             "arrangement; this call's expert activations are recorded as they are")
        first = 0 if ep_mesh is None else ep_mesh.get_local_rank() * counts.numel()
        held = tuple(range(first, first + counts.numel()))
        experts = torch.repeat_interleave(torch.tensor(held, dtype=torch.int64), counts)
        tracer.routed.expect(experts_fqn, micro_batch, call, TokenRows(
            ids=permuted, tokens_per_micro_batch=tokens_per_micro_batch, micro_batches=micro_batches,
            experts=experts, experts_held=held))


def layout_local_tokens(layout, num_tokens: int) -> tuple[int, int]:
    """This rank's [batch, sequence] extent of the MoE input, from its recorded layout; (tokens, 1) when the
    rank holds it whole (no layout is recorded then, and the flattened order is the token order)."""
    from ttrace_core.canonicalize.placements import local_shape

    if layout is None:  # whole on this rank: its flattened tokens in order
        return num_tokens, 1
    batch, sequence = local_shape(layout)[:2]
    if batch * sequence != num_tokens:
        raise ValueError(f"the routed experts' input layout gives {batch} x {sequence} tokens, the dispatch {num_tokens}")
    return batch, sequence
