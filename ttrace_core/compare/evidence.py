"""What a verdict rests on: consistency of the recorded metadata and coverage of the run.

Part of stage 3 (compare), run on the runs' indexes before any value is read (structure before
values, as torch.testing does). Input: the `TensorMeta` of every shard of a tensor and the run's
manifest. Output, per tensor: the disagreement among its shards, if any (`inconsistency`), and how
many copies were recorded against how many the layout and the run's structure call for
(`copies_expected`). Per run: a `Coverage` block, which says how much evidence stands behind the verdict,
names what is missing (`Coverage.findings`) and whether the reference trained at all (liveness.py:
a reference that did not train refuses any pass). Also here: the run-level checks that come before
values (`check_comparable`, the tensors only a quantized run holds) and the data-mismatch finding.

Copies. A tensor's layout gives one block per mesh coordinate, and ranks outside the tensor's mesh
may hold the same block again (data-parallel replicas of a reduced gradient). Every coordinate must be
held, and by as many ranks as the most replicated coordinate of the tensor's *family*: the same
module output over all micro-batches and steps, or a parameter's gradient and its post-step value
(every data-parallel rank holds both). A replica that is missing leaves the replica-drift check, the
one that catches an unreduced gradient, with nothing to compare.
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter, defaultdict

from ttrace_core.canonicalize import placements as pl
from ttrace_core.canonicalize.correspondence import glob_regex
from ttrace_core.errors import ConfigMismatchError, LayoutError
from ttrace_core.format.findings import finding_lines
from ttrace_core.format.naming import fp8_scale_linear, tensor_id
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.liveness import reference_liveness
from ttrace_core.compare.results import ComparisonStatus, Coverage, RunComparison


# Fields every shard of one tensor must agree on: (name, how to read it from a TensorMeta).
_SHARED_FIELDS = (
    ("dtype", lambda m: m.dtype), ("scale", lambda m: m.scale), ("stats_only", lambda m: m.stats_only),
    ("global shape", lambda m: m.layout.global_shape), ("mesh", lambda m: m.layout.mesh_shape),
    ("mesh axes", lambda m: m.layout.mesh_axis_names), ("placements", lambda m: m.layout.placements),
    ("flat range use", lambda m: m.layout.flat_range is not None),
)


def inconsistency(key: TensorKey, metas: list[TensorMeta], manifest: RunManifest) -> str | None:
    """Why the shards of `key` cannot all be right (their metadata disagree with each other or with
    the manifest), naming the field and the ranks; None when they agree."""
    why = _disagreement(metas, manifest)
    return None if why is None else f"{key}: {why}"


_DISAGREEMENTS: dict[tuple, tuple[RunManifest, str | None]] = {}
"""(id of the manifest, what each shard's metadata says but its key) -> (the manifest, the disagreement): a
run repeats a few dozen such sets over thousands of tensors, so each is checked once."""


def _disagreement(metas: list[TensorMeta], manifest: RunManifest) -> str | None:
    try:
        if len(metas) == 1:  # (most tensors of a reference: no generator to make)
            m = metas[0]
            signature = (id(manifest), (m.rank, m.dtype, m.scale, m.stats_only, m.local_shape, m.layout))
        else:
            signature = (id(manifest), *((m.rank, m.dtype, m.scale, m.stats_only, m.local_shape, m.layout) for m in metas))
        found = _DISAGREEMENTS.get(signature)
    except TypeError:  # a layout built with lists: checked each time
        return _checked_disagreement(metas, manifest)
    if found is not None and found[0] is manifest:
        return found[1]
    why = _checked_disagreement(metas, manifest)
    if len(_DISAGREEMENTS) >= 1 << 16:
        _DISAGREEMENTS.clear()
    _DISAGREEMENTS[signature] = (manifest, why)  # holds the manifest: its id cannot be another's while it is here
    return why


def _checked_disagreement(metas: list[TensorMeta], manifest: RunManifest) -> str | None:
    first = metas[0]
    if len(metas) > 1 and any(_shared(other) != _shared(first) for other in metas[1:]):  # else: nothing to name
        for name, value_of in _SHARED_FIELDS:
            for other in metas[1:]:
                if value_of(other) != value_of(first):
                    return f"rank {first.rank} recorded {name} {value_of(first)}, rank {other.rank} recorded {name} {value_of(other)}"
    for meta in metas:
        if (why := _against_manifest(meta, manifest)) is not None:
            return why
    return _duplicate_coordinate(metas)


def _shared(meta: TensorMeta) -> tuple:
    """Every field of _SHARED_FIELDS at once: shards that agree (nearly always) are told apart by one comparison."""
    layout = meta.layout
    return (meta.dtype, meta.scale, meta.stats_only, layout.global_shape, layout.mesh_shape, layout.mesh_axis_names,
            layout.placements, layout.flat_range is not None)


_WORLDS: dict[int, tuple[RunManifest, list[dict]]] = {}
"""id(manifest) -> (the manifest, each rank's {mesh axis: (size, coordinate)}): made once per run, not per shard."""


def _world_of(manifest: RunManifest, rank: int) -> dict:
    found = _WORLDS.get(id(manifest))
    if found is None or found[0] is not manifest:
        if len(_WORLDS) > 64:
            _WORLDS.clear()
        found = _WORLDS[id(manifest)] = (manifest, [dict(zip(manifest.mesh_axis_names, zip(manifest.mesh_shape, coordinates)))
                                                    for coordinates in manifest.rank_coordinates])
    return found[1][rank]


def _against_manifest(meta: TensorMeta, manifest: RunManifest) -> str | None:
    if meta.rank >= manifest.world_size:
        return f"rank {meta.rank} recorded it, but the manifest's world size is {manifest.world_size}"
    try:
        expected_shape = pl.local_shape(meta.layout)
    except LayoutError as error:
        return f"rank {meta.rank}: {error}"
    if meta.local_shape != expected_shape and not meta.stats_only:
        return (f"rank {meta.rank} holds local shape {meta.local_shape}, but its placements {meta.layout.placements} "
                f"on mesh {meta.layout.mesh_shape} at coordinate {meta.layout.coordinate} give {expected_shape}")
    if not manifest.rank_coordinates:
        return None
    world = _world_of(manifest, meta.rank)
    for axis, name in enumerate(meta.layout.mesh_axis_names):
        size, coordinate = world.get(name, (None, None))
        if size == meta.layout.mesh_shape[axis] and coordinate != meta.layout.coordinate[axis]:
            return (f"rank {meta.rank} recorded coordinate {meta.layout.coordinate[axis]} on mesh axis {name!r}, "
                    f"the manifest places rank {meta.rank} at {coordinate} on that axis")
    return None


def _duplicate_coordinate(metas: list[TensorMeta]) -> str | None:
    """Two ranks claiming the same block of a partial placement would be summed twice."""
    if not metas or not pl.axes_of_kind(metas[0].layout, "partial"):
        return None
    seen: dict[tuple[int, ...], int] = {}
    for meta in metas:
        if meta.layout.coordinate in seen:
            return (f"ranks {seen[meta.layout.coordinate]} and {meta.rank} both recorded coordinate "
                    f"{meta.layout.coordinate} of a partial placement {meta.layout.placements}; its sum would count it twice")
        seen[meta.layout.coordinate] = meta.rank
    return None


def family_of(key: TensorKey) -> tuple:
    """Tensors that every correct run records on the same number of ranks per block."""
    if key.phase in ("grad", "param"):
        return ("parameter", key.fqn)
    return (key.phase, key.fqn, key.slot, key.call)


def _copies_per_coordinate(metas: list[TensorMeta]) -> int:
    if len(metas) < 2:
        return len(metas)
    if len(metas) == 2:
        return 2 if metas[0].layout.coordinate == metas[1].layout.coordinate else 1
    coordinates = [meta.layout.coordinate for meta in metas]
    if len(set(coordinates)) == len(coordinates):  # (most tensors: no two shards hold the same block)
        return 1
    return max(Counter(coordinates).values())


def replication_by_family(index: dict[TensorKey, list[TensorMeta]], families: dict[TensorKey, tuple] | None = None
                          ) -> dict[tuple, int]:
    """family -> the most ranks that held one block of any of its tensors; `families`, when given, is filled
    with each key's family (a key it holds already keeps its family)."""
    replication: dict[tuple, int] = {}
    families = {} if families is None else families
    for key, metas in index.items():
        family = families.get(key)
        if family is None:
            family = families[key] = family_of(key)
        copies = _copies_per_coordinate(metas)
        if copies > replication.get(family, 0):
            replication[family] = copies
    return replication


def copies_expected(metas: list[TensorMeta], replication: int) -> int:
    """How many copies of a tensor a run holds when every block of its layout is held by `replication`
    ranks (its family's most replicated block); `len(metas)` are present."""
    return (math.prod(metas[0].layout.mesh_shape) if metas else 1) * max(replication, 1)


def _tally_copies(coverage: Coverage, keys: list[TensorKey], reader: RunReader, replication: dict[tuple, int],
                  families: dict[TensorKey, tuple]) -> bool:
    """The copies of `keys` `reader` holds, and those `copies_expected` calls for, added to `coverage`; whether
    any key has fewer. One pass over the keys, each mesh's count of blocks taken once."""
    index, blocks_of = reader.index, {}
    present_total = expected_total = 0
    short = False
    for key in keys:
        metas = index[key]
        present = len(metas)
        if metas:
            mesh = metas[0].layout.mesh_shape
            if (blocks := blocks_of.get(mesh)) is None:
                blocks = blocks_of[mesh] = math.prod(mesh)
        else:
            blocks = 1
        family = families.get(key)
        expected = blocks * max(replication.get(family if family is not None else family_of(key), 0), 1)
        present_total += present
        expected_total += expected
        short = short or present < expected
    coverage.copies_present += present_total
    coverage.copies_expected += expected_total
    return short


def _missing_copies(keys: list[TensorKey], readers: tuple[RunReader, RunReader], replication: dict[int, dict[tuple, int]],
                    families: dict[TensorKey, tuple]) -> list[str]:
    """The first five keys short of copies, "KEY: 1 of 2 copies in RUN (ranks [0])", key by key, the reference first."""
    found: list[str] = []
    for key in keys:
        for reader in readers:
            metas = reader.index[key]
            present = len(metas)
            expected = copies_expected(metas, replication[id(reader)].get(families.get(key) or family_of(key), 0))
            if present < expected:
                found.append(f"{key}: {present} of {expected} copies in {reader.run_dir.name} "
                             f"(ranks {sorted(m.rank for m in metas)})")
                if len(found) == 5:
                    return found
    return found


def expected_steps(reference: RunReader, candidate: RunReader) -> list[int]:
    """Every step the candidate recorded (partial ones too), and every reference step up to the
    candidate's last: a candidate recorded for fewer steps than its reference is judged on its own
    steps, but a step missing in between, or a partial one on either side, leaves the evidence incomplete."""
    own = {*candidate.complete_steps, *candidate.partial_steps}
    last = max(own, default=-1)
    from_reference = {s for s in (*reference.complete_steps, *reference.partial_steps) if s <= last}
    return sorted(own | from_reference)


def unrecorded_keys(reference: RunReader, candidate: RunReader) -> set[TensorKey]:
    """Tensors either run's tracer left out with a finding: compared in neither run, a gap in the
    evidence rather than a divergence."""
    return {f.key for reader in (reference, candidate) for f in reader.findings if f.key is not None}


def unmapped_candidate_keys(keys: list[TensorKey], reference: RunManifest) -> dict[TensorKey, str]:
    """Among the candidate's tensors the reference lacks, those its correspondence map declares without
    counterpart (a reference mapped from another implementation, canonicalize/mapped_run.py) -> the reason."""
    entries = [([glob_regex(glob) for glob in entry["tensors"]], entry["reason"])
               for entry in reference.correspondence.get("candidate_unmapped", [])]
    found = {}
    for key in keys:
        name = tensor_id(key).split("@")[0]
        reason = next((reason for globs, reason in entries if any(glob.match(name) for glob in globs)), None)
        if reason is not None:
            found[key] = reason
    return found


def _tensors(count: int) -> str:
    return f"{count} tensor" + ("" if count == 1 else "s")


def _unmapped_coverage(coverage: Coverage, rows: list, reference: RunReader, unmapped: dict[TensorKey, str]) -> None:
    """What a correspondence map leaves without counterpart, declared (by reason) and not."""
    mapping = reference.manifest.correspondence
    if not mapping:
        return
    by_reason: dict[str, list[TensorKey]] = defaultdict(list)
    for key, reason in unmapped.items():
        by_reason[reason].append(key)
    lines = [f"candidate: {reason} ({_tensors(len(keys))}, e.g. {tensor_id(min(keys))})" for reason, keys in by_reason.items()]
    lines += [f"reference: {entry['reason']} ({_tensors(entry['num_tensors'])}, e.g. {entry['example']})"
              for entry in mapping.get("reference_unmapped", [])]
    extras = sorted({tensor_id(row.key) for row in rows if row.status == ComparisonStatus.EXTRA})
    coverage.unmapped = len(unmapped) + sum(entry["num_tensors"] for entry in mapping.get("reference_unmapped", []))
    coverage.unmapped_reasons = [f"map {mapping.get('map')}: {line}" for line in lines]
    coverage.unaccounted = ([f"candidate: {name}" for name in extras] +
                            [f"reference: {name}" for name in mapping.get("unaccounted", [])])[:5]
    coverage.num_unaccounted = len(extras) + int(mapping.get("num_unaccounted", 0))


def tally_coverage(rows: list, reference: RunReader, candidate: RunReader, steps_compared: list[int],
                   unmapped: dict[TensorKey, str] | None = None) -> Coverage:
    """The coverage block of one comparison: `rows` are its TensorComparisons (the noted, not compared
    quantization scales left out), the readers give every tensor's recorded copies and their findings,
    and whether the reference trained (liveness.py), once per comparison. `unmapped`: the candidate's
    tensors a mapped reference's map declares without counterpart (unmapped_candidate_keys)."""
    families: dict[TensorKey, tuple] = {}
    replication = {id(reader): replication_by_family(reader.index, families) for reader in (reference, candidate)}
    steps_expected = expected_steps(reference, candidate)
    unrecorded = len({key for key in unrecorded_keys(reference, candidate) if key.step in steps_compared})
    liveness = reference_liveness(reference, steps_compared)
    coverage = Coverage(tensors_expected=len(rows) + unrecorded, steps_expected=steps_expected,
                        steps_compared=list(steps_compared),
                        stats_only_run=any(r.manifest.tracer.get("stats_only") is True for r in (reference, candidate)),
                        inventory_gaps=reference.inventory_gaps + candidate.inventory_gaps, unrecorded=unrecorded,
                        recording_findings=[f"{name}: {line}" for name, reader in (("reference", reference), ("candidate", candidate))
                                            for line in finding_lines(reader.findings)],
                        reference_trained=liveness.trained, dead_reference=liveness.why_not)
    compared: list[TensorKey] = []
    by_stats = elementwise = 0
    for row in rows:
        status = row.status
        if status == ComparisonStatus.MISSING:
            coverage.missing_in_candidate += 1
        elif status == ComparisonStatus.EXTRA:
            coverage.missing_in_reference += 1
        else:
            compared.append(row.key)
            if row.stats_only:
                by_stats += 1
            elif row.value_ratio is not None:
                elementwise += 1
    coverage.compared_by_stats, coverage.compared_elementwise = by_stats, elementwise
    coverage.not_compared = len(compared) - by_stats - elementwise
    short = [_tally_copies(coverage, compared, reader, replication[id(reader)], families) for reader in (reference, candidate)]
    if any(short):
        coverage.missing_copies = _missing_copies(compared, (reference, candidate), replication, families)
    for reader in (reference, candidate):
        coverage.ranks_expected += reader.manifest.world_size
        coverage.ranks_present += len({m.rank for key, metas in reader.index.items() if key.step in steps_compared for m in metas})
    _unmapped_coverage(coverage, rows, reference, unmapped or {})
    return coverage


def check_comparable(reference: RunReader, candidate: RunReader) -> None:
    """Refuse runs whose manifests state different model facts; a fact only one run states (an older
    trace, or a script that records more) cannot contradict the other."""
    differing = _differing_facts(reference.manifest.model, candidate.manifest.model)
    if differing:
        # what a tracer said of its run may be why (a model whose parameters it could not map)
        said = next((f"; its tracer said: {reader.findings[0].message}" for reader in (candidate, reference)
                     if reader.findings and reader.findings[0].key is None), "")
        raise ConfigMismatchError(
            f"{candidate.run_dir}: model configuration differs from the reference {reference.run_dir} "
            f"({'; '.join(differing[:3])}{'; ...' if len(differing) > 3 else ''}); "
            f"record both runs from the same model configuration{said}")


def _differing_facts(reference: dict, candidate: dict, prefix: str = "") -> list[str]:
    """"name: ref vs cand" for each fact both state differently, nested dicts (parameter shapes) entry by entry."""
    found = []
    for name in sorted(set(reference) & set(candidate)):
        ref, cand = reference[name], candidate[name]
        if isinstance(ref, dict) and isinstance(cand, dict):
            found += _differing_facts(ref, cand, f"{prefix}{name}.")
            missing = sorted(set(ref) ^ set(cand))
            found += [f"{prefix}{name}.{key}: only in the {'reference' if key in ref else 'candidate'}" for key in missing]
        elif ref != cand:
            found.append(f"{prefix}{name}: {ref!r} vs {cand!r}")
    return found


def quantization_only(key: TensorKey) -> bool:
    """A tensor only a quantized run has: an fp8 linear's inverse scales (format.naming FP8_SCALE_MODULE)."""
    return fp8_scale_linear(key.fqn) is not None


def data_mismatch_finding(result: RunComparison) -> str | None:
    """Integer forward inputs (token ids, labels) come from the data loader, not from arithmetic: when
    the first divergence is one, the runs were fed different micro-batches and everything after it
    follows from that, so it is named as such instead of as a numerical error."""
    first = result.first_divergence
    if first is None or first.key.phase != "forward" or not first.key.slot.startswith("input") or \
            not (first.dtype or "").startswith(("int", "uint", "bool")):
        return None
    return (f"data-mismatch: {first.key} holds {first.dtype} inputs that differ from the reference's, so the runs "
            "were not fed the same micro-batches; the candidate's global micro-batch m (local micro-batch k of "
            "data-parallel rank r is m = k * dp + r) must be the reference's m-th (docs/your-own-script.md)")


def micro_batch_mismatch_finding(reference: RunReader, candidate: RunReader, steps: list[int]) -> str | None:
    """When a step's forward activations cover other global micro-batches in the candidate than in the reference,
    the runs' optimizer steps did not see the same data, and every difference after it follows from that: name the
    first such step, both runs' micro-batches, and the candidate's ranks and data-parallel size, instead of leaving
    it to hundreds of missing tensors and mismatches. None where they agree, or where a run recorded no forward
    activation of the step (a selection that leaves them out)."""
    covered = [_forward_micro_batches(reader) for reader in (reference, candidate)]
    differing = [step for step in steps if covered[0].get(step) and covered[1].get(step) and covered[0][step] != covered[1][step]]
    if not differing:
        return None
    step = differing[0]
    tracer = candidate.manifest.tracer
    size = tracer.get("data_parallel_size")
    ranks = candidate.manifest.world_size
    where = f"{ranks} rank{'' if ranks == 1 else 's'}" + (f", data-parallel size {size}" if isinstance(size, int) else "")
    more = f" (and {len(differing) - 1} more step{'' if len(differing) == 2 else 's'})" if len(differing) > 1 else ""
    return (f"micro-batch-mismatch: in step {step}{more} the reference ran global micro-batches "
            f"{_numbers(covered[0][step])}, the candidate {_numbers(covered[1][step])} ({where}), so the steps did not "
            "see the same data and the differences after it follow from that. The candidate's micro-batches per rank "
            "times its data-parallel size must equal the reference's micro-batches per step (local micro-batch k of "
            "data-parallel rank r is m = k * dp + r); a launcher that started fewer processes than asked, or a "
            "data-parallel size the tracer did not find (pass data_parallel=(rank, size) to attach), shows this way "
            "(docs/your-own-script.md)")


def _forward_micro_batches(reader: RunReader) -> dict[int, frozenset[int]]:
    """step -> the global micro-batches its forward activations were recorded for, over every rank."""
    found: dict[int, set[int]] = defaultdict(set)
    for key in reader.index:
        if key.phase == "forward":
            found[key.step].add(key.micro_batch)
    return {step: frozenset(micro_batches) for step, micro_batches in found.items()}


def _numbers(values: frozenset[int]) -> str:
    """0-3, or 0, 2, 5 where they are not consecutive."""
    ordered = sorted(values)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))


