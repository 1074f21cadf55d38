"""Stage 1 of record -> canonicalize -> compare -> localize -> render.

Input: a live model (and optimizer) on one rank. Output: that rank's step files in a run
directory, plus manifest.json from rank 0. Per step and micro-batch the tracer records every
selected module's forward inputs and outputs and its activation gradients (grad_output,
grad_input); per step, each parameter's gradient after every reduction and before
optimizer.step(), and each parameter after it. Each tensor is stored with the layout in effect:
a DTensor's own placements, an annotation declared with `Tracer.declare`, the layout of the
forward tensor a gradient belongs to, or else "whole tensor, replicated".

Integration:

    tracer = Tracer(run_dir, model, role="candidate", optimizer=optimizer)
    for step in range(num_steps):
        with tracer.step(step):
            ...forward/backward over micro-batches...
            optimizer.step()
    tracer.close()

Attach the tracer after parallelize_module / fully_shard / DDP, so that its hooks see what the
module really receives and returns. Hooks only read: they return None and never change outputs.

A debugging tool must never take down the run it observes: no hook or recording call raises into
the training. A tensor that cannot be recorded (a declared placement that does not fit it, a layout
no one can infer, an error of the tracer's own) is left out and its step keeps a finding instead
(format/findings.py); a step that cannot be written (a full disk) stops the recording, not the training.

Its own errors become findings (failures.py words them and keeps them from the training). Its parts: module_hooks.py
(the hooks on traced modules), selection.py (which modules are traced, under which name), layouts.py and declarations.py
(the layout of a tensor that does not describe its own), step_state.py (which micro-batch and call a
module boundary belongs to), summaries.py (an activation's statistics, taken once per step for the same bytes).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ttrace_core.integrations import fsdp1
from ttrace_core.integrations.torch_native import computed_precision
from ttrace_core.integrations.dtensor import (
    layout_from_dtensor, local_value, own_micro_batch_value,
)
from ttrace_core.format.fingerprint import environment_fingerprint
from ttrace_core.canonicalize.placements import without_mesh_axes
from ttrace_core.format.naming import (
    DATA_PARALLEL_AXES, GRADIENT_CLIPPING, LOSS_FUNCTION, display_fqn, owner_of, slot_family,
)
from ttrace_core.format.schema import (
    MAX_FINDING_CHARS, NO_MICRO_BATCH, PRE_STEP_SLOT, TOKENS_SLOT, Finding, Layout, RunManifest, TensorKey, TensorMeta, strip_wrappers,
)
from ttrace_core.record.background_writer import BackgroundWriter
from ttrace_core.record.declarations import Declarations, UnknownLayoutError
from ttrace_core.record.failures import failure_message, never_raises, one_sentence
from ttrace_core.record.layouts import has_partial, plain_layout, with_flat_range
from ttrace_core.record.module_hooks import ModuleHooks, quiet_hook_warnings
from ttrace_core.record.producers import ProducerLayouts
from ttrace_core.record import selection
from ttrace_core.record.step_state import LossPieces, StepState
from ttrace_core.record.summaries import StepSummaries
from ttrace_core.canonicalize.token_rows import expert_fqn
from ttrace_core.record.token_rows import RoutedTokens
from ttrace_core.record.step_scalars import (
    TORCH_CAPTURES, capture_optimizer, scalars_agree, unit_roundoff,
)
from ttrace_core.format.tracer_config import TracerConfig
from ttrace_core.format.datasets import NATIVE_DTYPES, RAW_BITS
from ttrace_core.format.reader import dtype_name
from ttrace_core.format.writer import RunWriter, refuse_existing_trace, write_failure, write_manifest


class InputRewriting(Protocol):
    """What the Tracer needs of localize's input rewriting (rewrite.InputRewriter)."""

    def attach(self, tracer: Tracer, model: nn.Module, handles: list) -> None: ...
    def records_grad_outputs(self, fqn: str) -> bool: ...
    def describe(self) -> dict: ...
    def close(self) -> None: ...


