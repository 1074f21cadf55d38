"""Stage 1 (record) for any training script: `ttrace.attach(model, optimizer)` and the session that `ttrace record` hands it.

Input: the user's model (after parallelizing) and optimizer, and the session spec of the ttrace
command that launched the script. Output: a `Session` whose `step(i)` records iteration i with a
`Tracer` (tracer.py). Three modes, set only by the launching command:
- "record" (`ttrace record`): re-initialize the weights from (seed, canonical name), then trace;
- "perturb" (`ttrace estimate` re-running the reference): the same weights times (1 + delta);
- "rewrite" (`ttrace localize` relaunching the candidate): every traced module computes from the
  reference's inputs (rewrite.py).

Outside a ttrace command, `attach` returns an inactive session: it changes no weight, hooks nothing
and writes nothing. The launcher passes the path of its spec file in TTRACE_SESSION, and the spec
names the launcher's pid: a variable left over in a shell (its launcher gone, or its file deleted)
is ignored with a warning, so a stray TTRACE_* variable never changes a plain run.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from ttrace_core.errors import TtraceError
from ttrace_core.format.fingerprint import environment_fingerprint
from ttrace_core.record.generator import WeightPerturbation, initialize_weights
from ttrace_core.record.processes import process_alive
from ttrace_core.format.naming import global_fqn
from ttrace_core.format.schema import RunManifest, strip_wrappers

if TYPE_CHECKING:
    from ttrace_core.record.tracer import TracerConfig

SESSION_ENV = "TTRACE_SESSION"
MODES = ("record", "perturb", "rewrite")


@dataclass(kw_only=True, slots=True)
class SessionSpec:
    """What a ttrace command asks of the script it launches (JSON, in the file TTRACE_SESSION names)."""

    out: str
    """Run directory to record into."""
    mode: str = "record"
    """"record", "perturb" (estimate) or "rewrite" (localize)."""
    launcher_pid: int
    """The ttrace process that launched the command; a spec whose launcher is gone is stale."""
    command: list[str] = field(default_factory=list)
    """The user's command (torchrun ... train.py ...), as `ttrace record` was given it."""
    cwd: str = ""
    seed: int = 0
    """Seed of the weights drawn from (seed, canonical name)."""
    role: str | None = None
    """"reference" or "candidate"; None: reference on one rank, candidate otherwise."""
    stats_only: bool = False
    perturbation: dict | None = None
    """A WeightPerturbation as a dict (mode "perturb")."""
    rewrite: dict | None = None
    """{"reference": run dir, "module": fqn or None} (mode "rewrite")."""
    precision: str | None = None
    """Compute in this precision instead of the recorded one (`ttrace estimate --for-precision fp8`
    re-runs a bf16 reference as fp8); None: as recorded. Read it with `requested_precision()`."""
    value_steps: list[int] | None = None
    """Record values for exactly these steps and nothing else, whatever the script's own tracer
    configuration says (adaptive capture's second pass, adaptive.py); None: as configured."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"session mode {self.mode!r}: choose from {MODES}")
        if (self.mode == "perturb") != (self.perturbation is not None) or (self.mode == "rewrite") != bool(self.rewrite):
            raise ValueError(f"session mode {self.mode!r} with perturbation {self.perturbation} and rewrite {self.rewrite}")

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def read(path: Path) -> SessionSpec:
        try:
            return SessionSpec(**json.loads(path.read_text()))
        except (OSError, TypeError, ValueError) as error:
            raise TtraceError(f"{path}: not a ttrace session spec ({error}); relaunch the script under `ttrace record`") from error


def active_spec() -> SessionSpec | None:
    """The spec of the ttrace command that launched this process, or None for a plain run."""
    value = os.environ.get(SESSION_ENV)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        warnings.warn(f"{SESSION_ENV}={value} names no session file (left over from an earlier ttrace command?); "
                      "running untraced", stacklevel=3)
        return None
    spec = SessionSpec.read(path)
    if not process_alive(spec.launcher_pid):
        warnings.warn(f"{SESSION_ENV}={value}: its ttrace command (pid {spec.launcher_pid}) has ended; running untraced",
                      stacklevel=3)
        return None
    return spec


# ---- the session ------------------------------------------------------------------------------

def requested_precision() -> str | None:
    """The precision a ttrace command asks this run to compute in, instead of its own ("fp8" when
    `ttrace estimate --for-precision fp8` re-runs a bf16 reference); None: the run's own. A script
    that supports it applies it to its config; ttrace checks the relaunched manifest's precision."""
    spec = active_spec()
    return None if spec is None else spec.precision


def weight_perturbation() -> WeightPerturbation | None:
    """The perturbation `ttrace estimate` asks of this run, for a script that draws its own consistent
    weights (attach(..., weights="own")) and must apply it before wrapping; None otherwise."""
    spec = active_spec()
    return None if spec is None else WeightPerturbation.from_dict(spec.perturbation)


