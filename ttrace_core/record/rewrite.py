"""Input rewriting for stage 4 (localize): run the candidate with every traced module fed the reference's values.

Input: a `Tracer` recording a candidate re-run, and the reference run directory. Output: the same
trace the tracer writes, except that each traced module *computes* from the reference's inputs
(forward) and the reference's output gradients (backward), resharded into this rank's layout by
`canonicalize.shard`, the inverse of the canonical mapping. What the trace *records* at a module
boundary is still the candidate's own value, taken before the rewrite: so a module whose output
fails was wrong on correct inputs (it introduces the error), and an input that fails although
every module feeding it passed was broken by the code between modules (the parent's glue).

Only floating tensors that require grad are rewritten: the dataflow being trained. Token ids,
masks, rotary tables and detached observers (fp8 scales) keep the candidate's values. A rewrite
returns the reference's values bitwise in forward and passes the gradient to the candidate's
tensor in backward (`_Substitute`), so the autograd graph stays connected and every upstream
module still runs its backward.

Switched on explicitly: `ttrace localize` relaunches the candidate in a rewrite session
(session.py), whose `attach` hands an `InputRewriter` to the Tracer. It plugs in through the Tracer's public seam (traced_modules, current_forward_call,
coming_backward_call, layout_of, record); no environment variable turns it on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ttrace_core.canonicalize.shards import shard
from ttrace_core.canonicalize.logical_value import logical_value
from ttrace_core.format.naming import in_subtree, tensor_id
from ttrace_core.format.schema import TensorKey
from ttrace_core.format.reader import RunReader
from ttrace_core.canonicalize.token_rows import expert_fqn

if TYPE_CHECKING:
    from ttrace_core.record.tracer import Tracer

class _Substitute(torch.autograd.Function):
    """Forward: the reference's values, bitwise (adding a detached difference rounds in bf16).
    Backward: the gradient goes to the candidate's tensor unchanged."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return target.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class InputRewriter:
    """Forward pre-hooks and backward pre-hooks that feed traced modules the reference's values."""

    def __init__(self, reference_dir: str | os.PathLike, module: str | None = None,
                 out_dir: str | os.PathLike | None = None) -> None:
        """`out_dir`: the replay's run directory, where `close` lists the unfed inputs (UNFED_FILE)."""
        self.reference_dir = str(reference_dir)
        self.reference = RunReader(reference_dir)
        self.module = module or None
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.num_rewritten = 0
        self.unfed: set[str] = set()
        """Trained inputs ("forward/M/input.0") and output gradients ("backward/M/grad_output.0") that kept the
        candidate's values because the reference holds none: a reference of another implementation has no
        counterpart for some (docs/porting.md). Localize does not judge such a module on its own."""
        self.tracer: Tracer | None = None

    def describe(self) -> dict:
        return {"rewrite_from": self.reference_dir, "rewrite_module": self.module}

    def attach(self, tracer: Tracer, model: nn.Module, handles: list) -> None:
        self.tracer = tracer
        for fqn, submodule, backward in tracer.traced_modules(model):
            if not in_subtree(fqn, self.module):
                continue
            # Registered after the tracer's own pre-hook: the tracer records the candidate's input first.
            handles.append(submodule.register_forward_pre_hook(self._forward_pre_hook(fqn), with_kwargs=True))
            if backward:
                handles.append(submodule.register_full_backward_pre_hook(self._backward_pre_hook(fqn)))

    def records_grad_outputs(self, fqn: str) -> bool:
        """The rewriter records (and then replaces) grad_output at these modules, not the tracer."""
        return in_subtree(fqn, self.module)

    def _reference_local(self, key: TensorKey, like: torch.Tensor, scale: float) -> torch.Tensor | None:
        rows = self.tracer.routed.rows_for(key.fqn, key.micro_batch, key.call)
        if rows is not None and like.dim() and like.shape[0] == rows.num_rows and not isinstance(like, DTensor):
            return self._reference_rows(key, like, scale, rows)
        return self._reference_block(key, like, scale)

    def _reference_rows(self, key: TensorKey, like: torch.Tensor, scale: float, rows) -> torch.Tensor | None:
        """A routed module's rows (token_rows.py): each source micro-batch's reference tensor, in token order,
        put back where this call holds those tokens; rows of padding keep the candidate's values. None
        when any micro-batch's reference holds other tokens (routing differs): the candidate's value stays."""
        local = like.detach().clone()
        for micro_batch, expert, index in rows.pieces():
            piece_key = TensorKey(step=key.step, micro_batch=micro_batch, phase=key.phase,
                                  fqn=expert_fqn(key.fqn, expert), slot=key.slot, call=key.call)
            piece = self._reference_block(piece_key, like.detach().index_select(0, index), scale)
            if piece is None:
                return None
            local[index] = piece
        return local

    def _reference_block(self, key: TensorKey, like: torch.Tensor, scale: float) -> torch.Tensor | None:
        if key not in self.reference.index:
            return None
        layout = self.tracer.layout_of(key, like)
        full = logical_value(self.reference, key) * scale
        if tuple(full.shape) != tuple(layout.global_shape):
            return None  # a different logical shape: leave the candidate's value
        local = shard(full, layout).to(like.dtype)
        if isinstance(like, DTensor):
            return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                      shape=like.shape, stride=like.stride())
        return local

    def _rewritten(self, key: TensorKey, value: object, scale: float = 1.0) -> object:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not value.requires_grad:
            return value
        target = self._reference_local(key, value, scale)
        if target is None:
            self.unfed.add(tensor_id(key.with_call(0)))
            return value
        self.num_rewritten += 1
        return _Substitute.apply(value, target)

    def _forward_pre_hook(self, fqn: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            call = self.tracer.current_forward_call(fqn)
            if call is None:
                return None
            micro_batch, index_of_call = call

            def key(slot: str) -> TensorKey:
                return self.tracer.key("forward", fqn, slot, micro_batch, index_of_call)

            leaves, spec = tree_flatten(args)
            index = 0
            for position, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    leaves[position] = self._rewritten(key(f"input.{index}"), leaf)
                    index += 1
            new_kwargs = {name: self._rewritten(key(f"input.{name}"), value) for name, value in kwargs.items()}
            return tree_unflatten(leaves, spec), new_kwargs
        return hook

    def _backward_pre_hook(self, fqn: str):
        def hook(module: nn.Module, grad_output: tuple):
            tracer = self.tracer
            call = tracer.coming_backward_call(fqn)
            if call is None:
                return None
            replaced = []
            for index, value in enumerate(grad_output):
                if not isinstance(value, torch.Tensor):
                    replaced.append(value)
                    continue
                key = tracer.key("backward", fqn, f"grad_output.{index}", *call)
                tracer.record(key, value)
                target = self._reference_local(key, value, tracer.config.loss_scale)
                self.num_rewritten += target is not None
                if target is None:
                    self.unfed.add(tensor_id(key.with_call(0)))
                replaced.append(value if target is None else target)
            return tuple(replaced)
        return hook

    def close(self) -> None:
        self.reference.close()
        if self.out_dir is not None and self.unfed and self.tracer is not None:
            path = self.out_dir / UNFED_FILE.format(rank=self.tracer.rank)
            path.write_text(json.dumps(sorted(self.unfed)))


UNFED_FILE = "unfed_inputs.rank_{rank:05d}.json"
"""Beside a replay's step files: the tensor ids one rank's rewriter could not feed (InputRewriter.unfed)."""


def read_unfed(replay_dir: str | os.PathLike) -> set[str]:
    """Every rank's unfed inputs of a replay (none when the reference fed them all)."""
    found: set[str] = set()
    for path in sorted(Path(replay_dir).glob(UNFED_FILE.replace("{rank:05d}", "*"))):
        try:
            names = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found |= {name for name in names if isinstance(name, str)} if isinstance(names, list) else set()
    return found


def rewriter_from_config(rewrite: dict | None, out_dir: str | os.PathLike | None = None) -> InputRewriter | None:
    """The rewriter a replay's config asks for ({"reference": dir, "module": fqn or None}), or None;
    `out_dir`: the replay's run directory."""
    return None if not rewrite else InputRewriter(rewrite["reference"], rewrite.get("module"), out_dir)
