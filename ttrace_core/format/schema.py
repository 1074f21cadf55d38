"""The data model shared by every stage: tensor keys, layouts, per-shard metadata and the run manifest.

Pure records; no torch, no h5py. A `TensorKey` names one logical tensor of one iteration; a
`Layout` says which part of that logical tensor one rank holds; a `TensorMeta` is what the store
keeps next to each recorded shard.

These records are the single source of the trace format: their field types carry the ranges a
value may take (`Annotated[..., Meta(...)]`), and `records.py` parses every file into them with
msgspec, so a field out of range is refused where it is read, named by file and field. The records a
step file holds one of per tensor (`TensorKey`, `Layout`, `TensorStats`, `TensorMeta`, `Finding`) are
msgspec Structs that forbid unknown fields: a key renamed by damage ("mesh_axis_na}es") is refused, not
dropped with its value left at the default. They are not tracked by the cyclic collector (`gc=False`:
they hold numbers, strings, tuples and each other, never a cycle), so a run's index of tens of thousands
of them costs no collection after it is read.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

FORMAT_VERSION = 5
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5)
"""2: stats-only tensors keep their records in one STATS_ONLY_METAS dataset per step file (full traces
are written as in version 1). 3: the phase "step" and the slot family "scalar" (the step's scalars:
loss, token count, gradient norm, clip coefficient, loss scale, learning rate, skipped steps), and
findings (tensors the tracer could not map or record) in each step file. 4: every tensor's metadata
(stats-only ones included) in one index per step file (tensor_index.py) instead of an attribute per
dataset, and a tensor recorded twice in a step (same storage, same version) as a hard link to its first
dataset. 5: a step's values packed into a few contiguous byte datasets (packs.py), each index row giving
its tensor's pack and offset; a tensor recorded twice is a second row naming the same bytes."""
INDEXED_FORMAT = 4
"""The first format whose step files hold a tensor index (tensor_index.TENSOR_INDEX)."""
PACKED_FORMAT = 5
"""The first format whose step files keep their values in packs (packs.py), not a dataset per tensor."""

# Phases in execution order. `grad` holds parameter gradients after every data-/tensor-parallel
# reduction and before optimizer.step(); `step` the scalars the optimizer step computes from them
# (gradient norm, clip coefficient, loss scale, learning rate, skipped steps); `param` holds
# parameters after optimizer.step().
PHASES = ("forward", "backward", "grad", "step", "param")
PHASE_ORDER = {phase: index for index, phase in enumerate(PHASES)}

# Parameter gradients and post-step parameters belong to no micro-batch.
NO_MICRO_BATCH = -1

PRE_STEP_SLOT = "value.initial"
"""The slot of a parameter's value before the step, recorded (phase "param") at the first step of a
recorded range, whose previous step left no post-step value: with it a post-step value is judged as
an update, and the two runs' starting weights are checked. It comes first in execution order."""

# Slot families a TracerConfig can select. A slot is `<family>.<index>` ("output.0") or
# `<family>.<kwarg>` for keyword inputs; parameter gradients and values use the slot `grad`/`value`;
# the step's scalars use `scalar.<name>` ("scalar.loss", "scalar.grad_norm").
SLOT_FAMILIES = ("input", "output", "grad_output", "grad_input", "grad", "value", "scalar", "tokens")
TOKENS_SLOT = "tokens"
"""The forward slot of a routed module's (a MoE expert's) token positions: for each recorded piece of an
expert (record/token_rows.py), which tokens of its micro-batch its rows are, in order. Metadata, not a
tensor to compare: the reader keeps it apart (`RunReader.tokens`), and compare aligns an expert's rows
by it when the two runs routed different tokens to that expert."""

# Ranges of the format's numbers. A dimension or count beyond MAX_SIZE (2**48) cannot come from a
# real recording; a float must be finite (NaN fails every comparison, inf fails `le`).
MAX_SIZE = 2**48
MAX_WORLD_SIZE = 2**20
_FLOAT_MAX = sys.float_info.max
Count = Annotated[int, Meta(ge=0, le=MAX_SIZE)]
Size = Annotated[int, Meta(ge=1, le=MAX_SIZE)]
Finite = Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
FiniteNonNegative = Annotated[float, Meta(ge=0.0, le=_FLOAT_MAX)]
FinitePositive = Annotated[float, Meta(gt=0.0, le=_FLOAT_MAX)]
Phase = Literal["forward", "backward", "grad", "step", "param"]
Name = Annotated[str, Meta(max_length=4096)]
# Every dtype the store can hold (store.py keeps bf16 and fp8 as raw bits).
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
               "float8_e5m2fnuz", "int64", "int32", "int16", "int8", "uint8", "bool")
DtypeName = Literal[DTYPE_NAMES]  # type: ignore[valid-type]


