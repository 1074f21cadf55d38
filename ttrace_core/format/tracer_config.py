"""What the Tracer records: which modules, which kinds of tensor, which steps, and how names and
micro-batches map to the reference's (`TracerConfig`; `ttrace_core.record.tracer` re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

from ttrace_core.format.schema import SLOT_FAMILIES


@dataclass(kw_only=True, slots=True)
class TracerConfig:
    include: tuple[str, ...] = ("*",)
    """fnmatch globs over module fqns (and over the owning module of each parameter)."""
    exclude: tuple[str, ...] = ()
    """Globs removed after `include`; the root module's fqn is ""."""
    exclude_activations: tuple[str, ...] = ()
    """Globs of modules whose activations are not recorded while their parameters still are (e.g.
    MoE experts under expert parallelism, whose inputs mix tokens of several data-parallel ranks)."""
    compiled_boundaries: tuple[str, ...] = ()
    """Globs of compiled modules whose own hooks run outside the compiled code (what torch.compile returned, put in
    the module's place or at the root). Their compiled code hands their outputs gradients unlike eager autograd
    (none to logits a compiled root computes its loss from inside, as a Hugging Face model given labels does), so
    compare does not count an output gradient of theirs that only one run recorded (evidence.py)."""
    forward_only: tuple[str, ...] = ()
    """Globs of modules recorded in forward only: a full backward hook wraps a module's inputs, so
    a module that modifies an input in place (megatron's masked softmax) cannot have one."""
    slots: tuple[str, ...] = SLOT_FAMILIES
    """Which kinds of tensor to record (SLOT_FAMILIES): input, output, grad_output, grad_input, grad, value,
    scalar (the step's scalars: the loss, the learning rate, the gradient norm) and tokens (a routed module's
    token positions)."""
    steps: tuple[int, ...] | None = None
    """Steps to record; None records every step."""
    stats_only: bool = False
    """Store summary statistics instead of values (far smaller; compare can then check norms only)."""
    writer_queue_bytes: int = 0
    """0: write each tensor on the training thread. Otherwise copy it and let a writer thread store it,
    with at most this many bytes of copies waiting: a full queue blocks the training thread instead of
    growing memory (background_writer.py). Pays off only where a core is idle during training."""
    loss_scale: float = 1.0
    """Factor applied to each micro-batch loss before backward (1/num_micro_batches under gradient
    accumulation); activation gradients are stored with it so that runs that scale differently compare."""
    grad_attr: str = "grad"
    """Attribute holding the reduced gradient: "grad", or "main_grad" for Megatron."""
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    """Micro-batch m of this rank is global micro-batch m * data_parallel_size + data_parallel_rank."""
    rename: tuple[tuple[str, str], ...] = ()
    """(local prefix, global prefix) pairs mapping this rank's module names to the reference's, e.g.
    (("layers.0", "layers.2"),) on a pipeline stage whose local layer 0 is global layer 2. A prefix
    matches whole name components: "layers.1" renames "layers.1.attn", never "layers.10"."""
    model_chunks: int = 0
    """The traced model is an nn.ModuleList of this many chunks, each called on its own once per
    micro-batch (megatron's virtual pipeline stages under the interleaved schedule); 0: one model.
    Chunk i's names start with "i." ("1.decoder.layers.0"): `rename` maps those full names, while
    include/exclude globs match the name within its chunk ("decoder.layers.0"; the chunk's root is "")."""

    def __post_init__(self) -> None:
        unknown = set(self.slots) - set(SLOT_FAMILIES)
        if unknown:
            raise ValueError(f"TracerConfig.slots has unknown kinds {sorted(unknown)}; choose from {SLOT_FAMILIES}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is outside data_parallel_size {self.data_parallel_size}")
        if self.writer_queue_bytes < 0:
            raise ValueError(f"TracerConfig.writer_queue_bytes is {self.writer_queue_bytes}; give 0 (no writer thread) or a byte count")
        if self.model_chunks < 0:
            raise ValueError(f"TracerConfig.model_chunks is {self.model_chunks}; give 0 (one model) or the chunk count")
        if self.loss_scale == 0:
            raise ValueError("loss_scale 0 would zero every gradient; pass the factor the loss is multiplied by")
