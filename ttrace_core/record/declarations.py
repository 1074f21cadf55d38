"""Layouts declared for plain (non-DTensor) tensors: `Tracer.declare`, `Tracer.declare_flat_range` and
`Tracer.declare_held`.

A declaration says which placements, on which mesh, the tensors at matching (fqn glob, slot glob)
hold; later declarations win. A placement may also be a rule: a function of the local shape that
returns the placement, or None when no layout is known for that shape (a framework adapter's
"S(0) for a 3-D hidden state, unknown otherwise"), or raises a LayoutError saying why; the tensor is
then not recorded and the tracer keeps a finding instead (UnknownLayoutError). The layout of a (module, slot, local shape) is resolved once and kept:
a Megatron model has hundreds of declarations, and globbing them all on every recorded tensor cost
more than recording it. Even once per (module, slot, shape) that was 540 globs each, the largest part of a
first recorded step's layout resolution (0.16 s of 0.29 s of stats-only recording, profiled): an fqn
glob without a wildcard (an adapter declares exact module names) is looked up by name instead.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ttrace_core.errors import LayoutError, TtraceError

from ttrace_core.integrations.dtensor import mesh_description, placement_str
from ttrace_core.canonicalize.placements import global_shape_from_local, local_shape as shape_held
from ttrace_core.format.schema import Layout


PlacementRule = Callable[[tuple[int, ...]], "str | None"]
"""Local shape -> placement string, or None: no layout is known for a tensor of that shape."""


class UnknownLayoutError(TtraceError):
    """A declared rule has no layout for this tensor, or the declared placements do not fit it: it must
    not be recorded under a wrong one. The message names the tensor first (it is the tracer's finding)."""


@dataclass(slots=True)
class Declaration:
    fqn_glob: str
    slot_glob: str
    placements: tuple[str | PlacementRule, ...]
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    mesh_axis_names: tuple[str, ...]


@dataclass(slots=True)
class Declarations:
    declared: list[Declaration] = field(default_factory=list)
    flat_ranges: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    """(fqn, slot) -> [start, end) of the flattened local block this rank's values are."""
    held: dict[str, Layout] = field(default_factory=dict)
    """Parameter fqn -> the layout of its value and gradient, which this rank holds already cut to it (FSDP1)."""
    _resolved: dict[tuple[str, str, tuple[int, ...]], Layout | None] = field(default_factory=dict)
    _by_exact_fqn: dict[str, list[int]] = field(default_factory=dict)
    """fqn -> indices in `declared` of the declarations whose fqn glob is that very name (no wildcard)."""
    _wildcard_fqn: list[int] = field(default_factory=list)
    """Indices in `declared` of the declarations whose fqn glob has a wildcard: they are globbed."""
    _fitted: dict[tuple, tuple[Layout | None, str]] = field(default_factory=dict)
    """(local shape, mesh shape, coordinate, mesh axis names, placements) -> (layout, "") or (None, why none fits).
    Shapes and strings only, so it never goes stale: the layers of a model declare the same placements on
    tensors of the same shapes, and a first recorded step resolves every (module, slot, shape) once (485 of
    them, into 17 layouts, on the megatron-core testbed of recording_overhead.py)."""

    def declare(self, fqn_glob: str, slot_glob: str, placements: Sequence, mesh) -> None:
        mesh_shape, coordinate, names = mesh_description(mesh)
        specs = tuple(p if callable(p) else placement_str(p) for p in placements)
        if len(specs) != len(mesh_shape):
            raise ValueError(f"declare({fqn_glob!r}, {slot_glob!r}): {len(specs)} placements for a {len(mesh_shape)}-D mesh")
        index = len(self.declared)
        self.declared.append(Declaration(fqn_glob, slot_glob, specs, mesh_shape, coordinate, names))
        if _has_wildcard(fqn_glob):
            self._wildcard_fqn.append(index)
        else:
            self._by_exact_fqn.setdefault(fqn_glob, []).append(index)
        self._resolved.clear()

    def declare_flat_range(self, fqn: str, slot: str, start: int, end: int) -> None:
        if not 0 <= start <= end:
            raise ValueError(f"declare_flat_range({fqn!r}, {slot!r}): need 0 <= start <= end, got {start}, {end}")
        self.flat_ranges[(fqn, slot)] = (start, end)

    def layout(self, fqn: str, slot: str, local_shape: tuple[int, ...]) -> Layout | None:
        """The declared layout of a local tensor of this shape at (fqn, slot), or None."""
        cache_key = (fqn, slot, local_shape)
        try:
            return self._resolved[cache_key]
        except KeyError:
            found = self._resolved[cache_key] = self._match(fqn, slot, local_shape)
            return found

    def _match(self, fqn: str, slot: str, local_shape: tuple[int, ...]) -> Layout | None:
        """The latest declaration matching (fqn, slot) decides, as if all were globbed newest first."""
        candidates = sorted((*self._by_exact_fqn.get(fqn, ()), *self._wildcard_fqn), reverse=True)
        for d in (self.declared[index] for index in candidates):
            if fnmatch.fnmatchcase(fqn, d.fqn_glob) and fnmatch.fnmatchcase(slot, d.slot_glob):
                placements = tuple(_applied(p, fqn, slot, local_shape) for p in d.placements)
                return _fitted(fqn, slot, local_shape, d, placements, self._fitted)
        return None


def _has_wildcard(glob: str) -> bool:
    """Whether fnmatch could match `glob` to any name but itself."""
    return any(char in glob for char in "*?[")


def _fitted(fqn: str, slot: str, local_shape: tuple[int, ...], declared: Declaration, placements: tuple[str, ...],
            fitted: dict[tuple, tuple[Layout | None, str]]) -> Layout:
    """The declared layout of a local tensor, checked to give back its local shape: a placement on a dim
    the tensor lacks, or a blocked dim its blocks do not divide, is an UnknownLayoutError naming both.
    `fitted`: the layouts found so far by local shape, mesh and placements, whichever module declared them."""
    geometry = (local_shape, declared.mesh_shape, declared.coordinate, declared.mesh_axis_names, placements)
    if (found := fitted.get(geometry)) is None:
        found = fitted[geometry] = _layout_holding(*geometry)
    layout, reason = found
    if reason:
        raise UnknownLayoutError(
            f"{fqn} {slot}: declared placements {list(placements)} on mesh {list(declared.mesh_shape)} do not fit its "
            f"local shape {list(local_shape)} ({reason}), so it is not recorded; declare the layout it has with "
            "session.declare(fqn, slot, placements, mesh)")
    return layout


def _layout_holding(local_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                    mesh_axis_names: tuple[str, ...], placements: tuple[str, ...]) -> tuple[Layout | None, str]:
    """(the layout whose block on this rank has `local_shape`, "") or (None, why there is none): a pure
    function of shapes and strings (Declarations keeps its results across modules)."""
    try:
        shape = global_shape_from_local(local_shape, mesh_shape, placements)
        layout = Layout(global_shape=shape, mesh_shape=mesh_shape, coordinate=coordinate, placements=placements,
                        mesh_axis_names=mesh_axis_names)
        held = shape_held(layout)
    except (LayoutError, ValueError) as error:
        return None, str(error)
    return (layout, "") if held == local_shape else (None, f"they would give this rank a block of shape {list(held)}")


def _applied(placement: str | PlacementRule, fqn: str, slot: str, local_shape: tuple[int, ...]) -> str:
    if not callable(placement):
        return placement
    try:
        resolved = placement(local_shape)
    except LayoutError as error:  # a rule that knows why it has no layout says so (an adapter's unknown style)
        raise UnknownLayoutError(str(error)) from error
    if resolved is None:
        raise UnknownLayoutError(
            f"{fqn} {slot}: no layout is known for a {len(local_shape)}-D tensor of shape {list(local_shape)} at this "
            "module boundary, so it is not recorded; declare it with session.declare(fqn, slot, placements, mesh)")
    return resolved