# Name components that wrappers insert between a module and its children: activation checkpointing
# (CheckpointWrapper), torch.compile (OptimizedModule) and FSDP1. The reference has none of them.
WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def strip_wrappers(fqn: str) -> str:
    """"layers.0._checkpoint_wrapped_module.attn" -> "layers.0.attn": the model's own name."""
    if not any(part in fqn for part in WRAPPER_COMPONENTS):
        return fqn
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_COMPONENTS)


ROOT_NAME = "<root>"
"""How the model's root module (fqn "") is written where a name must show: in messages, the dashboard and a
step file's dataset paths. Its home is format/naming.py (`display_fqn`); it is defined here, below naming,
because a key's own text shows it."""


class TensorKey(Struct, frozen=True, order=True, forbid_unknown_fields=True, gc=False):
    """Canonical name of one logical tensor in one iteration."""

    step: Count
    micro_batch: Annotated[int, Meta(ge=NO_MICRO_BATCH, le=MAX_SIZE)]
    """Global micro-batch id (local index * dp_size + dp_rank); NO_MICRO_BATCH for grad/param."""
    phase: Phase
    fqn: Name
    """Module fqn for activations, parameter fqn for grad/param phases."""
    slot: Name
    call: Count = 0
    """Which call of the module within its micro-batch (a chunked loss or a tied layer runs a module
    several times per micro-batch); 0 for the first call and for grad/param tensors."""

    def __str__(self) -> str:
        mb = "" if self.micro_batch == NO_MICRO_BATCH else f" / mb {self.micro_batch}"
        call = f" / call {self.call}" if self.call else ""
        return f"step {self.step}{mb} / {self.phase} / {self.fqn or ROOT_NAME}{call} / {self.slot}"

    def execution_order(self) -> tuple[int, int, int]:
        if self.phase == "param" and self.slot == PRE_STEP_SLOT:
            return (self.step, -1, self.micro_batch)
        return (self.step, PHASE_ORDER[self.phase], self.micro_batch)

    def with_call(self, call: int) -> TensorKey:
        return TensorKey(step=self.step, micro_batch=self.micro_batch, phase=self.phase, fqn=self.fqn, slot=self.slot, call=call)