class Tracer:
    def __init__(self, run_dir: str | os.PathLike, model: nn.Module, *, role: str,
                 optimizer: torch.optim.Optimizer | None = None, config: TracerConfig | None = None,
                 manifest: RunManifest | None = None, rewriter: InputRewriting | None = None,
                 captures: Sequence[Callable[[Tracer], Callable[[], None]]] | None = None) -> None:
        """`rewriter` (localize's input rewriting, rewrite.py) is the one way to change what traced modules
        compute; without it the hooks only read. `captures` (step_scalars.py) wrap the functions that
        compute the step's scalars (the loss, clipping); each returns its undo, called at close. None:
        PyTorch's (the loss backward starts from, torch's clipping)."""
        if role not in ("reference", "candidate"):
            raise ValueError(f"role must be 'reference' or 'candidate', got {role!r}")
        self.config = config or TracerConfig()
        self.model = model
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        writer = RunWriter(run_dir, self.rank)
        self._writer = BackgroundWriter(writer, self.config.writer_queue_bytes) if self.config.writer_queue_bytes else writer
        self._declarations = Declarations()
        self._producers = ProducerLayouts()
        """Sharded plain tensors recorded this step, for the modules that only pass them on (producers.py)."""
        self.routed = RoutedTokens()
        """The routed modules (MoE experts) whose activations are recorded by token (token_rows.py): an
        adapter names them (`route_tokens`) and tells, per call, which token each row holds."""
        self._state: StepState | None = None
        self._summaries = StepSummaries()
        """The statistics of the activations recorded this step, reused for the same bytes recorded again (summaries.py)."""
        self._handles: list = []
        self._rewriter = rewriter
        self._recording_stopped = False
        """A step could not be written (a full disk): nothing more is recorded in this run."""
        self._last_recorded_step: int | None = None
        self._held_findings: list[tuple[str, str, str, TensorKey | None]] = []
        """Findings made outside a step, written with the next one."""
        self.num_findings = 0
        """Tensors (or module calls) this run left out with a finding so far."""
        self.skipped_steps = 0
        """Steps the optimizer skipped so far (a non-finite gradient under loss scaling)."""
        self._manifest: RunManifest | None = None
        """Rank 0's manifest, kept to record the precision the first step shows (`_observed_precision`)."""
        self._output_dtypes: Counter[str] = Counter()
        """Floating dtypes of the module outputs recorded in the first step."""
        if self.rank == 0:
            refuse_existing_trace(run_dir, manifest_only=True)
            manifest = manifest or RunManifest(role=role, world_size=world_size)
            manifest.role, manifest.world_size = role, world_size
            manifest.tracer = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()}
            manifest.environment = manifest.environment or environment_fingerprint(world_size)
            if rewriter is not None:
                manifest.tracer |= rewriter.describe()
            write_manifest(run_dir, manifest)
            self._manifest = manifest
        self._module_hooks = ModuleHooks(self, rewriter)
        # A model given as chunks (config.model_chunks) is a ModuleList of roots, each a micro-batch clock.
        self._roots = list(model) if self.config.model_chunks else [model]
        if len(self._roots) != max(self.config.model_chunks, 1):
            raise ValueError(f"TracerConfig.model_chunks is {self.config.model_chunks} but the model has "
                             f"{len(self._roots)} chunks; pass the chunks as one nn.ModuleList")
        self._module_hooks.attach_root(self._roots, self._handles)
        self.blind_spots: dict[str, str] = self.untraced_modules(model)
        """Module -> what the trace of it misses: the configuration's exclusions, and modules whose
        backward hooks cannot fire (found during the run); written with every step file."""
        quiet_hook_warnings()
        self._module_hooks.attach(model, self._handles, self._roots)
        if rewriter is not None:
            rewriter.attach(self, model, self._handles)
        self._undo = [capture(self) for capture in (TORCH_CAPTURES if captures is None else captures)]
        if optimizer is not None:
            self._undo.append(capture_optimizer(self, optimizer))

    # ---- selection and layout resolution ----------------------------------------------------

    def global_fqn(self, local_fqn: str) -> str:
        """The reference's name of this rank's module or parameter: wrapper components dropped
        (activation checkpointing, torch.compile), then the config's renames applied."""
        return selection.global_name(self.config, local_fqn)

    def is_selected(self, local_fqn: str) -> bool:
        return selection.is_selected(self.config, local_fqn)

    def traced_modules(self, model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
        """(global fqn, module, whether its backward is hooked) of every module whose activations are
        recorded (selection.py)."""
        return selection.traced_modules(self.config, model)

    def untraced_modules(self, model: nn.Module) -> dict[str, str]:
        """Global fqn -> why the trace cannot see into it (selection.py)."""
        return selection.untraced_modules(self.config, model)

    def declare(self, fqn_glob: str, slot_glob: str, placements: Sequence, mesh) -> None:
        """Declare the layout of plain (non-DTensor) tensors at matching module slots.

        Example: under sequence parallelism with local outputs, `tracer.declare("layers.*",
        "output.0", [Shard(1)], tp_mesh)` says each rank holds its sequence shard of a block output.
        `mesh` is a DeviceMesh or (mesh_shape, coordinate, axis_names); placements are DTensor
        placements or their strings ("S(0)", "R", "P(sum)"). Globs match the recorded (global) fqn.
        Later declarations win over earlier ones. A tensor a declaration does not fit (a placement on a
        dim it lacks) is left out with a finding naming both.
        """
        self._declarations.declare(fqn_glob, slot_glob, placements, mesh)

    def route_tokens(self, roots: Sequence[str]) -> None:
        """Record the activations of the modules named `roots` (global names) and of everything inside them
        by token (token_rows.py): the adapter that names them registers each call's `TokenRows` with
        `self.routed.expect(...)` before the call's forward runs."""
        self.routed.roots = frozenset(roots)

    def on_close(self, undo: Callable[[], None]) -> None:
        """Call `undo` when the tracer closes: an adapter's own watch over the model (a wrapped dispatcher)."""
        self._undo.append(undo)

    def declare_flat_range(self, fqn: str, slot: str, start: int, end: int) -> None:
        """This rank's values of tensor (fqn, slot) are only elements [start, end) of its flattened
        local block, e.g. the gradient shard a distributed optimizer reduced onto this rank; the
        rest of the local tensor is not the logical value and is not recorded."""
        self._declarations.declare_flat_range(fqn, slot, start, end)

    def declare_held(self, fqn: str, layout: Layout) -> None:
        """Parameter `fqn`'s value and gradient on this rank are already the part of it that `layout` says (a flat
        range of the logical tensor, as FSDP1 keeps it: integrations/fsdp1.py); recorded as they are."""
        self._declarations.held[fqn] = layout

    def layout_of(self, key: TensorKey, value: torch.Tensor) -> Layout:
        """The layout in effect for `value`, recorded (or about to be recorded) under `key`."""
        if isinstance(value, DTensor):
            return self._dtensor_layout(key, value)
        return plain_layout(self._declarations, self._state, key, local_value(value), self._producers, value)

    @staticmethod
    def _dtensor_layout(key: TensorKey, value: DTensor) -> Layout:
        """A DTensor's own layout; for an activation, without its data-parallel mesh axes: a data-parallel
        rank's local batch is a micro-batch of its own (global_micro_batch), never a shard of a larger one."""
        layout = layout_from_dtensor(value)
        if key.phase in ("forward", "backward"):
            return without_mesh_axes(layout, DATA_PARALLEL_AXES, tuple(value.to_local().shape))
        return layout

    # ---- recording ----------------------------------------------------------------------------

    @property
    def state(self) -> StepState | None:
        """Which micro-batch and call each module boundary of the step being recorded belongs to; None outside one."""
        return self._state

    def recording(self) -> bool:
        """Whether a forward that runs now is recorded: inside a recorded step, and not a forward that runs
        inside a backward (activation checkpointing's recomputation, not a new call)."""
        return self._state is not None and torch._C._current_graph_task_id() == -1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing that runs inside is recorded, and the step being recorded goes on after it: an evaluation a
        trainer runs between two micro-batches of one optimizer step (Lightning's `val_check_interval`)."""
        state, self._state = self._state, None
        try:
            yield
        finally:
            self._state = state

    def key(self, phase: str, fqn: str, slot: str, micro_batch: int, call: int = 0) -> TensorKey:
        return TensorKey(step=self._state.step, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot, call=call)

    def record(self, key: TensorKey, value: torch.Tensor, *, scale: float | None = None, seq: int | None = None) -> None:
        """Store one tensor of the current step under `key` (skipped when its slot kind is not selected).
        `scale`: what the values are multiplied by (default: the loss scale for activation gradients).
        `seq`: its place in the step, when it was reserved earlier than the value was known (the loss).
        A tensor that cannot be recorded (its layout cannot be mapped, or recording it fails) is left out
        and the step keeps a finding instead: the training goes on."""
        if key.phase == "backward" and self._state is not None and self._state.loss_backwards:
            self._state.loss_backwards[-1].add(key.micro_batch)
        try:
            if self.routed.roots and key.phase in ("forward", "backward") and self._record_by_token(key, value, scale):
                return
            self._record(key, value, scale, seq)
        except UnknownLayoutError as error:
            self._left_out(key, str(error))
        except Exception as error:  # noqa: BLE001 - the run must go on; the error is recorded
            self.record_error(error, key.fqn, key.slot, key)

    def _record_by_token(self, key: TensorKey, value: torch.Tensor, scale: float | None) -> bool:
        """A routed module's tensor with one row per token, recorded as one tensor per source micro-batch in
        token order (token_rows.py); False when `key` is no such tensor."""
        rows = self.routed.rows_for(key.fqn, key.micro_batch, key.call)
        if rows is None:
            return False
        local = local_value(value)
        if not local.dim() or local.shape[0] != rows.num_rows:
            # Routing bookkeeping handed to the experts (torchtitan's tokens per local expert): it counts the
            # rows of several micro-batches at once, and each piece's shape already says its count.
            return not (local.is_floating_point() or local.is_complex())
        with torch.no_grad():
            for micro_batch, expert, index in rows.pieces():
                piece_key = TensorKey(step=key.step, micro_batch=micro_batch, phase=key.phase,
                                      fqn=expert_fqn(key.fqn, expert), slot=key.slot, call=key.call)
                self._record(piece_key, local.index_select(0, index), scale)
                if key.phase == "forward" and key.slot == "input.0" and self.routed.root_of(key.fqn) == key.fqn:
                    # which tokens these rows are: compare aligns the rows by them when routing differs
                    positions = rows.ids.index_select(0, index) % rows.tokens_per_micro_batch
                    self._record(TensorKey(step=key.step, micro_batch=micro_batch, phase="forward",
                                           fqn=piece_key.fqn, slot=TOKENS_SLOT, call=key.call), positions, None)
        return True

    def _record(self, key: TensorKey, value: torch.Tensor, scale: float | None, seq: int | None = None) -> None:
        if self._recording_stopped or slot_family(key.slot) not in self.config.slots:
            return
        if key.phase == "backward" and not (value.is_floating_point() or value.is_complex()):
            return  # the "gradient" of an integer input (token ids, positions): autograd's placeholder, no values
        if (name := dtype_name(value.dtype)) not in NATIVE_DTYPES and name not in RAW_BITS:
            self._left_out(key, f"{key.fqn} {key.slot}: not recorded, ttrace cannot store dtype {name}")
            return
        state = self._state
        if key in state.recorded:  # (a step file lists a key once; the first record stands, and nothing is redone)
            self.add_finding(key.fqn, key.slot, f"recorded again in step {key.step} (micro-batch {key.micro_batch}, call "
                             f"{key.call}); the first record is kept")  # (no key: the tensor is in the trace)
            return
        local = local_value(value)
        layout = self._dtensor_layout(key, value) if isinstance(value, DTensor) else \
            plain_layout(self._declarations, self._state, key, local, self._producers, value)
        if (flat_range := self._declarations.flat_ranges.get((key.fqn, key.slot))) is not None:
            local = local.reshape(-1)[flat_range[0]:flat_range[1]]
            layout = with_flat_range(layout, flat_range)
        if key.phase == "forward" and self._last_recorded_step is None and local.is_floating_point() \
                and key.slot.startswith("output."):
            self._output_dtypes[name] += 1
        if key.phase == "forward" and layout.mesh_shape:
            state.forward_layouts[(key.fqn, key.micro_batch, key.call, key.slot)] = layout
            if type(value) is torch.Tensor:  # a plain shard: modules it is passed on to read its layout here
                self._producers.remember(state, key, value, layout)
        # A partial sum's statistics cannot be combined into the whole tensor's: it keeps its values.
        stats_only = self.config.stats_only and not has_partial(layout.placements) and key.slot != TOKENS_SLOT
        meta = TensorMeta(
            key=key, rank=self.rank, dtype=name, local_shape=tuple(local.shape), layout=layout,
            seq=state.seq if seq is None else seq,
            scale=scale or (self.config.loss_scale if key.phase == "backward" else 1.0),
            stats=self._summaries.stats(local, reusable=key.phase in ("forward", "backward") and flat_range is None),
            stats_only=stats_only,
        )
        state.recorded.add(key)
        if seq is None:
            state.seq += 1
        try:
            self._writer.write(meta, None if stats_only else local)
        except OSError as error:  # a full disk: the writer's own failure stops the recording
            self._stop_recording(key.step, error)

    def global_micro_batch(self, local_index: int) -> int:
        return local_index * self.config.data_parallel_size + self.config.data_parallel_rank

    def current_forward_call(self, fqn: str) -> tuple[int, int] | None:
        """(global micro-batch, call) of the forward of `fqn` in progress, None outside one (or in shape
        inference). A forward recomputed by activation checkpointing belongs to the call whose backward runs."""
        if self._state is None:
            return None
        if not self.recording():
            return self._state.next_backward_call(fqn, pop=False)
        pending = self._state.pending_forward[fqn]
        return pending[-1] if pending else None

    def coming_backward_call(self, fqn: str) -> tuple[int, int] | None:
        """(global micro-batch, call) the next backward of `fqn` belongs to."""
        return None if self._state is None else self._state.next_backward_call(fqn, pop=False)

    def _named_parameters(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """(global fqn, value, gradient or None) of each selected parameter of the user's model (fsdp1.py)."""
        for local_fqn, value, grad in fsdp1.named_parameters(self.model, self.config.grad_attr):
            name = strip_wrappers(local_fqn)
            if self.is_selected(owner_of(name)):
                yield self.global_fqn(local_fqn), value, grad

    @never_raises
    def record_scalar(self, phase: str, fqn: str, name: str, value: torch.Tensor, micro_batch: int = NO_MICRO_BATCH,
                      scale: float | None = None, seq: int | None = None) -> None:
        """One of the step's scalars (step_scalars.py) under the pseudo-module `fqn`, slot "scalar.<name>".
        Recorded once per step: code that computes it again (clipping called once per device mesh or per
        parameter group, with the one total norm) is checked for agreement, and a disagreement is a finding."""
        if not self.recording():
            return
        key = self.key(phase, fqn, f"scalar.{name}", micro_batch)
        number = float(local_value(value).detach().reshape(()).double())
        identity = (phase, fqn, key.slot, micro_batch)
        if (earlier := self._state.scalars.get(identity)) is None:
            self._state.scalars[identity] = number
            self.record(key, value, scale=scale, seq=seq)
        elif not scalars_agree(earlier, number, value.dtype):
            self.add_finding(key, message=f"computed twice in step {key.step} with different values, {earlier!r} "
                             f"then {number!r}; the first is kept (clipping per parameter group with separate norms, or a second "
                             "optimizer step inside the step?)")

    @never_raises
    def begin_loss_backward(self, loss: torch.Tensor) -> tuple[set[int], float, torch.dtype, int] | None:
        """A backward starts from `loss` (step_scalars.capture_backward_losses); `end_loss_backward` with what
        this returns after it. Which micro-batch the loss belongs to is what its module backwards belong to."""
        if not self.recording():
            return None
        state = self._state
        seen: set[int] = set()
        state.loss_backwards.append(seen)
        reserved = state.seq
        state.seq += 1
        value = own_micro_batch_value(loss) if isinstance(loss, DTensor) else loss
        return seen, float(value.detach().reshape(()).double()), value.dtype, reserved

    @never_raises
    def end_loss_backward(self, started: tuple[set[int], float, torch.dtype, int] | None) -> None:
        """Add the loss to the micro-batch its backward ran (LossPieces); recorded when the step's
        gradients are, so a loss in several pieces is recorded once, as its micro-batch's."""
        state = self._state
        if started is None or state is None:
            return
        seen, value, dtype, reserved = started
        if seen in state.loss_backwards:
            state.loss_backwards.remove(seen)
        micro_batch = self._loss_micro_batch(seen)
        if micro_batch is not None:
            pieces = state.loss_pieces.setdefault(micro_batch, LossPieces(seq=reserved, dtype=dtype))
            pieces.add(value, unit_roundoff(dtype))

    def _loss_micro_batch(self, seen: set[int]) -> int | None:
        """The global micro-batch of a loss whose backward ran the module backwards of `seen`. None (and a
        finding) when it cannot be told: one backward over several micro-batches under data parallelism."""
        state = self._state
        if len(seen) == 1:
            return next(iter(seen))
        if not seen:  # no traced module's backward ran: the root's calls (or else the losses) are the clock
            local = state.last_root_micro_batch()
            local = state.losses if local is None else local
            state.losses += 1
            return self.global_micro_batch(local)
        if self.config.data_parallel_size == 1:
            return NO_MICRO_BATCH  # a loss summed over the step's micro-batches: one per-step scalar
        self.add_finding(LOSS_FUNCTION, "scalar.loss", f"one backward ran micro-batches {sorted(seen)} (a loss summed "
                         f"over the step) on data-parallel rank {self.config.data_parallel_rank}: its share of the step's "
                         "loss cannot be told apart, so the loss is not recorded; the gradients are compared")
        return None

    def _record_losses(self) -> None:
        """The step's losses so far, each once, as its micro-batch's (with the loss scale, like the activation
        gradients it starts)."""
        pieces, self._state.loss_pieces = self._state.loss_pieces, {}
        for micro_batch, loss in sorted(pieces.items(), key=lambda item: item[1].seq):
            self.record_scalar("forward", LOSS_FUNCTION, "loss", torch.tensor(loss.total, dtype=loss.dtype), micro_batch,
                               scale=self.config.loss_scale, seq=loss.seq)

    @never_raises
    def record_loss(self, loss: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
        """A loss its training code computes per micro-batch in one piece (megatron's schedule says which), as the
        next local micro-batch's, and its token count when the loss function returns one."""
        if not self.recording():
            return
        micro_batch = self.global_micro_batch(self._state.losses)
        self._state.losses += 1
        self.record_scalar("forward", LOSS_FUNCTION, "loss", loss.detach().reshape(()), micro_batch,
                           scale=self.config.loss_scale)
        if num_tokens is not None:
            self.record_scalar("forward", LOSS_FUNCTION, "num_tokens", num_tokens.detach().reshape(()), micro_batch)

    def set_loss_scale(self, loss_scale: float) -> None:
        """What each micro-batch loss is multiplied by before backward, once the schedule says it."""
        self.config.loss_scale = loss_scale

    def guarded(self, action: Callable[[], object]) -> None:
        """Run a recording action from inside the user's training code that is not itself one of the
        never-raising entry points: an error in it is the trace's finding, never the run's exception."""
        try:
            action()
        except Exception as error:  # noqa: BLE001 (the run must go on; the error is recorded)
            self.record_error(error)

    @never_raises
    def record_gradients(self) -> None:
        """Record every parameter's reduced gradient; call after backward, before optimizer.step().
        Once per step: clipping records them before it scales them (step_scalars.py)."""
        if not self.recording() or self._state.gradients_recorded:
            return
        self._record_losses()
        self._state.gradients_recorded = True
        for fqn, _, grad in self._named_parameters():
            if grad is not None:
                self.record(self.key("grad", fqn, "grad", NO_MICRO_BATCH), grad)

    @never_raises
    def record_parameters(self, slot: str = "value") -> None:
        """Record every parameter's value; call after optimizer.step(). The step context records them
        before the step too (PRE_STEP_SLOT) when the previous step's values are not in the trace."""
        if not self.recording():
            return
        records = self._state.parameter_records
        records[slot] = records.get(slot, 0) + 1
        if records[slot] > 1:
            if records[slot] == 2:
                self._keep_finding(GRADIENT_CLIPPING, "", f"optimizer step: the optimizer stepped again in step {self._state.step}; the "
                                   "parameters after its first step are kept. A ttrace step is one optimizer step: open "
                                   "`step(i)` around each (under gradient accumulation, step the optimizer once per "
                                   "accumulated step)", None)
            return
        for fqn, param, _ in self._named_parameters():
            self.record(self.key("param", fqn, slot, NO_MICRO_BATCH), param)

    # ---- findings: what is left out, and why ----------------------------------------------------

    def add_finding(self, key_or_fqn: TensorKey | str, slot: str = "", message: str = "") -> None:
        """Keep a finding instead of a tensor, for code that knows it cannot be recorded rightly (its layout
        cannot be inferred): `message` says in one line what is wrong and what to do; the tensor's name is put
        before it. Made outside a step, it is written with the next recorded step."""
        key = key_or_fqn if isinstance(key_or_fqn, TensorKey) else None
        fqn, slot = (key.fqn, key.slot) if key is not None else (key_or_fqn, slot)
        self._keep_finding(fqn, slot, f"{display_fqn(fqn)} {slot}".rstrip() + f": {message}", key)

    def record_error(self, error: Exception, fqn: str = "", slot: str = "", key: TensorKey | None = None) -> None:
        """An error of the tracer's own code, met while recording `key` (or a call of module `fqn`): a finding,
        never the training's exception."""
        self._keep_finding(fqn, slot, failure_message(fqn, slot, error), key)

    def _left_out(self, key: TensorKey, message: str) -> None:
        """A tensor not recorded because its values cannot be mapped: its gradient cannot inherit its layout."""
        if key.phase == "forward" and self._state is not None:
            self._state.unmapped_forward.add((key.fqn, key.micro_batch, key.call, key.slot))
        self._keep_finding(key.fqn, key.slot, message, key)

    def _keep_finding(self, fqn: str, slot: str, message: str, key: TensorKey | None) -> None:
        if self._recording_stopped:
            return
        if self._state is None:
            self._held_findings.append((fqn, slot, message, key))
            return
        step = self._state.step
        finding = Finding(step=step, rank=self.rank, fqn=fqn, slot=slot, message=message[:MAX_FINDING_CHARS], key=key)
        self._to_writer(step, lambda: self._writer.add_finding(finding))
        if not self.num_findings:
            print(f"ttrace: rank {self.rank}: {finding.message} (the first finding of this run; `ttrace inspect "
                  f"{self._writer.run_dir}` lists them all)", file=sys.stderr, flush=True)
        self.num_findings += 1

    def _to_writer(self, step: int, action: Callable[[], None]) -> None:
        """A call of the writer outside a tensor's write: its failure stops the recording, not the training."""
        try:
            action()
        except Exception as error:  # noqa: BLE001 - the run must go on; the step says why it is partial
            self._stop_recording(step, error)

    def _stop_recording(self, step: int, error: Exception) -> None:
        """A step that cannot be written (a full disk, a file-size limit) stops the recording for the rest
        of the run, never the training: the step is left partial with the reason, and one line says so."""
        self._abandon_step(one_sentence(error))
        self._recording_stopped = True
        print(write_failure(self._writer.run_dir, self.rank, step, error), file=sys.stderr, flush=True)

    # ---- steps --------------------------------------------------------------------------------

    @contextmanager
    def step(self, step: int, *, parameters_before: bool = True) -> Iterator[None]:
        """Record one iteration. The step file is completed only if the block finishes; a step that cannot be
        written stops the recording, never the training (`_stop_recording`). `parameters_before`: False for
        a block that runs no optimizer step (a module replayed alone), whose parameters are not updated."""
        if self._recording_stopped or (self.config.steps is not None and step not in self.config.steps):
            yield
            return
        self._to_writer(step, lambda: self._writer.begin_step(step))
        if not self._recording_stopped:
            self._state = StepState(step=step)
            self._summaries.clear()
            self.routed.calls.clear()
            held, self._held_findings = self._held_findings, []
            for finding in held:
                self._keep_finding(*finding)
            if parameters_before and self._last_recorded_step != step - 1:
                self.record_parameters(PRE_STEP_SLOT)
        try:
            yield
        except BaseException as error:
            self._abandon_step(one_sentence(error))
            raise
        if not self._recording_stopped:
            self.guarded(self._record_losses)
            self._state = None
            self._summaries.clear()
            self._to_writer(step, lambda: self._writer.end_step(self.blind_spots))
            if self._last_recorded_step is None:
                self.guarded(self._observed_precision)
            self._last_recorded_step = step

    def _observed_precision(self) -> None:
        """After the first recorded step, the manifest's precision is what the module outputs were computed in
        when that is coarser than what it said (torch_native.computed_precision)."""
        manifest = self._manifest
        if manifest is None or manifest.precision is None:
            return
        precision = computed_precision(manifest.precision, self._output_dtypes)
        if precision != manifest.precision:
            manifest.precision = precision
            write_manifest(self._writer.run_dir, manifest)

    def _abandon_step(self, why: str = "") -> None:
        """Leave the open step file partial, saying `why` in it; a failing close (a full disk) must not hide why."""
        self._state = None
        try:
            self._writer.close(why)
        except Exception:  # noqa: BLE001 - the close is best effort: the training goes on
            pass

    @property
    def num_bytes_written(self) -> int:
        return self._writer.num_bytes_written

    @property
    def num_bytes_recorded(self) -> int:
        """The recorded tensors' bytes, each duplicate counted again (it is stored as a link to its first copy)."""
        return self._writer.num_bytes_written + self._writer.num_link_bytes

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        try:
            self._writer.close()
        finally:
            self._writer.stop()
        if self._rewriter is not None:
            self._rewriter.close()
