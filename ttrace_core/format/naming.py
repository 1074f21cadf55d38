"""Naming conventions of traced tensors, written once: which layer a module is in, which module owns
a parameter, which modules a subtree holds, a slot's family, a tensor's module and kind, the mesh axes
that are data parallelism, the fp8 scale module, and the id the URL and the table use.
tests/core/format/test_naming.py checks that none of these rules is written again elsewhere.

A key names one tensor instance (format.schema.TensorKey): `phase` forward | backward | grad | param,
`fqn` the module (activations) or the parameter (grad, param), `slot` "<family>.<index or name>"
("output.0", "input.hidden_states", "grad_input.1") or "grad" / "value" for parameters.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable
from typing import Generic, TypeVar

from ttrace_core.format.schema import ROOT_NAME, TensorKey

T = TypeVar("T")

LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(?:\.|$)")
"""A transformer layer in a module path: "decoder.layers.3.mlp" is in layer 3 (also "blocks.3", "h.3")."""
REPEAT_INDEX = re.compile(r"\.\d+\.")
"""An index between two name components: what tells the copies of a repeated module apart (layer_family)."""
EMBEDDING_NAMES = ("emb", "wte", "wpe")
"""Substrings that mark an embedding (megatron's "embedding", nanoGPT's "wte" and "wpe"): below layer 0."""

KINDS = ("input", "output", "grad_output", "grad_input", "param_grad", "param", "loss", "step")
"""Tensor kinds in the order the heatmap shows them."""
_KIND_OF = {("forward", "input"): "input", ("forward", "output"): "output", ("backward", "grad_output"): "grad_output",
            ("backward", "grad_input"): "grad_input", ("grad", "grad"): "param_grad", ("param", "value"): "param",
            ("forward", "scalar"): "loss", ("step", "scalar"): "step"}

LOSS_FUNCTION = "(loss)"
"""The pseudo-module of the loss function, between the model's last module and the backward: per
micro-batch, phase "forward", slots "scalar.loss" (the value backward starts from) and
"scalar.num_tokens". Module names are Python identifiers or indices in practice, so the
parentheses keep it apart from every real module."""
GRADIENT_CLIPPING = "(gradient clipping)"
"""The pseudo-module of the optimizer's step scalars (phase "step"): "scalar.grad_norm",
"scalar.clip_coef", "scalar.loss_scale", "scalar.lr", "scalar.skipped_steps"."""
LEARNING_RATE_SLOT = "scalar.lr"
"""GRADIENT_CLIPPING's slot of the learning rate the step used (its optimizer's first parameter group)."""
PSEUDO_MODULES = {LOSS_FUNCTION: "the loss function", GRADIENT_CLIPPING: "the gradient norm / clipping"}
"""Pseudo-module name -> how a verdict names it."""


PARAMETER_PHASES = ("grad", "param")
"""The phases whose tensors are parameters (their reduced gradients, their values), named by the parameter."""

DATA_PARALLEL_AXES = ("dp", "fsdp", "ddp", "dp_shard", "dp_replicate", "data_parallel", "hsdp", "dp_shard_cp")
"""Mesh axis names (and manifest degrees) that are data parallelism: the micro-batches are spread over
them, and a gradient reduction over them is data parallelism's (torchtitan names its axes dp_shard and
dp_replicate, megatron and most scripts dp or fsdp)."""


FP8_SCALE_MODULE = "fp8_scale_inv"
"""The identity child through which the fp8 integration passes a linear's inverse scales so that the
tracer records them (integrations/fp8.py): "<linear>.fp8_scale_inv", slot 0 the input's scale, slot 1
the weight's. Only a quantized run has it; the reference has nothing to compare it with."""


def fp8_scale_linear(fqn: str) -> str | None:
    """The linear whose inverse scales module `fqn` records ("a.fc" for "a.fc.fp8_scale_inv"), None when
    `fqn` is no fp8 scale module."""
    linear, _, name = fqn.rpartition(".")
    return linear if name == FP8_SCALE_MODULE else None


def data_parallel_degree(degrees: dict[str, int]) -> int:
    """How many data-parallel replicas a run's degrees describe: the product over its data-parallel axes."""
    return math.prod(size for axis, size in degrees.items() if axis in DATA_PARALLEL_AXES)


def layer_of(fqn: str) -> int | None:
    """The layer index in a module or parameter path, None outside the layers."""
    match = LAYER_PATTERN.search(fqn)
    return int(match.group(1)) if match else None


def layer_module(fqn: str) -> str:
    """The layer a module sits in ("decoder.layers.3" for "decoder.layers.3.mlp.fc1"), or itself outside the layers."""
    match = LAYER_PATTERN.search(fqn)
    return fqn[:match.end(1)] if match else fqn