class Layout(Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Which part of a logical tensor one rank holds.

    `placements` has one entry per mesh axis, written as strings (see placements.py for their
    meaning): "S(d)" shard along tensor dim d, "R" replicate, "P(sum)"/"P(avg)" partial values
    still to be reduced. An empty mesh (mesh_shape == ()) means every rank holding the key holds
    the whole tensor: ranks that hold it are replicas of each other.
    """

    global_shape: tuple[Count, ...]
    mesh_shape: tuple[Size, ...] = ()
    coordinate: tuple[Count, ...] = ()
    placements: tuple[Name, ...] = ()
    mesh_axis_names: tuple[Name, ...] = ()
    flat_range: tuple[Count, Count] | None = None
    """Set when this rank holds only elements [start, end) of the row-major flattening of the block
    its placements give it, as Megatron's distributed optimizer does with reduced gradients."""

    def __post_init__(self) -> None:
        if not (len(self.mesh_shape) == len(self.coordinate) == len(self.placements)):
            raise ValueError(
                f"layout has mesh_shape {self.mesh_shape}, coordinate {self.coordinate} and placements "
                f"{self.placements}: all three need one entry per mesh axis"
            )
        for c, n in zip(self.coordinate, self.mesh_shape):  # (a loop: a generator costs more, on every row read)
            if c >= n:
                raise ValueError(f"coordinate {self.coordinate} lies outside mesh {self.mesh_shape}")
        if self.flat_range is not None and self.flat_range[0] > self.flat_range[1]:
            raise ValueError(f"flat_range {self.flat_range} ends before it starts")
        if math.prod(self.global_shape) > MAX_SIZE:
            raise ValueError(f"global shape {self.global_shape} holds more than 2**48 elements")

    @staticmethod
    def replicated(shape: tuple[int, ...]) -> Layout:
        return Layout(global_shape=tuple(shape))


class TensorStats(Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Summary kept instead of the values in stats-only mode (and alongside them otherwise)."""

    numel: Count
    sum: Finite
    sumsq: FiniteNonNegative
    min: Finite
    max: Finite
    num_nan: Count
    num_inf: Count


class TensorMeta(Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Everything recorded about one shard, except its values."""

    key: TensorKey
    rank: Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]
    dtype: DtypeName
    """torch dtype name without the `torch.` prefix; bf16 and fp8 are stored as raw bits."""
    local_shape: tuple[Count, ...]
    layout: Layout
    seq: Count
    """Recording order within the step on this rank: the execution order of the run."""
    scale: FinitePositive = 1.0
    """The recorded values equal the logical values times `scale` (loss scaling of gradients)."""
    stats: TensorStats | None = None
    stats_only: bool = False
    fp8_scale_inv: FinitePositive | None = None


MAX_FINDING_CHARS = 1000


class Finding(Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A tensor the tracer could not record (its layout cannot be mapped, or recording it failed): its
    values are not in the trace, this record of why is, in the step file of `step`."""

    step: Count
    rank: Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]
    fqn: Name
    """The module (or parameter) the tensor belongs to."""
    slot: Name
    """The tensor's slot ("input.2"); empty when the failure hit a module's call, not one of its tensors."""
    message: Annotated[str, Meta(max_length=MAX_FINDING_CHARS)]
    """One line naming the tensor, what is wrong and what to do."""
    key: TensorKey | None = None
    """The tensor left out; None when the failure came before its key was known."""


# Fields every manifest this format version writes holds: reading one without them refuses it rather
# than filling in a default (a missing precision must not read as fp32). Later additions (entrypoint,
# tracer, environment, blind_spots) stay optional, so older traces still open.
REQUIRED_MANIFEST_FIELDS = ("format_version", "role", "world_size", "degrees", "mesh_shape", "mesh_axis_names",
                            "rank_coordinates", "precision", "seed", "model")


@dataclass(kw_only=True, slots=True)
class RunManifest:
    """manifest.json of a run directory: who produced the trace and in which layout."""

    format_version: int = FORMAT_VERSION
    role: Literal["reference", "candidate"]
    world_size: Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)]
    degrees: dict[Name, Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]] = field(default_factory=dict)
    """Parallel degrees, e.g. {"tp": 2, "sp": 1, "pp": 1, "dp": 1, "fsdp": 1}."""
    mesh_shape: list[Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)]] = field(default_factory=list)
    mesh_axis_names: list[Name] = field(default_factory=list)
    rank_coordinates: list[list[Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]]] = field(default_factory=list)
    """rank_coordinates[r] is rank r's coordinate in the mesh."""
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    seed: int = 0
    model: dict[str, Any] = field(default_factory=dict)
    """Model configuration; two runs are comparable only when these are equal."""
    entrypoint: dict[str, Any] = field(default_factory=dict)
    """{"factory": "module:function", "config": {...}}: what relaunches this run."""
    tracer: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    """Where it was recorded (fingerprint.py): command, Python and package versions, variables, world size."""
    blind_spots: dict[str, str] = field(default_factory=dict)
    """Modules whose boundaries the trace cannot see, and why (inside a torch.compile region, ...)."""
    correspondence: dict[str, Any] = field(default_factory=dict)
    """Set in a reference rewritten from another implementation's run through a correspondence map
    (canonicalize/mapped_run.py, docs/porting.md): the map, the source run, and the tensors of either side
    the map gives no counterpart; compare's coverage lists them. Empty in a recorded run."""

    def __post_init__(self) -> None:
        """The mesh must describe the world: its sizes multiply to world_size, every rank has a
        coordinate inside it, and a degree named like a mesh axis equals that axis' size."""
        if self.mesh_shape and math.prod(self.mesh_shape) != self.world_size:
            raise ValueError(f"mesh_shape {self.mesh_shape} holds {math.prod(self.mesh_shape)} ranks, world_size is {self.world_size}")
        if len(self.mesh_axis_names) != len(self.mesh_shape):
            raise ValueError(f"mesh_axis_names {self.mesh_axis_names} do not name the {len(self.mesh_shape)} axes of mesh_shape")
        if self.mesh_shape and not self.rank_coordinates:
            raise ValueError(f"mesh_shape {self.mesh_shape} is given but rank_coordinates is empty: each rank needs its coordinate")
        for name, size in zip(self.mesh_axis_names, self.mesh_shape):
            if name not in self.degrees:
                raise ValueError(f"mesh axis {name!r} (size {size}) has no entry in degrees {self.degrees}")
        if self.rank_coordinates:
            if len(self.rank_coordinates) != self.world_size:
                raise ValueError(f"rank_coordinates has {len(self.rank_coordinates)} entries for world_size {self.world_size}")
            for rank, coordinate in enumerate(self.rank_coordinates):
                if len(coordinate) != len(self.mesh_shape) or any(c >= n for c, n in zip(coordinate, self.mesh_shape)):
                    raise ValueError(f"rank_coordinates[{rank}] {coordinate} lies outside mesh_shape {self.mesh_shape}")
        for name, size in zip(self.mesh_axis_names, self.mesh_shape):
            if name in self.degrees and self.degrees[name] != size:
                raise ValueError(f"degrees[{name!r}] is {self.degrees[name]} but mesh axis {name!r} has size {size}")

    def to_dict(self) -> dict:
        return asdict(self)
