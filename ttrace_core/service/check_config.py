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

Placeholders in the command: `{layout}` (a layout's arguments; standing alone it becomes as many
arguments as the layout has), `{world_size}`, `{precision}`, `{name}`. A relative `output` is
relative to the config file, and so is the directory the commands run in (`cwd`, default the config's
own directory). `code` lists glob patterns (relative to `cwd`) of the files whose contents decide
whether a recording can be reused; by default the files of the git repository around `cwd`.
"""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ttrace_core.errors import TtraceError

PRECISIONS = ("fp32", "bf16", "fp8")
PLACEHOLDERS = ("{layout}", "{world_size}", "{precision}", "{name}")
_TOP_LEVEL = {"command", "precisions", "output", "cwd", "code", "reference", "candidate", "timeout", "estimate_samples",
              "localize"}
_LAYOUT_FIELDS = {"name", "layout", "world_size"}


class CheckConfigError(TtraceError):
    """A config `ttrace check` cannot run: exit code 2."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    name: str
    """A short name: the JUnit test case, the Markdown row, the run directory."""
    args: tuple[str, ...] = ()
    """What replaces {layout} in the command."""
    world_size: int = 1


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

    def command_for(self, layout: Layout, precision: str) -> list[str]:
        values = {"{world_size}": str(layout.world_size), "{precision}": precision, "{name}": layout.name,
                  "{layout}": shlex.join(layout.args)}
        command = []
        for part in self.command:
            if part == "{layout}":
                command += list(layout.args)
                continue
            for placeholder, value in values.items():
                part = part.replace(placeholder, value)
            command.append(part)
        return command


def _fail(path: Path, what: str) -> CheckConfigError:
    return CheckConfigError(f"{path}: {what}")


def _layout(path: Path, data: object, where: str, default_name: str | None = None) -> Layout:
    if not isinstance(data, dict):
        raise _fail(path, f"{where} must be a table (name, layout, world_size)")
    unknown = set(data) - _LAYOUT_FIELDS
    if unknown:
        raise _fail(path, f"{where}: unknown key {sorted(unknown)[0]!r}; a layout has name, layout and world_size")
    name, args, world_size = data.get("name", default_name), data.get("layout", ""), data.get("world_size", 1)
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise _fail(path, f"{where}: name must be a non-empty string without '/' (it names a directory)")
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise _fail(path, f"{where} {name!r}: layout must be a string or a list of strings")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise _fail(path, f"{where} {name!r}: world_size must be a positive integer, not {world_size!r}")
    return Layout(name=name, args=tuple(args), world_size=world_size)


def _strings(path: Path, data: dict, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = data.get(key, list(default))
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(path, f"{key} must be a string or a list of strings")
    return tuple(value)


def _number(path: Path, data: dict, key: str, default: float, kind: type) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)) \
            or value <= 0:
        raise _fail(path, f"{key} must be a positive {'integer' if kind is int else 'number'}, not {value!r}")
    return value


def read_check_config(path: str | Path) -> CheckConfig:
    """The config at `path`; CheckConfigError with one line naming the file and the key otherwise."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as error:
        raise CheckConfigError(f"{path}: cannot read the config ({error.strerror or error})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise _fail(path, f"not valid TOML ({error})") from None
    unknown = set(data) - _TOP_LEVEL
    if unknown:
        raise _fail(path, f"unknown key {sorted(unknown)[0]!r}; known: {', '.join(sorted(_TOP_LEVEL))}")
    command = data.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if not command or not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        raise _fail(path, "command must name the command to record, e.g. "
                          "command = \"torchrun --standalone --nproc-per-node {world_size} train.py {layout}\"")
    candidates = data.get("candidate", [])
    if not isinstance(candidates, list) or not candidates:
        raise _fail(path, "no candidate layout; add at least one [[candidate]] table with name and layout")
    layouts = tuple(_layout(path, c, f"candidate {i + 1}") for i, c in enumerate(candidates))
    reference = _layout(path, data.get("reference", {}), "[reference]", default_name="reference")
    names = [reference.name, *(c.name for c in layouts)]
    if len(set(names)) != len(names):
        raise _fail(path, f"layout names must differ; {sorted(n for n in names if names.count(n) > 1)[0]!r} repeats")
    precisions = _strings(path, data, "precisions", ("fp32",))
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise _fail(path, f"precisions must be some of {', '.join(PRECISIONS)}, not {list(precisions)}")
    for key in ("output", "cwd"):
        if not isinstance(data.get(key, "."), str):
            raise _fail(path, f"{key} must be a path as a string, not {data[key]!r}")
    if not isinstance(data.get("localize", True), bool):
        raise _fail(path, f"localize must be true or false, not {data['localize']!r}")
    base = path.resolve().parent
    return CheckConfig(
        path=path, command=tuple(command), reference=reference, candidates=layouts, precisions=precisions,
        output=(base / data.get("output", "ttrace-check")).resolve(), cwd=(base / data.get("cwd", ".")).resolve(),
        code=_strings(path, data, "code", ()), timeout_s=float(_number(path, data, "timeout", 1800.0, float)),
        estimate_samples=int(_number(path, data, "estimate_samples", 4, int)), localize=bool(data.get("localize", True)))