class Session:
    """What `attach` returns: `with session.step(i):` around each training iteration. Inactive (every
    method a no-op) outside a ttrace command."""

    def __init__(self, tracer=None, spec: SessionSpec | None = None) -> None:
        self.tracer = tracer
        self.spec = spec

    @property
    def active(self) -> bool:
        return self.tracer is not None

    def step(self, step: int):
        return nullcontext() if self.tracer is None else self.tracer.step(step)

    def declare(self, fqn_glob: str, slot_glob: str, placements, mesh) -> None:
        """Layouts that cannot be inferred (plain local tensors that are shards); see Tracer.declare."""
        if self.tracer is not None:
            self.tracer.declare(fqn_glob, slot_glob, placements, mesh)

    def declare_flat_range(self, fqn: str, slot: str, start: int, end: int) -> None:
        """This rank holds only elements [start, end) of its flattened block; see Tracer.declare_flat_range."""
        if self.tracer is not None:
            self.tracer.declare_flat_range(fqn, slot, start, end)

    @property
    def run_dir(self) -> Path | None:
        """Where this run records (None outside a ttrace command)."""
        return None if self.spec is None else Path(self.spec.out)

    def record_gradients(self) -> None:
        """For an optimizer that is not a torch.optim.Optimizer (Megatron's): call before its step."""
        if self.tracer is not None:
            self.tracer.record_gradients()

    def record_parameters(self) -> None:
        """For an optimizer that is not a torch.optim.Optimizer: call after its step."""
        if self.tracer is not None:
            self.tracer.record_parameters()

    @property
    def one_module_replay(self) -> dict | None:
        """{"module", "candidate", "step"} when `ttrace localize` asks this run to call only one module
        on the candidate's recorded inputs (see replay_one_module); None otherwise."""
        return None if self.spec is None or not self.spec.rewrite else self.spec.rewrite.get("alone")

    def replay_one_module(self, model: nn.Module | list[nn.Module]) -> None:
        """Instead of training: call the module `one_module_replay` names once per recorded micro-batch
        (module_replay.py). A script that offers it checks `one_module_replay` after attach. For a model
        given as chunks, the chunks attach traced (their names carry the chunk's index)."""
        from ttrace_core.record.module_replay import drive_module

        replay = self.one_module_replay
        if isinstance(model, (list, tuple)):
            model = self.tracer.model
        drive_module(self.tracer, model, replay["candidate"], self.spec.rewrite["module"], replay.get("step", 0))
        self.tracer = None  # drive_module closed it

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
            self.tracer = None


def attach(model: nn.Module | list[nn.Module], optimizer=None, *, loss_scale: float = 1.0,
           data_parallel: tuple[int, int] | None = None, weights: str = "reinit", include: tuple[str, ...] = ("*",),
           exclude: tuple[str, ...] = (), config: TracerConfig | None = None,
           manifest: RunManifest | None = None) -> Session:
    """Trace `model` (after parallelize_module / fully_shard / DDP, or Megatron's DDP) when launched by a
    ttrace command.

    A megatron-core model is recognized by itself: its layouts, degrees, mesh and logical parameter
    shapes come from megatron's own attributes and parallel state, the loss scale from its schedule,
    and `optimizer` may be the Megatron optimizer (its step is wrapped: it has no step hooks). So is a
    transformers model that transformers parallelized itself: the layouts of the plain shards its
    parallel styles return come from the model's TP / EP plan (integrations/transformers.py).

    model: the model (or what Lightning Fabric's `setup` returned), or megatron-core's list of model chunks
        (virtual pipeline stages, each in its own DDP) as passed to the interleaved schedule: every chunk is
        traced, under the reference's global layer names, with micro-batch ids counted per chunk.

    optimizer: a torch.optim.Optimizer, or any optimizer whose step() the tracer may wrap.
    loss_scale: the factor each micro-batch loss is multiplied by before backward (1 / local
        micro-batches under gradient accumulation), so that activation gradients compare across layouts;
        megatron's schedule says it by itself.
    data_parallel: (rank, size) among data-parallel replicas when it cannot be inferred (DDP, megatron,
        or mesh axes named dp/fsdp/...). Local micro-batch k of DP rank r is global micro-batch k * size + r.
    weights: "reinit" draws every non-constant weight from (seed, canonical name) in its full logical
        shape and slices it by the parameter's layout; "keep" when the run loads a checkpoint (both runs
        must load the same one); "own" when the script drew identical logical weights itself (applying
        `weight_perturbation()`).
    config, manifest: a full TracerConfig and the run's description; they replace what attach infers. The
        call's own loss_scale, include and exclude still apply to the config (when they differ from
        attach's defaults; a config that sets them otherwise is refused).
    """
    if weights not in ("reinit", "keep", "own"):
        raise ValueError(f"attach(weights={weights!r}): choose reinit, keep or own")
    spec = active_spec()
    if spec is None:
        return Session()
    from ttrace_core.integrations.torch_native import without_fabric_wrapper

    model = model if isinstance(model, (list, tuple)) else without_fabric_wrapper(model)
    from ttrace_core.record.adapters import TracerSelection
    from ttrace_core.record.rewrite import rewriter_from_config
    from ttrace_core.record.tracer import Tracer

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    role = spec.role or ("reference" if world_size == 1 else "candidate")
    adapter = _adapter_for(model, optimizer, role, world_size, TracerSelection(include, exclude, loss_scale, data_parallel))
    config = _configured(adapter.config if config is None else _with_arguments(config, loss_scale, include, exclude), spec)
    if weights != "own":
        initialize_weights(adapter.traced, seed=spec.seed, reinit=weights == "reinit",
                           perturbation=WeightPerturbation.from_dict(spec.perturbation),
                           rename=lambda name: global_fqn(strip_wrappers(name), config.rename),
                           layout_of=adapter.parameter_layout, constants=adapter.constants() if weights == "reinit" else {})
        adapter.after_weights(optimizer)
    if manifest is None:
        manifest = adapter.manifest()
        manifest.seed = spec.seed
    manifest = _described(manifest, spec, role, world_size, adapter.compiled)
    tracer = Tracer(spec.out, adapter.traced, role=role, optimizer=optimizer, config=config, manifest=manifest,
                    rewriter=rewriter_from_config(spec.rewrite, spec.out), captures=adapter.captures)
    adapter.declare(tracer, optimizer)
    session = Session(tracer, spec)
    atexit.register(session.close)
    return session


