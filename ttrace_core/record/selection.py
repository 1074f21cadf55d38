"""Part of stage 1 (record): which modules a Tracer traces, and under which name.

Input: the model on one rank and its TracerConfig (include/exclude globs, exclude_activations,
forward_only, renames). Output: the traced modules with their global fqns and whether their backward is
hooked (module_hooks.py attaches to them), and the modules left out with why (the trace's blind spots,
written with every step file). Plain Python over module names; no hooks are touched here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator

from torch import nn

from ttrace_core.format.naming import global_fqn
from ttrace_core.format.schema import WRAPPER_COMPONENTS, strip_wrappers
from ttrace_core.format.tracer_config import TracerConfig


def _is_wrapper(module: nn.Module) -> bool:
    """A module that only wraps another (its child is traced under the wrapper's name instead). Told by
    the child's name, not the class: fully_shard swaps a wrapper's class for a subclass of its own."""
    return any(name in WRAPPER_COMPONENTS for name, _ in module.named_children())


def _proper_ancestors(fqn: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]; the root ("") is left out: excluding it leaves its children traced."""
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def global_name(config: TracerConfig, local_fqn: str) -> str:
    """The reference's name of this rank's module or parameter: wrapper components dropped
    (activation checkpointing, torch.compile), then the config's renames applied."""
    return global_fqn(strip_wrappers(local_fqn), config.rename)


def name_in_chunk(config: TracerConfig, local_fqn: str) -> str:
    """The name globs match: for a model given as chunks (config.model_chunks), the name within its
    chunk ("1.decoder.layers.0" -> "decoder.layers.0", the chunk's root "1" -> ""), so that one glob
    selects the same modules in every chunk; otherwise the name itself."""
    if not config.model_chunks:
        return local_fqn
    head, _, rest = local_fqn.partition(".")
    return rest if head.isdigit() else local_fqn


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def is_selected(config: TracerConfig, local_fqn: str) -> bool:
    """Whether the configuration's include and exclude globs select this (local, wrapper-free) name."""
    name = name_in_chunk(config, local_fqn)
    return _matches(name, config.include) and not _matches(name, config.exclude)


def traced_modules(config: TracerConfig, model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """(global fqn, module, whether its backward is hooked) of every module whose activations are
    recorded. A wrapper inside the model (a checkpoint wrapper) is skipped and the module it wraps
    traced under its name; a wrapper at the root (torch.compile's) is traced itself, outside the
    compiled code, and the module it wraps skipped."""
    wrapped_root = {id(child) for name, child in model.named_children() if name in WRAPPER_COMPONENTS}
    for local_fqn, module in model.named_modules():
        name = strip_wrappers(local_fqn)
        if (local_fqn and _is_wrapper(module)) or id(module) in wrapped_root or not is_selected(config, name) or \
                _matches(name_in_chunk(config, name), config.exclude_activations):
            continue
        backward = not _matches(name_in_chunk(config, name), config.forward_only)
        yield global_name(config, local_fqn), module, backward


def untraced_modules(config: TracerConfig, model: nn.Module) -> dict[str, str]:
    """Global fqn -> why the trace cannot see into it, for every module the configuration leaves
    out: the outermost of a subtree left out whole for the same reason stands for it; a module left out
    inside an ancestor that is left out alone (some of its descendants traced) is listed itself."""
    why_of: dict[str, str | None] = {}
    for local_fqn, module in model.named_modules():
        name = strip_wrappers(local_fqn)
        if local_fqn and _is_wrapper(module):
            continue
        if not _matches(name_in_chunk(config, name), config.include):
            why = "not traced (tracer configuration: not in include): its own inputs and outputs are not recorded"
        elif not is_selected(config, name):
            why = "not traced (tracer configuration: exclude): its own inputs and outputs are not recorded"
        elif _matches(name_in_chunk(config, name), config.exclude_activations):
            why = ("activations not traced (tracer configuration: exclude_activations): its parameters, "
                   "gradients and updates are recorded, its inputs and outputs are not")
        elif _matches(name_in_chunk(config, name), config.forward_only):
            why = ("backward not hooked (tracer configuration: forward_only): its grad_output is recorded "
                   "through tensor hooks on its outputs, its grad_input is not")
        else:
            why = None
        why_of.setdefault(global_name(config, local_fqn), why)
    # The modules whose whole subtree is left out for their own reason.
    whole = {fqn for fqn, why in why_of.items() if why is not None}
    for fqn, why in why_of.items():
        for ancestor in _proper_ancestors(fqn):
            if ancestor in whole and why_of[ancestor] != why:
                whole.discard(ancestor)
    return {fqn: why for fqn, why in why_of.items()
            if why is not None and not any(a in whole and why_of[a] == why for a in _proper_ancestors(fqn))}
