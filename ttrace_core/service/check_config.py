"""The configuration of `ttrace check`: one TOML file naming the command to record, the reference layout,
the candidate layouts, the precisions and where the results go.

    command = "torchrun --standalone --nproc-per-node {world_size} train.py --precision {precision} {layout}"
    precisions = ["fp32", "bf16"]
    output = "ttrace-check"

    [reference]
    layout = ""

    [[candidate]]
    name = "tp2"
    layout = "--tp 2"
    world_size = 2

Another implementation as the reference (docs/porting.md): `[reference]` takes a `command` of its own
and `map` names the correspondence map that relates its tensors to the candidates' (a shipped map's
name, or a .toml file relative to the config):

    command = "python -m ttrace_examples megatron-gpt {layout}"
    map = "hf-llama--megatron-gpt"

    [reference]
    command = "python -m ttrace_examples hf-llama"

Any layout table may set its own `command`; the others run the top-level one.

Placeholders in the command: `{layout}` (a layout's arguments; standing alone it becomes as many
arguments as the layout has), `{world_size}`, `{precision}`, `{name}`. A relative `output` is
relative to the config file, and so is the directory the commands run in (`cwd`, default the config's
own directory). `code` lists glob patterns (relative to `cwd`) of the files whose contents decide
whether a recording can be reused; by default the files of the git repository around `cwd`.

The file is decoded by msgspec into `CheckFile` (types, unknown keys and the checks in each
`__post_init__`), and a problem becomes one line naming the file, the key, what is wrong and what
it takes (`_problem`); `read_check_config` then resolves it into a `CheckConfig`.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, get_args

import msgspec

from ttrace_core.errors import MapError, TtraceError
from ttrace_core.format.records import error_at

Precision = Literal["fp32", "bf16", "fp8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
PLACEHOLDERS = ("{layout}", "{world_size}", "{precision}", "{name}")
NO_COMMAND = ("command must name the command to record, e.g. "
              'command = "torchrun --standalone --nproc-per-node {world_size} train.py {layout}"')
NO_CANDIDATE = "no candidate layout; add at least one [[candidate]] table with name and layout"


class CheckConfigError(TtraceError):
    """A config `ttrace check` cannot run: exit code 2."""


def _argv(command: str | list[str]) -> list[str]:
    """A command written as one string (split like a shell) or as a list of arguments."""
    return shlex.split(command) if isinstance(command, str) else list(command)


def _strings(value: str | list[str]) -> tuple[str, ...]:
    """A string or a list of strings as a tuple."""
    return (value,) if isinstance(value, str) else tuple(value)


class LayoutTable(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`[reference]` or one `[[candidate]]` table, as written."""

    name: str | None = None
    """A short name: the JUnit test case, the Markdown row, the run directory (the reference's: "reference")."""
    layout: str | list[str] = ""
    """What replaces {layout} in the command: one string split like a shell, or a list of arguments."""
    world_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    command: str | list[str] | None = None
    """This layout's own command (the same placeholders); by default the config's `command`."""

    def __post_init__(self) -> None:
        if self.command is not None and not _argv(self.command):
            raise ValueError("command is empty; give this layout's command or leave the key out")
        if self.name is not None and (not self.name or "/" in self.name or self.name.startswith(".")):
            raise ValueError(f"name {self.name!r}: give a non-empty name without '/' or a leading '.' (it names a directory)")


class CheckFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A `ttrace check` config file, as written (see the module docstring)."""

    command: str | list[str]
    candidate: list[LayoutTable]
    reference: LayoutTable = msgspec.field(default_factory=LayoutTable)
    precisions: Precision | list[Precision] = "fp32"
    output: str = "ttrace-check"
    cwd: str = "."
    code: str | list[str] = msgspec.field(default_factory=list)
    timeout: Annotated[float, msgspec.Meta(gt=0)] = 1800.0
    """Seconds per recording, estimate re-run and replay."""
    estimate_samples: Annotated[int, msgspec.Meta(gt=0)] = 4
    localize: bool = True
    map: str | None = None
    """The correspondence map from the reference's tensors to the candidates' (another implementation as the
    reference): a shipped map's name or a .toml file; by default none (the same code on one rank)."""

    def __post_init__(self) -> None:
        if not _argv(self.command):
            raise ValueError(NO_COMMAND)
        if not self.candidate:
            raise ValueError(NO_CANDIDATE)
        if not _strings(self.precisions):
            raise ValueError(f"precisions is empty; list at least one of {', '.join(PRECISIONS)}")
        for number, table in enumerate(self.candidate, start=1):
            if table.name is None:
                raise ValueError(f"[[candidate]] {number} has no name; give each layout a short name (it names a directory)")
        names = [self.reference.name or "reference", *(table.name for table in self.candidate)]
        if repeated := sorted(name for name in set(names) if names.count(name) > 1):
            raise ValueError(f"layout name {repeated[0]!r} repeats; give each layout its own name")


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    name: str
    """A short name: the JUnit test case, the Markdown row, the run directory."""
    args: tuple[str, ...] = ()
    """What replaces {layout} in the command."""
    world_size: int = 1
    command: tuple[str, ...] | None = None
    """Its own command; None: the config's."""