def _with_arguments(config: TracerConfig, loss_scale: float, include: tuple[str, ...],
                    exclude: tuple[str, ...]) -> TracerConfig:
    """A full config given to attach, with what the call itself says: an argument other than attach's default
    is applied (it is never silently ignored), and one the config sets otherwise is refused."""
    from ttrace_core.format.tracer_config import TracerConfig

    given = {name: value for name, value, default in (("loss_scale", loss_scale, 1.0), ("include", tuple(include), ("*",)),
                                                      ("exclude", tuple(exclude), ())) if value != default}
    defaults = TracerConfig()
    for name, value in given.items():
        if getattr(config, name) not in (value, getattr(defaults, name)):
            raise ValueError(f"attach({name}={value!r}) and config.{name}={getattr(config, name)!r} disagree; "
                             "give it once")
    return dataclasses.replace(config, **given) if given else config


def _configured(config: TracerConfig, spec: SessionSpec) -> TracerConfig:
    """The session's part of the tracer configuration: stats-only, and adaptive capture's value steps."""
    config = dataclasses.replace(config, stats_only=config.stats_only or spec.stats_only)
    if spec.value_steps is not None:
        config = dataclasses.replace(config, stats_only=False, steps=tuple(spec.value_steps))
    return config


def _adapter_for(model: nn.Module | list[nn.Module], optimizer, role: str, world_size: int, selection):
    from ttrace_core.integrations.megatron import is_megatron_model
    from ttrace_core.integrations.transformers import is_transformers_parallel_model
    from ttrace_core.record.adapters import MegatronAdapter, TorchAdapter, TransformersAdapter

    if isinstance(model, (list, tuple)):
        return MegatronAdapter(_megatron_chunks(model), optimizer, role, world_size, selection)
    if is_megatron_model(model):
        return MegatronAdapter(model, optimizer, role, world_size, selection)
    unwrapped = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if is_transformers_parallel_model(unwrapped):
        return TransformersAdapter(model, role, world_size, selection)
    return TorchAdapter(model, role, world_size, selection)


def _megatron_chunks(model: list[nn.Module] | tuple[nn.Module, ...]) -> nn.Module | list[nn.Module]:
    """A model given as a list: megatron-core chunks (virtual pipeline stages), as the interleaved
    schedule takes them; a list of one is that model. Anything else is refused in one line, before
    the training starts."""
    from ttrace_core.integrations.megatron import is_megatron_model

    chunks = list(model)
    kinds = [type(chunk).__name__ for chunk in chunks]
    if not chunks or not all(isinstance(chunk, nn.Module) and is_megatron_model(chunk) for chunk in chunks):
        raise ValueError(f"attach() got a list of {len(chunks)} ({', '.join(kinds) or 'empty'}): a list is read as "
                         "megatron-core model chunks (virtual pipeline stages) and these are not; pass one nn.Module")
    return chunks[0] if len(chunks) == 1 else chunks


def _described(manifest: RunManifest, spec: SessionSpec, role: str, world_size: int, compiled: list[str]) -> RunManifest:
    """The session's part of the manifest: the command that relaunches the run and where it ran."""
    manifest.role, manifest.world_size = role, world_size
    if spec.command:
        manifest.entrypoint = {"command": spec.command, "cwd": spec.cwd, "seed": spec.seed}
    manifest.environment = environment_fingerprint(world_size) | ({"command": spec.command, "cwd": spec.cwd}
                                                                  if spec.command else {})
    manifest.blind_spots |= {name: "inside torch.compile: a hook there would break the compiled graph; its "
                                   "parameters and gradients are recorded, and the activations of the modules outside "
                                   "the compiled code" for name in compiled}
    return manifest
