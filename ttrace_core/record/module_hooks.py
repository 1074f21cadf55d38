"""Part of stage 1 (record -> canonicalize -> compare -> localize -> render): the hooks on traced modules.

Input: the modules a Tracer traces (`Tracer.traced_modules`) and the Tracer's step state while a step
records (step_state.py). Output: one `Tracer.record` call per forward input and output and per
activation gradient (grad_output, grad_input) of every traced module call, under the (global
micro-batch, call) it belongs to; modules whose backward hooks cannot fire go to `Tracer.blind_spots`.
The Tracer turns those calls into step files (tracer.py); canonicalize reads them back.

The hooks only read: each returns None and never changes what a module receives or returns. An error
in one is the trace's finding on that module (`Tracer.record_error`), never the training's exception.
They run on every module call, so they avoid what costs per call: a pytree walk over a plain tuple of
tensors (`tensors_of`), and a second look at the same arguments.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from ttrace_core.format.schema import TensorKey
from ttrace_core.integrations.torch_native import compiled, compiled_in_place
from ttrace_core.record.step_state import StepState

_NEVER_TENSORS = (type(None), bool, int, float, str)
"""Leaf types of a module's arguments that hold no tensor and no container of them."""


class HookedTracer(Protocol):
    """What the module hooks need of the Tracer (tracer.py)."""

    blind_spots: dict[str, str]

    @property
    def state(self) -> StepState | None: ...
    def recording(self) -> bool: ...
    def key(self, phase: str, fqn: str, slot: str, micro_batch: int, call: int = 0) -> TensorKey: ...
    def record(self, key: TensorKey, value: torch.Tensor, *, scale: float | None = None) -> None: ...
    def record_error(self, error: Exception, fqn: str = "", slot: str = "", key: TensorKey | None = None) -> None: ...
    def global_micro_batch(self, local_index: int) -> int: ...
    def traced_modules(self, model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]: ...


class GradOutputRecorder(Protocol):
    """localize's input rewriting (rewrite.py), which records some modules' grad_output itself."""

    def records_grad_outputs(self, fqn: str) -> bool: ...


def quiet_hook_warnings() -> None:
    """Silence the two warnings the tracer's own hooks cause, once hooks are attached (never at import):
    a module whose inputs need no gradient (an embedding fed token ids) still gets its grad_output
    recorded, and torch warns about exactly that case on every backward; a module that returns neither
    a tensor nor a tuple gets no backward hook call, which the tracer lists as a blind spot
    (`Tracer.blind_spots`, shown by `ttrace inspect`) instead."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")
    warnings.filterwarnings("ignore", message="For backward hooks to be called, module output should be a Tensor")


FSDP_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"
"""FSDP2's warning (torch 2.13+, pytorch#181832) that a wrapped module's output is a view, on which an in-place
op would drop FSDP's pre-backward hook."""