@dataclass(kw_only=True, slots=True)
class CheckConfig:
    path: Path
    """The TOML file it was read from."""
    command: tuple[str, ...]
    reference: Layout
    candidates: tuple[Layout, ...]
    precisions: tuple[str, ...] = ("fp32",)
    output: Path = Path("ttrace-check")
    cwd: Path = Path(".")
    code: tuple[str, ...] = ()
    """Glob patterns of the code a recording depends on; () = the git repository's files."""
    timeout_s: float = 1800.0
    """Per recording, estimate re-run and replay."""
    estimate_samples: int = 4
    localize: bool = True
    """Replay every failing layout to name its culprit module."""
    map: str | None = None
    """The correspondence map the reference is compared through: a shipped map's name or a resolved .toml path."""

    def command_for(self, layout: Layout, precision: str) -> list[str]:
        values = {"{world_size}": str(layout.world_size), "{precision}": precision, "{name}": layout.name,
                  "{layout}": shlex.join(layout.args)}
        command = []
        for part in layout.command or self.command:
            if part == "{layout}":
                command += list(layout.args)
                continue
            for placeholder, value in values.items():
                part = part.replace(placeholder, value)
            command.append(part)
        return command


def _layout(table: LayoutTable, default_name: str) -> Layout:
    args = shlex.split(table.layout) if isinstance(table.layout, str) else table.layout
    command = tuple(_argv(table.command)) if table.command is not None else None
    return Layout(name=table.name or default_name, args=tuple(args), world_size=table.world_size, command=command)


def _map(written: str | None, path: Path, base: Path) -> str | None:
    """The map's name or resolved path, checked now: a bad map is the config's one line, before anything runs."""
    if written is None:
        return None
    from ttrace_core.integrations.shipped_maps import find_map, shipped_map_names

    shipped = shipped_map_names()
    resolved = written if written in shipped else str((base / written).resolve())
    if written not in shipped and not Path(resolved).is_file():
        raise CheckConfigError(f"{path}: map {written!r} is neither a shipped map ({', '.join(shipped)}) nor a file "
                               f"({resolved}); docs/porting.md describes both")
    try:
        find_map(resolved)
    except MapError as error:
        raise CheckConfigError(f"{path}: map {written!r}: {error}") from None
    return resolved


# --- msgspec's validation errors, as one line a user can act on ------------------------------------

_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false", "array": "a list",
               "object": "a table", "str | array": "a string or a list of strings", "null": "nothing"}


def _steps(path: str) -> list[str | int]:
    """"$.candidate[0].world_size" (without the "$") as ["candidate", 0, "world_size"]."""
    return [int(index) if index else key for key, index in re.findall(r"\.(\w+)|\[(\d+)\]", path)]


def _value_at(data: object, steps: list[str | int]) -> object:
    for step in steps:
        data = data[step]  # msgspec found the value here, so every step exists
    return data


def _toml_text(value: object) -> str:
    """A value as the config writes it: true, "x", [1, 2]."""
    return json.dumps(value, default=str)


def _place(data: dict, steps: list[str | int]) -> str:
    """Where a path points, in the config's own words: "[[candidate]] 2 ('tp2'): world_size", "code item 2"."""
    words = []
    for position, step in enumerate(steps):
        if isinstance(step, int):
            table = _value_at(data, steps[:position + 1])
            if not isinstance(table, dict):
                words[-1] += f" item {step + 1}"
                continue
            name = table.get("name")
            words[-1] = f"[[{words[-1]}]] {step + 1}" + (f" ({name!r})" if isinstance(name, str) else "")
        elif position == 0 and step == "reference":
            words.append("[reference]")
        else:
            words.append(step)
    return ": ".join(words)


def _known_keys(steps: list[str | int]) -> tuple[str, ...]:
    table = LayoutTable if steps else CheckFile
    return table.__struct_fields__


def _problem(error: msgspec.ValidationError, data: dict) -> str:
    """One line for msgspec's error: where (the key, in the config's words), what is wrong, what it takes."""
    what, path = error_at(error)
    steps = _steps((path or "$")[1:])
    place = _place(data, steps)
    if unknown := re.fullmatch(r"Object contains unknown field `(\w+)`", what):
        key, known = unknown[1], _known_keys(steps)
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        table = f" in {place}" if place else ""
        return f"unknown key {key!r}{table}; {hint}known keys: {', '.join(known)}"
    if missing := re.fullmatch(r"Object missing required field `(\w+)`", what):
        return {"command": NO_COMMAND, "candidate": NO_CANDIDATE}.get(missing[1], f"{missing[1]} is missing")
    if expected := re.fullmatch(r"Expected `([^`]+)`(.*?)(?:, got `(\w+)`)?", what):
        kind = expected[1].removesuffix(" | null")  # an optional key's "nothing" is leaving it out
        wanted = _TYPE_WORDS.get(kind, kind) + expected[2]
        return f"{place} is {_toml_text(_value_at(data, steps))}; give {wanted}"
    if enum := re.fullmatch(r"Invalid enum value (.+)", what):
        return f"{place}: {enum[1]} is no precision; choose from {', '.join(PRECISIONS)}"
    return f"{place}: {what}" if place else what  # a __post_init__'s own sentence


def read_check_config(path: str | Path) -> CheckConfig:
    """The config at `path`; CheckConfigError with one line naming the file and the key otherwise."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as error:
        raise CheckConfigError(f"{path}: cannot read the config ({error.strerror or error})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise CheckConfigError(f"{path}: not valid TOML ({error})") from None
    try:
        written = msgspec.convert(data, CheckFile)
    except msgspec.ValidationError as error:
        raise CheckConfigError(f"{path}: {_problem(error, data)}") from None
    base = path.resolve().parent
    return CheckConfig(
        path=path, command=tuple(_argv(written.command)), map=_map(written.map, path, base), reference=_layout(written.reference, "reference"),
        candidates=tuple(_layout(table, "") for table in written.candidate), precisions=_strings(written.precisions),
        output=(base / written.output).resolve(), cwd=(base / written.cwd).resolve(), code=_strings(written.code),
        timeout_s=written.timeout, estimate_samples=written.estimate_samples, localize=written.localize)
