"""Correspondence maps: two implementations of one architecture, related tensor by tensor, declared as data.

Part of stage 2 (canonicalize). Input: a map file (TOML, one per architecture pair; the shipped ones are in
ttrace_core/integrations/maps/) and the names of one run's logical tensors. Output: which of the
candidate's tensors each rule gives, from which of the reference's tensors, through which transform
(map_transforms.py). mapped_run.py applies a map to a recorded reference; the weight conversion
(`candidate_state` / `reference_state`) applies its parameter rules to a state dict, so the mapping that
compares the runs is the one that gave them identical logical weights.

A map, in the order of its file (docs/porting.md has the full format and the shipped Llama pair):

    name, reference, candidate, description     what relates to what, in words
    [facts]                 fact = "key"          sizes the transforms use, read from the reference's
                                                  recorded model config ("groups" = "num_key_value_heads")
    [candidate_model]       fact = "key"          the candidate's model facts the map vouches for
                                                  ("num_layers" = "num_hidden_layers"), checked as any fact
    [[parameters]]          candidate, reference, transform
                            one parameter of the candidate from one or more of the reference's; gives its
                            gradient and values, and converts weights (the transform must be invertible)
    [[tensors]]             candidate, slots, reference, transform, phase
                            activations and step scalars of one candidate module: for each slot, the
                            reference modules' tensors ("fqn" takes the same slot, "fqn/slot" another one)
    [[unmapped]]            side, tensors, reason
                            tensors with no counterpart, by glob over "phase/fqn/slot": listed, never compared
    [[precision]]           candidate, reference, candidate_computes, reference_computes
                            a module the two implementations compute at different precisions

Names take placeholders: `{layer}` in "decoder.layers.{layer}.mlp" matches one name component and carries
over to the other side. Decoding checks every field (msgspec) and then the rules' meaning; a bad map is one
line naming the file, the key and what to do.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import torch

from ttrace_core.canonicalize import map_transforms as mt
from ttrace_core.errors import MapError
from ttrace_core.format.records import error_at
from ttrace_core.format.schema import SLOT_FAMILIES

FORMAT_HELP = "docs/porting.md describes the map format"
SLOT_PHASES = {"input": "forward", "output": "forward", "grad_output": "backward", "grad_input": "backward"}
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ParameterRule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    candidate: str
    """The candidate's parameter ("decoder.layers.{layer}.self_attention.linear_qkv.weight")."""
    reference: list[str]
    """The reference's parameters it is made of, in the transform's order."""
    transform: list[mt.AnyOp] = []


class TensorRule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    candidate: str
    """The candidate's module, or pseudo-module ("(loss)", "(gradient clipping)")."""
    slots: list[str]
    """The candidate's slots this rule gives ("output.0", "grad_input.0", "scalar.loss")."""
    reference: list[str]
    """The reference's modules ("fqn": the same slot) or tensors ("fqn/slot"), in the transform's order."""
    transform: list[mt.AnyOp] = []
    phase: Literal["forward", "backward", "step"] | None = None
    """Only for step scalars (slot "scalar.*"); other slots say their phase themselves."""


