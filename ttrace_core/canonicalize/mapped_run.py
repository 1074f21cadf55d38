"""A reference from another implementation, rewritten in the candidate's names and layouts (stage 2).

Input: a recorded reference run (`RunReader`) of one implementation and a correspondence map
(correspondence.py) to the candidate's implementation. Output: a run directory that holds, for every
tensor the map gives, the candidate's logical tensor made from the reference's (map_transforms.py), on one
rank, and whose manifest says which map made it, from which run, and which tensors of either side have no
counterpart (`RunManifest.correspondence`). Compare, localize's input rewriting and the dashboard read it as
any reference: the mapping is a canonicalize-stage transform, and no later stage needs to know of it.

    HF run  model.layers.0.self_attn.{q,k,v}_proj / output.0   [batch, seq, 64], [.., 32], [.., 32]
    mapped  decoder.layers.0.self_attention.linear_qkv / output.0   [seq, batch, 128]  (permute, concat per group)

Each mapped tensor keeps the dtype and loss scale its reference tensors were recorded with; values are
combined in float64 and rounded once to that dtype (exact for a permute or a concatenation; a sum of
gradients rounds as the candidate's fused module does). Tensors of the reference that no rule uses are
either declared (`[[unmapped]]`, with the map's reason) or listed as unaccounted: never dropped in silence.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ttrace_core.canonicalize import map_transforms as mt
from ttrace_core.canonicalize.correspondence import (
    LoadedMap, declared_unmapped, facts_from_config, pattern_regex, split_reference, tensor_phase,
)
from ttrace_core.canonicalize.logical_value import canonical_tensor
from ttrace_core.errors import MapError
from ttrace_core.format.naming import tensor_id
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import PHASE_ORDER, PRE_STEP_SLOT, Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, stats_from_tensor, write_manifest

PARAMETER_SLOTS = (("grad", "grad"), ("param", "value"), ("param", PRE_STEP_SLOT))
"""The tensors a [[parameters]] rule gives: (phase, slot) of the parameter's gradient and values."""
MAX_LISTED = 20


@dataclass(frozen=True, slots=True)
class MappedTensor:
    """One tensor of the mapped run and where it came from."""

    key: TensorKey
    """The candidate's name of it."""
    sources: tuple[TensorKey, ...]
    """The reference's tensors it is made of, in the rule's order."""
    rule: str
    """The rule's key in the map ("$.tensors[12]")."""
    ops: tuple[mt.AnyOp, ...]


@dataclass(kw_only=True, slots=True)
class MappedRun:
    """What `write_mapped_run` wrote: the run directory and, per tensor, its sources (the estimate's
    translation reads them); the reference's tensors with no counterpart, declared and not."""

    run_dir: Path
    tensors: list[MappedTensor] = field(default_factory=list)
    norms: dict[TensorKey, float] = field(default_factory=dict)
    """The Frobenius norm of each mapped tensor's logical value (loss scale undone)."""
    declared: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> the reference's tensor ids ("phase/fqn/slot") the map declares without counterpart."""
    unaccounted: list[str] = field(default_factory=list)
    """The reference's tensor ids no rule uses and no [[unmapped]] entry names."""


def _rule_sources(loaded: LoadedMap) -> list[tuple[str, str, list[tuple[str, str, str]], list[mt.AnyOp]]]:
    """Every (rule key, candidate fqn pattern with slot, sources (phase, fqn pattern, slot), ops), one per
    candidate slot: parameter rules give a parameter's gradient and values, tensor rules each of their slots."""
    expanded = []
    for index, rule in enumerate(loaded.spec.parameters):
        for phase, slot in PARAMETER_SLOTS:
            expanded.append((f"$.parameters[{index}]", f"{phase}|{rule.candidate}|{slot}",
                             [(phase, item, slot) for item in rule.reference], list(rule.transform)))
    for index, rule in enumerate(loaded.spec.tensors):
        for slot in rule.slots:
            phase = tensor_phase(rule, slot)
            sources = [(phase, *split_reference(item, slot)) for item in rule.reference]
            expanded.append((f"$.tensors[{index}]", f"{phase}|{rule.candidate}|{slot}", sources, list(rule.transform)))
    return expanded