def shape_mismatch_message(key: TensorKey, reference: Layout, candidate: Layout) -> str:
    """Why the global shapes differ. A candidate recorded whole on every rank (no layout) whose shape is the
    reference's with one dim divided by k is a local shard whose layout the tracer never learned: say so,
    and what to declare, rather than a bare shape mismatch."""
    text = f"global shape {candidate.global_shape} in the candidate, {reference.global_shape} in the reference"
    dim = local_shard_dim(reference.global_shape, candidate.global_shape) if not candidate.mesh_shape else None
    if dim is None:
        return text
    parts = reference.global_shape[dim] // candidate.global_shape[dim]
    return (f"{text}: a local shard (1/{parts} of dim {dim}) recorded without its layout, as if whole. Declare it: "
            f"session.declare({key.fqn!r}, {key.slot!r}, [Shard({dim})], mesh) with the mesh it is sharded over, "
            "or pass the framework's plan to attach")


def local_shard_dim(reference_shape: tuple[int, ...], candidate_shape: tuple[int, ...]) -> int | None:
    """The one dim along which `candidate_shape` is an even fraction of `reference_shape`, else None."""
    if len(reference_shape) != len(candidate_shape):
        return None
    differing = [dim for dim, (r, c) in enumerate(zip(reference_shape, candidate_shape)) if r != c]
    if len(differing) != 1:
        return None
    dim = differing[0]
    reference_size, candidate_size = reference_shape[dim], candidate_shape[dim]
    return dim if 0 < candidate_size < reference_size and reference_size % candidate_size == 0 else None