class Unmapped(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    side: Literal["candidate", "reference"]
    tensors: list[str]
    """Globs over "phase/fqn/slot" ("backward/decoder.layers.*.self_attention.core_attention/grad_input.[01]");
    `*` stays within one name component, `**` crosses any (glob_regex)."""
    reason: str
    """Why there is no counterpart, in one sentence: it is shown with the verdict."""


class PrecisionChoice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    candidate: str
    """Glob over the candidate's modules."""
    reference: str
    candidate_computes: str
    """What the candidate computes in, in words ("the input dtype: torch.nn.RMSNorm")."""
    reference_computes: str


class CorrespondenceMap(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    reference: str
    """The reference implementation, in words."""
    candidate: str
    description: str = ""
    facts: dict[str, str] = {}
    candidate_model: dict[str, str] = {}
    parameters: list[ParameterRule] = []
    tensors: list[TensorRule] = []
    unmapped: list[Unmapped] = []
    precision: list[PrecisionChoice] = []


@dataclass(frozen=True, slots=True)
class LoadedMap:
    """A decoded, checked map and the file it came from."""

    spec: CorrespondenceMap
    path: Path
    digest: str
    """sha256 of the file's bytes: a mapped run made with another version of the map is made again."""

    @property
    def name(self) -> str:
        return self.spec.name


def _reason(error: msgspec.ValidationError) -> str:
    message, path = error_at(error)
    return f"{path or '$'}: {message}"


def load_map(path: str | Path) -> LoadedMap:
    """The map in `path`, decoded and checked, or MapError: one line naming the file, the key, what to do."""
    import hashlib

    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise MapError(f"{path}: cannot read the map ({error.strerror or error}); pass a map name or a .toml file") from error
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise MapError(f"{path}: not TOML ({error}); {FORMAT_HELP}") from error
    try:
        spec = msgspec.convert(data, CorrespondenceMap, strict=True)
    except msgspec.ValidationError as error:
        raise MapError(f"{path}: not a valid correspondence map ({_reason(error)}); {FORMAT_HELP}") from error
    problem = check_map(spec)
    if problem is not None:
        raise MapError(f"{path}: {problem}; {FORMAT_HELP}")
    return LoadedMap(spec=spec, path=path.resolve(), digest=hashlib.sha256(raw).hexdigest())


def _placeholders(pattern: str) -> set[str]:
    return set(_PLACEHOLDER.findall(pattern))


def _check_select(ops: list[mt.AnyOp], where: str) -> str | None:
    positions = [i for i, op in enumerate(ops) if isinstance(op, mt.Select)]
    if positions and positions != [0]:
        return (f"{where}[{positions[-1]}]: a select op comes first, once: it picks a slice of the reference's "
                "tensor as recorded, which the weight conversion puts back in place")
    return None


def _ops_facts(ops: list[mt.AnyOp]) -> set[str]:
    named = set()
    for op in ops:
        counts = (op.count,) if isinstance(op, mt.Select) else ()
        for value in (getattr(op, "groups", 1), getattr(op, "head_dim", 2), *getattr(op, "sizes", ()), *counts):
            if isinstance(value, str):
                named.add(value)
    return named


def _check_slot(slot: str, phase: str | None, where: str) -> str | None:
    family = slot.split(".", 1)[0]
    if family not in SLOT_FAMILIES or "." not in slot and family not in ("grad", "value"):
        return f"{where}: slot {slot!r} is not a ttrace slot (one of {', '.join(SLOT_FAMILIES)}, then '.' and an index or name)"
    if family == "scalar" and phase is None:
        return f"{where}: slot {slot!r} is a step scalar: give the rule a phase (forward for the loss, step for the rest)"
    if family in ("grad", "value", "tokens"):
        return f"{where}: slot {slot!r} belongs to a [[parameters]] rule or is not compared"
    return None


def check_map(spec: CorrespondenceMap) -> str | None:
    """What is wrong with a decoded map, naming the key ("$.parameters[2].transform[0]"), or None."""
    if not spec.parameters and not spec.tensors:
        return "$: the map has no [[parameters]] and no [[tensors]] rule"
    rules = [(f"$.parameters[{i}]", r.candidate, r.reference, r.transform) for i, r in enumerate(spec.parameters)]
    rules += [(f"$.tensors[{i}]", r.candidate, r.reference, r.transform) for i, r in enumerate(spec.tensors)]
    for where, candidate, reference, ops in rules:
        if not reference:
            return f"{where}.reference: empty; name the reference tensors the candidate's is made of"
        if problem := _check_select(ops, f"{where}.transform"):
            return problem
        select = mt.leading_select(ops)
        missing = _placeholders(candidate) - _placeholders(reference[0]) - {getattr(select, "index", None)}
        if missing:
            return (f"{where}.candidate: placeholder {{{sorted(missing)[0]}}} does not appear in the first reference "
                    f"name {reference[0]!r} nor is a select op's index, so nothing says its value")
        if select is not None and isinstance(select.index, str) and select.index not in _placeholders(candidate):
            return (f"{where}.transform[0]: select's index {select.index!r} is no placeholder of the candidate name "
                    f"{candidate!r}; name the placeholder that says which index it is")
        if unknown := sorted(_ops_facts(ops) - set(spec.facts)):
            return f"{where}.transform: names fact {unknown[0]!r}, which [facts] does not define"
        combines = sum(op.combines for op in ops)
        if len(reference) > 1 and combines != 1 or len(reference) == 1 and combines:
            return (f"{where}.transform: {len(reference)} reference tensors need exactly one op that combines them "
                    f"(concat or sum), found {combines}")
    for i, rule in enumerate(spec.parameters):
        if (bad := next((j for j, op in enumerate(rule.transform) if not op.invertible), None)) is not None:
            return (f"$.parameters[{i}].transform[{bad}]: op {type(rule.transform[bad]).__name__.lower()!r} cannot be "
                    "inverted, and a parameter rule also converts the weights from the candidate to the reference")
    for i, rule in enumerate(spec.tensors):
        if not rule.slots:
            return f"$.tensors[{i}].slots: empty; list the candidate slots this rule gives"
        for slot in rule.slots:
            if problem := _check_slot(slot, rule.phase, f"$.tensors[{i}].slots"):
                return problem
    for i, entry in enumerate(spec.unmapped):
        if not entry.tensors or not entry.reason.strip():
            return f"$.unmapped[{i}]: give the tensors (globs over phase/fqn/slot) and the reason they have no counterpart"
    return None


def pattern_regex(pattern: str) -> re.Pattern:
    """"decoder.layers.{layer}.mlp" -> a regex whose named groups bind the placeholders (one name component each)."""
    parts, last = [], 0
    for match in _PLACEHOLDER.finditer(pattern):
        parts.append(re.escape(pattern[last:match.start()]))
        parts.append(f"(?P<{match.group(1)}>[^./]+)")
        last = match.end()
    parts.append(re.escape(pattern[last:]))
    return re.compile("".join(parts) + r"\Z")


def split_reference(item: str, slot: str) -> tuple[str, str]:
    """A [[tensors]] reference item: "fqn" (the candidate's slot) or "fqn/slot"."""
    fqn, _, own = item.partition("/")
    return fqn, own or slot


def tensor_phase(rule: TensorRule, slot: str) -> str:
    return rule.phase or SLOT_PHASES[slot.split(".", 1)[0]]


def glob_regex(glob: str) -> re.Pattern:
    """An [[unmapped]] glob over "phase/fqn/slot": `*` and `?` stay within one name component (they cross no
    '.' or '/'), `**` crosses anything, `[..]` is a character class. So "backward/model.layers.*/grad_input.0"
    is every layer's own gradient and never a projection's inside it: a declaration hides nothing it does not name."""
    parts, index = [], 0
    while index < len(glob):
        if glob.startswith("**", index):
            parts.append(".*")
            index += 2
            continue
        char = glob[index]
        if char == "*":
            parts.append(r"[^./]*")
        elif char == "?":
            parts.append(r"[^./]")
        elif char == "[" and (end := glob.find("]", index + 2)) != -1:
            body = glob[index + 1:end]
            parts.append("[" + ("^" + re.escape(body[1:]) if body.startswith("!") else re.escape(body)) + "]")
            index = end
        else:
            parts.append(re.escape(char))
        index += 1
    return re.compile("".join(parts) + r"\Z")


def declared_unmapped(spec: CorrespondenceMap, side: str, tensor: str) -> Unmapped | None:
    """The [[unmapped]] entry of `side` whose globs (glob_regex) match "phase/fqn/slot", or None."""
    for entry in spec.unmapped:
        if entry.side == side and any(glob_regex(glob).match(tensor) for glob in entry.tensors):
            return entry
    return None


def facts_from_config(loaded: LoadedMap, config: dict, where: str) -> dict[str, int]:
    """The map's [facts] from a reference's model config (its recorded `model.config`, or the config the
    reference script builds); MapError naming the fact when the config lacks it."""
    facts = {}
    for fact, key in loaded.spec.facts.items():
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise MapError(f"{loaded.path}: $.facts.{fact} reads {key!r} from the reference's model config, but "
                           f"{where} {'has no ' + repr(key) if value is None else 'holds ' + repr(value) + ' there'}; "
                           "record the reference with its model config (docs/porting.md)")
        facts[fact] = value
    return facts


# ---- the weight conversion: [[parameters]] applied to a state dict ------------------------------------

def _parameter_bindings(rule: ParameterRule, names: set[str], facts: dict[str, int]
                        ) -> list[tuple[dict[str, str], list[mt.AnyOp]]]:
    """Each placeholder binding for which every reference parameter of `rule` is in `names` (a `select` op's
    index bound to each of its values in turn), with the rule's ops bound to it."""
    first = pattern_regex(rule.reference[0])
    found = []
    for name in sorted(names):
        if (match := first.match(name)) is not None:
            binding = match.groupdict()
            if all(item.format(**binding) in names for item in rule.reference):
                for selected in mt.select_bindings(rule.transform, facts, rule.candidate):
                    found.append(({**binding, **selected}, mt.bind(rule.transform, selected)))
    return found


def candidate_state(loaded: LoadedMap, reference: dict[str, torch.Tensor], facts: dict[str, int]
                    ) -> dict[str, torch.Tensor]:
    """The candidate's parameters from the reference's, through the [[parameters]] rules. A reference
    parameter that no rule uses is left out (reference_state's caller sees it missing)."""
    out = {}
    for index, rule in enumerate(loaded.spec.parameters):
        for binding, ops in _converted(lambda: _parameter_bindings(rule, set(reference), facts), loaded, index):
            name = rule.candidate.format(**binding)
            pieces = [reference[item.format(**binding)] for item in rule.reference]
            out[name] = _converted(lambda: mt.candidate_tensor(ops, pieces, facts, name), loaded, index)
    return out


def candidate_shapes(loaded: LoadedMap, reference: dict[str, tuple[int, ...]], facts: dict[str, int]
                     ) -> dict[str, tuple[int, ...]]:
    """The candidate's parameter shapes from the reference's (what a script draws the logical weights in)."""
    out = {}
    for index, rule in enumerate(loaded.spec.parameters):
        for binding, ops in _converted(lambda: _parameter_bindings(rule, set(reference), facts), loaded, index):
            name = rule.candidate.format(**binding)
            shapes = [tuple(reference[item.format(**binding)]) for item in rule.reference]
            out[name] = _converted(lambda: mt.candidate_shape(ops, shapes, facts, name), loaded, index)
    return out


def reference_state(loaded: LoadedMap, candidate: dict[str, torch.Tensor], reference_shapes: dict[str, tuple[int, ...]],
                    facts: dict[str, int]) -> dict[str, torch.Tensor]:
    """The reference's parameters (named and shaped as in `reference_shapes`) from the candidate's: the
    [[parameters]] rules inverted; a rule that selects puts each candidate tensor at its index. MapError when a
    reference parameter (or an index of one) is given by no rule or by two."""
    out: dict[str, torch.Tensor] = {}
    selected: dict[str, tuple[int, set[int]]] = {}
    """A reference parameter filled index by index: its select dim and the indices given so far."""
    for index, rule in enumerate(loaded.spec.parameters):
        for binding, ops in _converted(lambda: _parameter_bindings(rule, set(reference_shapes), facts), loaded, index):
            name = rule.candidate.format(**binding)
            if name not in candidate:
                raise MapError(f"{loaded.path}: $.parameters[{index}] gives candidate parameter {name}, which the "
                               "candidate's state does not hold; check the map against the candidate model")
            targets = [item.format(**binding) for item in rule.reference]
            shapes = [tuple(reference_shapes[t]) for t in targets]
            pieces = _converted(lambda: mt.reference_pieces(ops, candidate[name], shapes, facts, name), loaded, index)
            select = mt.leading_select(ops)
            for target, shape, piece in zip(targets, shapes, pieces):
                whole_given = target in out and target not in selected
                if whole_given or select is not None and select.index in selected.get(target, (0, set()))[1] \
                        or select is None and target in out:
                    raise MapError(f"{loaded.path}: $.parameters[{index}] gives reference parameter {target}"
                                   f"{'' if select is None else f' index {select.index}'} a second time; each "
                                   "reference parameter (or index of one) belongs to one rule")
                if select is None:
                    out[target] = piece
                    continue
                selected.setdefault(target, (select.dim, set()))[1].add(select.index)
                out.setdefault(target, torch.empty(shape, dtype=piece.dtype)).select(select.dim, select.index).copy_(piece)
    for target, (dim, given) in selected.items():
        if len(given) != reference_shapes[target][dim]:
            lacking = min(set(range(reference_shapes[target][dim])) - given)
            raise MapError(f"{loaded.path}: no [[parameters]] rule gives index {lacking} along dim {dim} of reference "
                           f"parameter {target} ({len(given)} of {reference_shapes[target][dim]} given); the select's "
                           "count must cover the dim")
    if missing := sorted(set(reference_shapes) - set(out)):
        raise MapError(f"{loaded.path}: no [[parameters]] rule gives reference parameter {missing[0]} "
                       f"({len(missing)} in all); add one, or the two runs cannot start from the same weights")
    return out


def _converted(convert, loaded: LoadedMap, index: int):
    try:
        return convert()
    except (ValueError, KeyError, RuntimeError) as error:
        reason = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise MapError(f"{loaded.path}: $.parameters[{index}]: {reason}") from error