def plan_mapping(loaded: LoadedMap, keys: list[TensorKey], facts: dict[str, int]
                 ) -> tuple[list[MappedTensor], list[str]]:
    """The candidate's tensors the map gives from the reference's `keys`, and what keeps a rule from giving
    one (a source of another micro-batch or step missing); a rule with a `select` op gives one per index.
    MapError when two rules give one tensor."""
    by_phase_slot: dict[tuple[str, str], list[TensorKey]] = defaultdict(list)
    present = set(keys)
    for key in keys:
        by_phase_slot[(key.phase, key.slot)].append(key)
    planned: dict[TensorKey, MappedTensor] = {}
    gaps = []
    for rule, target, sources, ops in _rule_sources(loaded):
        phase, candidate, slot = target.split("|")
        first_phase, first_fqn, first_slot = sources[0]
        first = pattern_regex(first_fqn)
        try:
            selections = mt.select_bindings(ops, facts, rule)
        except KeyError as error:
            raise MapError(f"{loaded.path}: {error.args[0]}") from error
        for key in by_phase_slot.get((first_phase, first_slot), ()):
            if (match := first.match(key.fqn)) is None:
                continue
            binding = match.groupdict()
            wanted = tuple(TensorKey(step=key.step, micro_batch=key.micro_batch, phase=p, fqn=fqn.format(**binding),
                                     slot=s, call=key.call) for p, fqn, s in sources)
            for selected in selections:
                mapped = TensorKey(step=key.step, micro_batch=key.micro_batch, phase=phase,
                                   fqn=candidate.format(**binding, **selected), slot=slot, call=key.call)
                if missing := [w for w in wanted if w not in present]:
                    gaps.append(f"{mapped}: {rule} needs {missing[0]}, which the reference did not record")
                    continue
                if mapped in planned:
                    raise MapError(f"{loaded.path}: {planned[mapped].rule} and {rule} both give {tensor_id(mapped)}; "
                                   "each candidate tensor belongs to one rule")
                planned[mapped] = MappedTensor(key=mapped, sources=wanted, rule=rule, ops=tuple(mt.bind(ops, selected)))
    return list(planned.values()), gaps


def _values(reader: RunReader, key: TensorKey) -> tuple[torch.Tensor, TensorMeta]:
    metas = reader.index[key]
    if metas[0].stats_only:
        raise MapError(f"{reader.run_dir}: {key} was recorded in stats-only mode; a reference is mapped from its "
                       "values: record it without --stats-only")
    return canonical_tensor(reader, metas, key).full, metas[0]


def _mapped_value(loaded: LoadedMap, reader: RunReader, tensor: MappedTensor, facts: dict[str, int]
                  ) -> tuple[torch.Tensor, TensorMeta]:
    """The candidate's tensor in the sources' recorded dtype and loss scale, and the first source's metadata."""
    read = [_values(reader, key) for key in tensor.sources]
    metas = [meta for _, meta in read]
    if len({meta.dtype for meta in metas}) != 1:
        raise MapError(f"{loaded.path}: {tensor.rule} combines tensors of dtypes {sorted({m.dtype for m in metas})} "
                       f"into {tensor.key}; a rule combines tensors of one dtype")
    first = metas[0]
    floating = read[0][0].is_floating_point()
    pieces = [value.double() * (first.scale / meta.scale) if floating else value for value, meta in read]
    try:
        value = mt.candidate_tensor(list(tensor.ops), pieces, facts, f"{tensor.rule} ({tensor_id(tensor.key)})")
    except (ValueError, KeyError, RuntimeError) as error:
        reason = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise MapError(f"{loaded.path}: {reason}") from error
    return value.to(read[0][0].dtype).contiguous(), first


def _order(reader: RunReader, tensor: MappedTensor) -> tuple:
    """Execution order of the mapped run: the latest of its sources in the reference's own order."""
    key = tensor.key
    phase_order = -1 if key.phase == "param" and key.slot == PRE_STEP_SLOT else PHASE_ORDER[key.phase]
    seq = max(m.seq for source in tensor.sources for m in reader.index[source])
    return (key.step, phase_order, key.micro_batch, seq, key.fqn, key.slot)