def untraced_by_configuration(keys: list[TensorKey], manifest: RunManifest) -> list[TensorKey]:
    """The activations among `keys` (recorded by the other run) of modules this run's tracer configuration
    leaves out on purpose (`exclude`, `exclude_activations`: an adapter's blind spot, such as experts that
    compute on tokens dispatched from every rank): not compared, and not missing evidence either."""
    tracer = manifest.tracer or {}
    globs = [*tracer.get("exclude", ()), *tracer.get("exclude_activations", ())]
    if not globs:
        return []
    return [key for key in keys if key.phase in ("forward", "backward")
            and any(fnmatch.fnmatchcase(key.fqn, glob) for glob in globs)]


def compiled_output_gradients(keys: list[TensorKey], *manifests: RunManifest) -> list[TensorKey]:
    """The output gradients among `keys` (recorded by one run only) of modules a run compiled with their own hooks
    outside the compiled code (its tracer's `compiled_boundaries`). Compiled code hands its outputs gradients
    unlike eager autograd: a compiled root that computes its loss from its logits inside hands the logits none
    (the eager reference's tensor hook sees the loss's gradient pass through them), and an unused output of a
    tuple gets zeros where eager's backward hook says None. Not compared, and not missing evidence either."""
    globs = [glob for manifest in manifests for glob in (manifest.tracer or {}).get("compiled_boundaries", ())]
    if not globs:
        return []
    return [key for key in keys if key.phase == "backward" and key.slot.startswith("grad_output.")
            and any(fnmatch.fnmatchcase(key.fqn, glob) for glob in globs)]
