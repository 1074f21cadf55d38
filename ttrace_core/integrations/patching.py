"""Reversible monkeypatching, shared by the megatron CPU shim and the bug zoo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def patch_attribute(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set `owner.name = value`; the returned undo restores the original object, or deletes the
    override when `owner` only inherited the attribute."""
    original = vars(owner).get(name, _MISSING)
    setattr(owner, name, value)

    def undo() -> None:
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)

    return undo
