"""The flags of `CompareSettings`, generated from its fields: compare, localize, report and check judge alike.

One flag per field, named by `CompareSettings.flag` (which `CompareSettings.cli_args` writes back for a
job's command line): the help is the docstring under the field, the default is the field's own and is
shown, a Literal field offers its values as choices, a bool field is a switch, and a field whose
metadata gives the unit "bytes" takes sizes like 512M or 4G. Adding a field to `CompareSettings` adds
its flag to every command that judges; nothing here names a field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import re
import textwrap
import types
import typing

from ttrace_core.api import CompareSettings

_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(text: str) -> int:
    """"512M", "4G", "1.5GiB" or a plain number of bytes (argparse's type for a field in bytes)."""
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in _SIZE_UNITS else ""
    try:
        value = float(number[:len(number) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write it like 512M or 4G") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size; write it like 512M or 4G")
    return int(value)


def field_docs(config: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body, on one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(config))).body[0].body
    return {node.target.id: " ".join(following.value.value.split())
            for node, following in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)}


def help_of(doc: str) -> str:
    """A field's docstring as a flag's help, in the style of the others: no file pointer in parentheses
    (the reader of --help has no source), lower case first, no final period."""
    text = re.sub(r" \([\w/]+\.py\)", "", doc).rstrip(".")
    return (text[:1].lower() + text[1:] if text[1:2].islower() else text).replace("%", "%%")


def _argument(spec: dataclasses.Field, hint: object, doc: str) -> dict:
    """add_argument's keywords for one field, from its type, default and metadata."""
    help_text = help_of(doc)
    if hint is bool:
        assert spec.default is False, f"{spec.name}: a switch can only turn a False default on"
        return dict(action="store_true", help=help_text)
    if spec.default is not None:
        help_text += " (default: %(default)s)"
    options = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return dict(choices=options, default=spec.default, help=help_text)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `X | None`: a value of X, or unset
        (hint,) = [option for option in options if option is not type(None)]
    if spec.metadata.get("unit") == "bytes":
        return dict(type=byte_size, default=spec.default, metavar="SIZE", help=help_text)
    assert hint in (int, float, str), f"{spec.name}: no flag for a field of type {hint}"
    return dict(type=hint, default=spec.default, help=help_text)


def add_flags(parser: argparse.ArgumentParser, config: type = CompareSettings) -> None:
    """One flag per field of the dataclass `config`, named by `CompareSettings.flag` (see the module docstring)."""
    docs, hints = field_docs(config), typing.get_type_hints(config)
    for spec in dataclasses.fields(config):
        assert spec.name in docs, f"{config.__name__}.{spec.name} has no docstring, which its flag's help would be"
        parser.add_argument(CompareSettings.flag(spec.name), dest=spec.name, **_argument(spec, hints[spec.name], docs[spec.name]))


def settings_from_flags(args: argparse.Namespace, config: type = CompareSettings):
    """The `config` the flags of `add_flags` set."""
    return config(**{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(config)})
