"""cli/settings_flags.py: the judging commands' flags are generated from `CompareSettings`' fields: one flag
per field, its help the field's docstring, its default the field's own."""

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from ttrace_core.cli.main import _build_parser
from ttrace_core.cli.settings_flags import add_flags, byte_size, field_docs, help_of, settings_from_flags
from ttrace_core.compare.settings import CompareSettings

JUDGING = {"compare": ["REF", "CAND"], "localize": ["REF", "CAND"], "report": ["REF", "CAND"], "check": ["CONFIG"]}
"""Every command that judges tensors, with its positionals."""
FIELDS = dataclasses.fields(CompareSettings)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = _build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


def test_the_commands_that_judge_are_the_ones_with_settings_flags():
    names = {spec.name for spec in FIELDS}
    with_flags = {name for name, command in _commands().items() if any(a.dest in names for a in command._actions)}
    assert with_flags == set(JUDGING)


@pytest.mark.parametrize("command", sorted(JUDGING))
def test_each_field_has_exactly_one_flag_with_its_docstring_and_its_default(command):
    parser = _commands()[command]
    docs = field_docs(CompareSettings)
    for spec in FIELDS:
        (action,) = [a for a in parser._actions if a.dest == spec.name]
        assert action.option_strings == ["--" + spec.name.replace("_", "-")]
        assert action.help.startswith(help_of(docs[spec.name])) and len(docs[spec.name]) > 20
        assert action.default == spec.default
        if spec.default not in (None, False):
            assert _expanded_help(parser, action).endswith(f"(default: {spec.default})")
    assert settings_from_flags(parser.parse_args(JUDGING[command])) == CompareSettings()


@pytest.mark.parametrize("command", sorted(JUDGING))
def test_settings_come_back_from_their_command_line(command):
    """A replay job and a report get the comparison's settings back from its command line (cli_args)."""
    settings = CompareSettings(tolerance="theorem", alpha=2.5, theorem_k=3.0, theorem_c=1.01, exact_inputs_k=0.0,
                               ignore_dtype=True, partial=True, max_memory=64 * 2**20)
    args = _commands()[command].parse_args([*JUDGING[command], *settings.cli_args()])
    assert settings_from_flags(args) == settings
    assert CompareSettings().cli_args() == []


def test_the_tolerance_choices_are_the_fields_literal():
    (action,) = [a for a in _commands()["compare"]._actions if a.dest == "tolerance"]
    assert tuple(action.choices) == ("auto", "perturbation", "theorem", "dtype")


@dataclass(kw_only=True, slots=True)
class Example:
    mode: Literal["fast", "exact"] = "exact"
    """How to go; 50% faster when fast (compare/example.py)."""
    scale: float = 2.5
    """How much."""
    quiet: bool = False
    """Say nothing."""
    budget: int | None = field(default=None, metadata={"unit": "bytes"})
    """At most this many bytes."""
    count: int | None = 3
    """How many."""


def test_any_dataclass_gets_one_flag_per_field_from_its_definition():
    """Nothing in the generator names a field: a new field, a changed default or docstring is a new flag."""
    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    by_dest = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert {dest: a.option_strings for dest, a in by_dest.items()} == {
        "mode": ["--mode"], "scale": ["--scale"], "quiet": ["--quiet"], "budget": ["--budget"], "count": ["--count"]}
    assert _expanded_help(parser, by_dest["mode"]) == "how to go; 50% faster when fast (default: exact)"
    assert tuple(by_dest["mode"].choices) == ("fast", "exact")
    assert _expanded_help(parser, by_dest["scale"]) == "how much (default: 2.5)"
    assert by_dest["budget"].metavar == "SIZE" and by_dest["budget"].help == "at most this many bytes"
    assert settings_from_flags(parser.parse_args([]), Example) == Example()
    assert settings_from_flags(parser.parse_args(["--mode", "fast", "--scale", "1", "--quiet", "--budget", "2M",
                                                  "--count", "7"]), Example) == \
        Example(mode="fast", scale=1.0, quiet=True, budget=2 * 2**20, count=7)


def test_a_field_without_a_docstring_has_no_flag():
    @dataclass
    class Undocumented:
        scale: float = 1.0

    with pytest.raises(AssertionError, match="no docstring"):
        add_flags(argparse.ArgumentParser(), Undocumented)


@pytest.mark.parametrize("text, expected", [("512M", 512 * 2**20), ("4G", 4 * 2**30), ("1.5GiB", int(1.5 * 2**30)),
                                            ("1000", 1000), ("2kb", 2048)],
                         ids=["mebibytes", "gibibytes", "gib-suffix", "plain", "lower-case"])
def test_byte_size(text, expected):
    assert byte_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "0", "-1M", "inf"], ids=["word", "zero", "negative", "infinite"])
def test_byte_size_refuses_what_is_no_size(text):
    with pytest.raises(argparse.ArgumentTypeError, match="write it like 512M"):
        byte_size(text)