def _unused(loaded: LoadedMap, reader: RunReader, used: set[TensorKey]) -> tuple[dict[str, list[str]], list[str]]:
    """The reference's tensors no rule uses: reason -> their ids, one per tensor of every step and micro-batch
    (as the candidate's are counted), for those the map declares; the others' ids, once each."""
    declared: dict[str, list[str]] = defaultdict(list)
    unaccounted: set[str] = set()
    for key in sorted(key for key in reader.index if key not in used and key.step in reader.complete_steps):
        name = tensor_id(key).split("@")[0]
        entry = declared_unmapped(loaded.spec, "reference", name)
        if entry is None:
            unaccounted.add(name)
        else:
            declared[entry.reason].append(name)
    return dict(declared), sorted(unaccounted)


def mapped_manifest(loaded: LoadedMap, source: RunManifest, source_dir: Path, mapped: MappedRun,
                    provenance: dict) -> RunManifest:
    """The mapped run's manifest: one rank, the candidate's model facts the map vouches for, and what the
    mapping left without counterpart (read by compare's coverage)."""
    config = source.model.get("config", {})
    model = {fact: config.get(key) for fact, key in loaded.spec.candidate_model.items() if key in config}
    correspondence = {
        **provenance, "map": loaded.name, "map_file": str(loaded.path), "map_digest": loaded.digest,
        "source": str(source_dir.resolve()),
        "candidate_unmapped": [{"tensors": list(e.tensors), "reason": e.reason}
                               for e in loaded.spec.unmapped if e.side == "candidate"],
        "reference_unmapped": [{"reason": reason, "num_tensors": len(names), "example": min(names)}
                               for reason, names in sorted(mapped.declared.items())],
        "unaccounted": mapped.unaccounted[:MAX_LISTED], "num_unaccounted": len(mapped.unaccounted),
        "precision": [{"candidate": p.candidate, "reference": p.reference, "candidate_computes": p.candidate_computes,
                       "reference_computes": p.reference_computes} for p in loaded.spec.precision],
    }
    return RunManifest(role="reference", world_size=1, precision=source.precision, seed=source.seed, model=model,
                       environment=source.environment, correspondence=correspondence)


def write_mapped_run(loaded: LoadedMap, reader: RunReader, out_dir: Path, provenance: dict) -> MappedRun:
    """Write the mapped run of `reader` into `out_dir` (a new directory): every complete step, one rank."""
    facts = facts_from_config(loaded, reader.manifest.model.get("config", {}), f"the manifest of {reader.run_dir}")
    planned, gaps = plan_mapping(loaded, [key for key in reader.index if key.step in reader.complete_steps], facts)
    if not planned:
        raise MapError(f"{loaded.path}: none of its rules matches a tensor of {reader.run_dir}; is it a run of "
                       f"{loaded.spec.reference}?")
    planned.sort(key=lambda tensor: _order(reader, tensor))
    mapped = MappedRun(run_dir=out_dir, tensors=planned)
    used = {source for tensor in planned for source in tensor.sources}
    mapped.declared, mapped.unaccounted = _unused(loaded, reader, used)
    mapped.unaccounted += gaps
    writer = RunWriter(out_dir, rank=0)
    by_step: dict[int, list[MappedTensor]] = defaultdict(list)
    for tensor in planned:
        by_step[tensor.key.step].append(tensor)
    for step, tensors in sorted(by_step.items()):
        writer.begin_step(step)
        for seq, tensor in enumerate(tensors):
            value, first = _mapped_value(loaded, reader, tensor, facts)
            meta = TensorMeta(key=tensor.key, rank=0, dtype=first.dtype, local_shape=tuple(value.shape),
                              layout=Layout.replicated(tuple(value.shape)), seq=seq, scale=first.scale,
                              stats=stats_from_tensor(value))
            writer.write(meta, value)
            if value.is_floating_point():
                logical = value.double() / first.scale
                mapped.norms[tensor.key] = float(torch.linalg.vector_norm(torch.nan_to_num(logical, 0.0, 0.0, 0.0)))
        writer.end_step()
    write_manifest(out_dir, mapped_manifest(loaded, reader.manifest, reader.run_dir, mapped, provenance))
    return mapped