def quiet_fsdp_view_warnings(model: nn.Module, handles: list) -> None:
    """Keep FSDP2 from warning about the views the tracer's own backward hooks make.

    A full backward hook hands a module's outputs through torch's BackwardHookFunction, which returns them
    as views of themselves. So under `ttrace record` a model whose forward ends in a traced module
    (`return self.norm(x)`) returns a view, and FSDP2 warns once per rank and wrapped module, where the same
    script without ttrace is silent. The hazard it warns of cannot pass silently here: an in-place op on such
    a view raises ("... is a view and is being modified inplace ... created inside a custom Function").
    So around each FSDP2 module's post-forward hook that warning is dropped when every view the module
    returns is one the hooks made; any other view (the script's own) still warns. Register after
    `fully_shard`, whose hook the window must enclose (attach's documented order)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 has no such warning
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            window = _HookViewWarningWindow()
            handles.append(module.register_forward_hook(window.open, prepend=True))
            handles.append(module.register_forward_hook(window.close, always_call=True))


class _HookViewWarningWindow:
    """FSDP_VIEW_WARNING ignored from the first forward hook of one module to its last (always called)."""

    def __init__(self) -> None:
        self._context: warnings.catch_warnings | None = None

    def open(self, module: nn.Module, args: tuple, output: object) -> None:
        views = [t for t in tensors_of(output) if t.requires_grad and t._base is not None]
        if views and all(type(t.grad_fn).__name__ == "BackwardHookFunctionBackward" for t in views):
            self._context = warnings.catch_warnings()
            self._context.__enter__()
            warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING, category=UserWarning)

    def close(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)


def tensors_of(values: object) -> list[torch.Tensor]:
    """The tensors among `values`, in pytree order. A tensor, or a tuple or list of tensors and plain
    scalars (what nearly every module takes and returns), is read directly; anything else is flattened."""
    if isinstance(values, torch.Tensor):
        return [values]
    if type(values) in (tuple, list):
        found = []
        for value in values:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif type(value) not in _NEVER_TENSORS:
                return _flattened_tensors(values)
        return found
    return _flattened_tensors(values)


def _flattened_tensors(values: object) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(values)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def hookable_output(output: object) -> bool:
    """A full backward hook fires only for a module that returns a tensor or a tuple (torch warns otherwise)."""
    return isinstance(output, (torch.Tensor, tuple))


class ModuleHooks:
    """The forward and backward hooks of every traced module of one Tracer."""

    def __init__(self, tracer: HookedTracer, rewriter: GradOutputRecorder | None = None) -> None:
        self._tracer = tracer
        self._rewriter = rewriter

    def attach_root(self, roots: list[nn.Module], handles: list) -> None:
        """The micro-batch clocks (step_state.py), one per root (the model, or each of its chunks):
        registered before any other hook on the root."""
        for chunk, root in enumerate(roots):
            if not compiled_in_place(root):  # (its hooks would run inside the compiled code: no clock there)
                handles.append(root.register_forward_pre_hook(self.guarded("", self._root_call_counter(chunk))))

    def attach(self, model: nn.Module, handles: list, roots: list[nn.Module] | None = None) -> None:
        """Hooks on every traced module of `model`; each reads the clock of the root in `roots` it belongs to."""
        chunk_of = {id(module): chunk for chunk, root in enumerate(roots or [model]) for module in root.modules()}
        for fqn, module, backward in self._tracer.traced_modules(model):
            # torch.compile's root runs no full backward hook: its output gradients are taken by tensor hooks
            backward = backward and not compiled(module)
            pre_hook = self._pre_hook(fqn, chunk_of.get(id(module), 0))
            handles.append(module.register_forward_pre_hook(self.guarded(fqn, pre_hook), with_kwargs=True))
            handles.append(module.register_forward_hook(self.guarded(fqn, self._forward_hook(fqn, backward))))
            # Before a parallel style's own output hook: the DTensor it is about to make local.
            handles.append(module.register_forward_hook(self.guarded(fqn, self._see_output_dtensors(fqn)), prepend=True))
            if backward:
                handles.append(module.register_full_backward_hook(self.guarded(fqn, self._backward_hook(fqn))))
        quiet_fsdp_view_warnings(model, handles)

    def guarded(self, fqn: str, hook: Callable[..., None]) -> Callable[..., None]:
        """`hook`, which only reads, made never to raise into the training: its error is a finding on `fqn`."""
        record_error = self._tracer.record_error

        def guarded(*args, **kwargs) -> None:
            try:
                hook(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - the run must go on; the error is recorded
                record_error(error, fqn)
        return guarded

    def _root_call_counter(self, chunk: int) -> Callable[[nn.Module, tuple], None]:
        tracer = self._tracer

        def count(module: nn.Module, args: tuple) -> None:
            if tracer.recording() and not any(t.is_meta for t in tensors_of(args)):
                tracer.state.root_calls[chunk] += 1
        return count

    def _pre_hook(self, fqn: str, chunk: int = 0) -> Callable[[nn.Module, tuple, dict], None]:
        tracer = self._tracer

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not tracer.recording():
                return
            state = tracer.state
            inputs = tensors_of(args)
            if any(t.is_meta for t in inputs) or (kwargs and any(t.is_meta for t in tensors_of(kwargs))):
                state.pending_forward[fqn].append(None)  # shape inference (pipelining): not a micro-batch
                return
            local, call = state.next_forward_call(fqn, chunk)
            micro_batch = tracer.global_micro_batch(local)
            state.pending_forward[fqn].append((micro_batch, call))
            for index, value in enumerate(inputs):
                tracer.record(tracer.key("forward", fqn, f"input.{index}", micro_batch, call), value)
            for name, value in kwargs.items():
                if isinstance(value, torch.Tensor):
                    tracer.record(tracer.key("forward", fqn, f"input.{name}", micro_batch, call), value)
        return hook

    def _see_output_dtensors(self, fqn: str) -> Callable[[nn.Module, tuple, object], None]:
        tracer = self._tracer

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if tracer.recording():
                seen = [value if isinstance(value, DTensor) else None for value in tensors_of(output)]
                tracer.state.converted_outputs[fqn] = seen if any(v is not None for v in seen) else []
        return hook

    def _forward_hook(self, fqn: str, backward_hooked: bool) -> Callable[[nn.Module, tuple, object], None]:
        tracer = self._tracer

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            state = tracer.state
            if state is None:
                return
            if not tracer.recording():  # inside a backward: a checkpoint's recomputation, recorded once already
                if state.no_grad_calls.get(fqn):
                    outputs = tensors_of(output)
                    if any(value.requires_grad for value in outputs) and (entry := state.recomputed_call(fqn)) is not None:
                        self._expect_backward(fqn, backward_hooked, output, outputs, entry)  # its backward comes now
                return
            if not state.pending_forward[fqn]:
                return
            entry = state.pending_forward[fqn].pop()
            if entry is None:
                return
            micro_batch, call = entry
            outputs = tensors_of(output)
            for index, value in enumerate(outputs):
                tracer.record(tracer.key("forward", fqn, f"output.{index}", micro_batch, call), value)
            if not torch.is_grad_enabled() and outputs and not any(value.requires_grad for value in outputs):
                state.no_grad_calls[fqn].append(entry)  # a reentrant checkpoint's first pass, or no backward at all
            else:
                self._expect_backward(fqn, backward_hooked, output, outputs, entry)
            state.converted_outputs.pop(fqn, None)
        return hook

    def _expect_backward(self, fqn: str, backward_hooked: bool, output: object, outputs: list[torch.Tensor],
                         entry: tuple[int, int]) -> None:
        """Which hook will see this call's gradients: its backward hook, tensor hooks on its outputs, or none."""
        tracer = self._tracer
        needs_grad = any(value.requires_grad for value in outputs)  # else no backward will come for this call
        if needs_grad and backward_hooked and hookable_output(output):
            tracer.state.pending_backward[fqn].append(entry)
        elif callable(output) and not outputs:
            tracer.blind_spots[fqn] = (f"its forward returns a function ({type(output).__name__}) that runs after the "
                                       "module returns: that computation is not recorded and shows as its parent's glue")
        elif needs_grad:
            if backward_hooked:
                tracer.blind_spots[fqn] = (f"its forward returns {type(output).__name__}, so backward hooks cannot fire: "
                                           "its grad_output is recorded through tensor hooks, its grad_input is not")
            self._record_grad_outputs_by_tensor_hooks(fqn, outputs, *entry)

    def _record_grad_outputs_by_tensor_hooks(self, fqn: str, outputs: list[torch.Tensor], micro_batch: int, call: int) -> None:
        """grad_output of a module without a backward hook: a hook on each output tensor (in-place changes
        of the output after it, like a fused cross entropy's, do not disturb it)."""
        tracer = self._tracer

        def recorder(index: int) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor | None) -> None:
                # (None: no gradient flowed into this output, as a backward hook's grad_output says by a None too)
                if tracer.state is not None and grad is not None:
                    tracer.record(tracer.key("backward", fqn, f"grad_output.{index}", micro_batch, call), grad)
            return hook
        for index, value in enumerate(outputs):
            if value.requires_grad:
                value.register_hook(self.guarded(fqn, recorder(index)))

    def _backward_hook(self, fqn: str) -> Callable[[nn.Module, tuple, tuple], None]:
        tracer, rewriter = self._tracer, self._rewriter

        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            state = tracer.state
            if state is None or (entry := state.next_backward_call(fqn, pop=True)) is None:
                return
            micro_batch, call = entry
            if rewriter is None or not rewriter.records_grad_outputs(fqn):  # else recorded before the rewrite
                for index, value in enumerate(grad_output):
                    if isinstance(value, torch.Tensor):
                        tracer.record(tracer.key("backward", fqn, f"grad_output.{index}", micro_batch, call), value)
            for index, value in enumerate(grad_input):
                if isinstance(value, torch.Tensor):
                    tracer.record(tracer.key("backward", fqn, f"grad_input.{index}", micro_batch, call), value)
        return hook
