"""Layouts declared for plain (non-DTensor) tensors: `Tracer.declare` and `Tracer.declare_flat_range`.

A declaration says which placements, on which mesh, the tensors at matching (fqn glob, slot glob)
hold; later declarations win. The layout of a (module, slot, local shape) is resolved once and kept:
a Megatron model has hundreds of declarations, and globbing them all on every recorded tensor cost
more than recording it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from ttrace_core.integrations.dtensor import mesh_description, placement_str
from ttrace_core.canonicalize.placements import global_shape_from_local
from ttrace_core.format.schema import Layout


@dataclass(slots=True)
class Declaration:
    fqn_glob: str
    slot_glob: str
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    mesh_axis_names: tuple[str, ...]


@dataclass(slots=True)
class Declarations:
    declared: list[Declaration] = field(default_factory=list)
    flat_ranges: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    """(fqn, slot) -> [start, end) of the flattened local block this rank's values are."""
    _resolved: dict[tuple[str, str, tuple[int, ...]], Layout | None] = field(default_factory=dict)

    def declare(self, fqn_glob: str, slot_glob: str, placements: Sequence, mesh) -> None:
        mesh_shape, coordinate, names = mesh_description(mesh)
        specs = tuple(placement_str(p) for p in placements)
        if len(specs) != len(mesh_shape):
            raise ValueError(f"declare({fqn_glob!r}, {slot_glob!r}): {len(specs)} placements for a {len(mesh_shape)}-D mesh")
        self.declared.append(Declaration(fqn_glob, slot_glob, specs, mesh_shape, coordinate, names))
        self._resolved.clear()

    def declare_flat_range(self, fqn: str, slot: str, start: int, end: int) -> None:
        if not 0 <= start <= end:
            raise ValueError(f"declare_flat_range({fqn!r}, {slot!r}): need 0 <= start <= end, got {start}, {end}")
        self.flat_ranges[(fqn, slot)] = (start, end)

    def layout(self, fqn: str, slot: str, local_shape: tuple[int, ...]) -> Layout | None:
        """The declared layout of a local tensor of this shape at (fqn, slot), or None."""
        cache_key = (fqn, slot, local_shape)
        if cache_key not in self._resolved:
            self._resolved[cache_key] = self._match(fqn, slot, local_shape)
        return self._resolved[cache_key]

    def _match(self, fqn: str, slot: str, local_shape: tuple[int, ...]) -> Layout | None:
        for d in reversed(self.declared):
            if fnmatch.fnmatchcase(fqn, d.fqn_glob) and fnmatch.fnmatchcase(slot, d.slot_glob):
                shape = global_shape_from_local(local_shape, d.mesh_shape, d.placements)
                return Layout(global_shape=shape, mesh_shape=d.mesh_shape, coordinate=d.coordinate,
                              placements=d.placements, mesh_axis_names=d.mesh_axis_names)
        return None