def layer_family(fqn: str) -> str:
    """The name a tensor shares with its copies in every layer (and every expert or other numbered
    child): each index between two name components replaced by "*", so "decoder.layers.*.mlp.fc1" for
    "decoder.layers.3.mlp.fc1". Wider than LAYER_PATTERN, which knows only the layer containers'
    names: the copies of any numbered container repeat one computation. An index that ends the name is
    kept ("decoder.layers.3" is a family of its own)."""
    return REPEAT_INDEX.sub(".*.", fqn)


def is_embedding(fqn: str) -> bool:
    """An embedding's module or parameter (EMBEDDING_NAMES), which sits below the first layer."""
    return any(name in fqn for name in EMBEDDING_NAMES)


def display_fqn(fqn: str) -> str:
    """A module's name as shown: the root module ("") as ROOT_NAME."""
    return fqn or ROOT_NAME


def owner_of(parameter_fqn: str) -> str:
    """The module a parameter belongs to: "layers.0.mlp.fc1" for "layers.0.mlp.fc1.weight"; the root is ""."""
    return parameter_fqn.rsplit(".", 1)[0] if "." in parameter_fqn else ""


def parameter_of(module: str, name: str) -> str:
    """Parameter `name` of `module` (the inverse of owner_of): "layers.0.mlp.fc1.bias" for ("layers.0.mlp.fc1",
    "bias"); the root module's ("") is `name` itself."""
    return f"{module}.{name}" if module else name


def in_subtree(fqn: str, root: str | None) -> bool:
    """fqn is root or nested inside it, by whole name components: "a" holds "a" and "a.b", never "ab".
    The root module ("") and None hold everything, a parameter sits in its module's subtree. The one
    rule of module nesting: `is_descendant` and `global_fqn` are written with it."""
    return not root or fqn == root or fqn.startswith(root + ".")


class SubtreeIndex(Generic[T]):
    """Items by module name, those of a subtree (`in_subtree`) found by bisection instead of a scan: in sorted
    order a root's descendants ("a.b", "a.c.d") lie between "a." and "a/" ("/" follows "."), the root itself just
    before them, with names such as "a-b" possibly between."""

    def __init__(self, items: Iterable[tuple[str, T]]) -> None:
        ordered = sorted(items, key=lambda item: item[0])
        self._names = [name for name, _ in ordered]
        self._items = [item for _, item in ordered]

    def __bool__(self) -> bool:
        return bool(self._items)

    def within(self, root: str | None) -> list[T]:
        """The items whose name is in `root`'s subtree, in name order (the root's own first)."""
        if not root:
            return self._items
        names, items = self._names, self._items
        own = items[bisect.bisect_left(names, root):bisect.bisect_right(names, root)]
        return own + items[bisect.bisect_left(names, root + "."):bisect.bisect_left(names, root + "/")]


def is_descendant(fqn: str, ancestor: str) -> bool:
    """fqn is nested inside `ancestor` and is not `ancestor` itself (in_subtree): the model root ("") is
    every other module's ancestor."""
    return fqn != ancestor and in_subtree(fqn, ancestor)


def global_fqn(fqn: str, rename: tuple[tuple[str, str], ...]) -> str:
    """Apply the first (local prefix, global prefix) pair whose subtree holds `fqn` (in_subtree):
    ("layers.1", "layers.3") renames "layers.1.attn", never "layers.10.attn". An empty global prefix
    drops the local one: ("1", "") renames "1.decoder" (chunk 1 of a model given as chunks) to
    "decoder". An empty local prefix renames only the root itself."""
    for local, global_ in rename:
        if fqn == local or (local and in_subtree(fqn, local)):
            rest = fqn[len(local) + 1:]
            return ".".join(part for part in (global_, rest) if part)
    return fqn


def slot_family(slot: str) -> str:
    """"output" for "output.0", "input" for "input.hidden_states", "grad" for "grad"."""
    return slot.split(".", 1)[0]


def module_of(key: TensorKey) -> str:
    """The module a tensor belongs to: its own fqn for activations, the owner for parameters."""
    return owner_of(key.fqn) if key.phase in PARAMETER_PHASES else key.fqn


def tensor_kind(key: TensorKey) -> str:
    family = slot_family(key.slot)
    return _KIND_OF.get((key.phase, family), family)


def tensor_id(key: TensorKey) -> str:
    """"phase/fqn/slot": a tensor across steps and micro-batches (the URL's `tensor`); a module's later
    calls within a micro-batch add "@call" ("forward/lm_head/output.0@1")."""
    return f"{key.phase}/{key.fqn}/{key.slot}" + (f"@{key.call}" if key.call else "")


def key_from_tensor_id(text: str, step: int, micro_batch: int) -> TensorKey:
    phase, rest = text.split("/", 1)
    fqn, slot = rest.rsplit("/", 1)
    slot, _, call = slot.partition("@")
    return TensorKey(step=step, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot, call=int(call or 0))
