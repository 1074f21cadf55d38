"""The data model shared by every stage: tensor keys, layouts, per-shard metadata and the run manifest.

Pure dataclasses; no torch, no h5py. A `TensorKey` names one logical tensor of one iteration; a
`Layout` says which part of that logical tensor one rank holds; a `TensorMeta` is what the store
keeps next to each recorded shard.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FORMAT_VERSION = 1

# Phases in execution order. `grad` holds parameter gradients after every data-/tensor-parallel
# reduction and before optimizer.step(); `param` holds parameters after optimizer.step().
PHASES = ("forward", "backward", "grad", "param")
PHASE_ORDER = {phase: index for index, phase in enumerate(PHASES)}

# Parameter gradients and post-step parameters belong to no micro-batch.
NO_MICRO_BATCH = -1

# Slot families a TracerConfig can select. A slot is `<family>.<index>` ("output.0") or
# `<family>.<kwarg>` for keyword inputs; parameter gradients and values use the slot `grad`/`value`.
SLOT_FAMILIES = ("input", "output", "grad_output", "grad_input", "grad", "value")


def global_fqn(fqn: str, rename: tuple[tuple[str, str], ...]) -> str:
    """Apply the first (local prefix, global prefix) pair that matches whole name components:
    ("layers.1", "layers.3") renames "layers.1.attn", never "layers.10.attn"."""
    for local, global_ in rename:
        if fqn == local or fqn.startswith(local + "."):
            return global_ + fqn[len(local):]
    return fqn


# Name components that wrappers insert between a module and its children: activation checkpointing
# (CheckpointWrapper), torch.compile (OptimizedModule) and FSDP1. The reference has none of them.
WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def strip_wrappers(fqn: str) -> str:
    """"layers.0._checkpoint_wrapped_module.attn" -> "layers.0.attn": the model's own name."""
    if not any(part in fqn for part in WRAPPER_COMPONENTS):
        return fqn
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_COMPONENTS)


@dataclass(frozen=True, slots=True, order=True)
class TensorKey:
    """Canonical name of one logical tensor in one iteration."""

    step: int
    micro_batch: int
    """Global micro-batch id (local index * dp_size + dp_rank); NO_MICRO_BATCH for grad/param."""
    phase: str
    fqn: str
    """Module fqn for activations, parameter fqn for grad/param phases."""
    slot: str
    call: int = 0
    """Which call of the module within its micro-batch (a chunked loss or a tied layer runs a module
    several times per micro-batch); 0 for the first call and for grad/param tensors."""

    def __str__(self) -> str:
        mb = "" if self.micro_batch == NO_MICRO_BATCH else f" / mb {self.micro_batch}"
        call = f" / call {self.call}" if self.call else ""
        return f"step {self.step}{mb} / {self.phase} / {self.fqn or '<root>'}{call} / {self.slot}"

    def execution_order(self) -> tuple[int, int, int]:
        return (self.step, PHASE_ORDER[self.phase], self.micro_batch)

    def with_call(self, call: int) -> TensorKey:
        return TensorKey(step=self.step, micro_batch=self.micro_batch, phase=self.phase, fqn=self.fqn, slot=self.slot, call=call)


@dataclass(frozen=True, slots=True)
class Layout:
    """Which part of a logical tensor one rank holds.

    `placements` has one entry per mesh axis, written as strings (see placements.py for their
    meaning): "S(d)" shard along tensor dim d, "R" replicate, "P(sum)"/"P(avg)" partial values
    still to be reduced. An empty mesh (mesh_shape == ()) means every rank holding the key holds
    the whole tensor: ranks that hold it are replicas of each other.
    """

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...] = ()
    coordinate: tuple[int, ...] = ()
    placements: tuple[str, ...] = ()
    mesh_axis_names: tuple[str, ...] = ()
    flat_range: tuple[int, int] | None = None
    """Set when this rank holds only elements [start, end) of the row-major flattening of the block
    its placements give it, as Megatron's distributed optimizer does with reduced gradients."""

    def __post_init__(self) -> None:
        if not (len(self.mesh_shape) == len(self.coordinate) == len(self.placements)):
            raise ValueError(
                f"layout has mesh_shape {self.mesh_shape}, coordinate {self.coordinate} and placements "
                f"{self.placements}: all three need one entry per mesh axis"
            )

    @staticmethod
    def replicated(shape: tuple[int, ...]) -> Layout:
        return Layout(global_shape=tuple(shape))


@dataclass(frozen=True, slots=True)
class TensorStats:
    """Summary kept instead of the values in stats-only mode (and alongside them otherwise)."""

    numel: int
    sum: float
    sumsq: float
    min: float
    max: float
    num_nan: int
    num_inf: int


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Everything recorded about one shard, except its values."""

    key: TensorKey
    rank: int
    dtype: str
    """torch dtype name without the `torch.` prefix; bf16 and fp8 are stored as raw bits."""
    local_shape: tuple[int, ...]
    layout: Layout
    seq: int
    """Recording order within the step on this rank: the execution order of the run."""
    scale: float = 1.0
    """The recorded values equal the logical values times `scale` (loss scaling of gradients)."""
    stats: TensorStats | None = None
    stats_only: bool = False
    fp8_scale_inv: float | None = None


@dataclass(kw_only=True, slots=True)
class RunManifest:
    """manifest.json of a run directory: who produced the trace and in which layout."""

    format_version: int = FORMAT_VERSION
    role: str
    """"reference" or "candidate"."""
    world_size: int
    degrees: dict[str, int] = field(default_factory=dict)
    """Parallel degrees, e.g. {"tp": 2, "sp": 1, "pp": 1, "dp": 1, "fsdp": 1}."""
    mesh_shape: list[int] = field(default_factory=list)
    mesh_axis_names: list[str] = field(default_factory=list)
    rank_coordinates: list[list[int]] = field(default_factory=list)
    """rank_coordinates[r] is rank r's coordinate in the mesh."""
    precision: str = "fp32"
    seed: int = 0
    model: dict = field(default_factory=dict)
    """Model configuration; two runs are comparable only when these are equal."""
    entrypoint: dict = field(default_factory=dict)
    """{"factory": "module:function", "config": {...}}: what relaunches this run."""
    tracer: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    """Where it was recorded (fingerprint.py): command, Python and package versions, variables, world size."""
    blind_spots: dict[str, str] = field(default_factory=dict)
    """Modules whose boundaries the trace cannot see, and why (inside a torch.compile region, ...)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> RunManifest:
        known = {name for name in RunManifest.__dataclass_fields__}
        return RunManifest(**{name: value for name, value in data.items() if name in known})
