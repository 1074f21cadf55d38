"""Part of stage 3 (compare): what a comparison of two runs will compare, decided from their indexes alone (no
value read): the steps both completed, the keys both recorded in execution order, the candidate's extras, the
tolerances and the notes (partial steps, modules a tracer left out, a mapped reference's precision choices).
`engine.compare_runs` fills the rows in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ttrace_core.compare.evidence import (
    check_comparable, compiled_output_gradients, unmapped_candidate_keys, unrecorded_keys, untraced_by_configuration,
)
from ttrace_core.compare.results import RunComparison
from ttrace_core.compare.step_scalars import with_step_scalars
from ttrace_core.compare.tolerances import (
    DEFAULT_EXACT_INPUTS_K, LOW_PRECISIONS, ToleranceProvider, fixed_tolerances_note, flat_table, select_tolerances,
)
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import RunManifest, TensorKey, TensorMeta


def _execution_order(key: TensorKey, metas: list[TensorMeta]) -> tuple:
    """Where `key` ran in its step: its phase and micro-batch, then the first of its shards' recording order."""
    return (*key.execution_order(), metas[0].seq if len(metas) == 1 else min(m.seq for m in metas))


@dataclass(kw_only=True, slots=True)
class ComparePlan:
    """What a comparison of two runs will compare, decided from their indexes alone (no value read)."""

    ordered: list[TensorKey]
    """The reference's keys of the compared steps, in execution order."""
    common: set[TensorKey]
    extras: list[TensorKey]
    """Keys only the candidate recorded."""
    tolerances: ToleranceProvider
    exact_inputs_k: float | None
    ignore_dtype: bool
    max_bytes: int | None = None
    """Budget of one tensor's comparison in bytes (bounded.py); None: unbounded."""
    compared_whole: dict[TensorKey, int] = field(default_factory=dict)
    """Tensors over the budget that could not be cut into slabs -> the bytes their comparison took."""
    unmapped: dict[TensorKey, str] = field(default_factory=dict)
    """The candidate's tensors a mapped reference's correspondence map declares without counterpart -> why."""

    @property
    def to_compare(self) -> list[TensorKey]:
        return [key for key in self.ordered if key in self.common]


def plan_comparison(reference: RunReader, candidate: RunReader, tolerances: ToleranceProvider | None = None, *,
                    ignore_dtype: bool = False, exact_inputs_k: float | None = DEFAULT_EXACT_INPUTS_K,
                    partial: bool = False, max_bytes: int | None = None) -> tuple[RunComparison, ComparePlan]:
    """The comparison's frame (runs, steps, notes) and its plan; `compare_runs` fills the rows in."""
    check_comparable(reference, candidate)
    tolerances = tolerances or with_step_scalars(select_tolerances("auto", reference, candidate), reference, candidate)
    crossed = reference.manifest.precision != candidate.manifest.precision
    if flat_table(tolerances) is not None or crossed:
        exact_inputs_k = None  # across precisions exact inputs still give results that differ by the quantization
    result = RunComparison(reference=str(reference.run_dir), candidate=str(candidate.run_dir), partial_allowed=partial)
    steps = sorted(set(reference.complete_steps) & set(candidate.complete_steps))
    for name, reader in (("reference", reference), ("candidate", candidate)):
        for step, why in sorted(reader.partial_steps.items()):
            result.notes.append(f"{name} step {step} is partial and was not compared: {why}")
        for step in sorted(set(reader.complete_steps) - set(steps)):
            if step not in reference.partial_steps and step not in candidate.partial_steps:
                result.notes.append(f"{name} step {step} has no counterpart in the other run and was not compared")
    result.steps_compared = steps
    unrecorded = unrecorded_keys(reference, candidate)  # counted as not compared by the coverage block
    ref_keys, cand_keys = (_keys_compared(reader, steps, unrecorded) for reader in (reference, candidate))
    ref_set, cand_set = set(ref_keys), set(cand_keys)
    for name, run, others in (("candidate", candidate, ref_set - cand_set), ("reference", reference, cand_set - ref_set)):
        if skipped := set(untraced_by_configuration(sorted(others), run.manifest)):
            ref_keys, cand_keys = [k for k in ref_keys if k not in skipped], [k for k in cand_keys if k not in skipped]
            ref_set, cand_set = ref_set - skipped, cand_set - skipped
            result.notes.append(f"{len(skipped)} activations of modules the {name}'s tracer configuration leaves out "
                                f"(exclude / exclude_activations, e.g. {min(skipped)}) were not compared")
    if hidden := set(compiled_output_gradients(sorted(ref_set ^ cand_set), reference.manifest, candidate.manifest)):
        ref_keys, cand_keys = [k for k in ref_keys if k not in hidden], [k for k in cand_keys if k not in hidden]
        ref_set, cand_set = ref_set - hidden, cand_set - hidden
        result.notes.append(f"{len(hidden)} output gradients of compiled modules recorded by one run only were not "
                            "compared: compiled code hands its outputs gradients unlike eager autograd "
                            f"(compiled_boundaries; e.g. {min(hidden)})")
    unmapped = unmapped_candidate_keys(sorted(cand_set - ref_set), reference.manifest) \
        if reference.manifest.correspondence else {}
    if unmapped:  # declared without counterpart by the mapped reference's map: listed by coverage, not compared
        cand_keys = [k for k in cand_keys if k not in unmapped]
        cand_set = cand_set.difference(unmapped)
    result.notes += precision_choices(reference.manifest, candidate.manifest)
    if (note := fixed_tolerances_note(tolerances, reference, candidate)) is not None:
        result.notes.append(note)
    common = ref_set & cand_set
    # A mapped reference (another implementation's run, docs/porting.md) has its own order of computation:
    # the first divergence is the first in the candidate's order.
    order_by = candidate.index if reference.manifest.correspondence else reference.index
    ordered = sorted(ref_keys, key=lambda k: _execution_order(k, order_by.get(k) or reference.index[k]))
    plan = ComparePlan(unmapped=unmapped, ordered=ordered, common=common,
                       extras=sorted(cand_set - common, key=lambda k: _execution_order(k, candidate.index[k])),
                       tolerances=tolerances, exact_inputs_k=exact_inputs_k or None, ignore_dtype=ignore_dtype,
                       max_bytes=max_bytes)
    return result, plan


def _keys_compared(reader: RunReader, steps: list[int], unrecorded: set[TensorKey]) -> list[TensorKey]:
    """The keys of `reader` in `steps` that no tracer left out; all of them, as the index holds them (its dict
    keeps each key's hash, which the sets built from it reuse), when every complete step is compared."""
    if not unrecorded and set(reader.complete_steps) <= set(steps):
        return list(reader.index)
    return [k for k in reader.index if k.step in steps and k not in unrecorded]


def precision_choices(reference: RunManifest, candidate: RunManifest) -> list[str]:
    """The named findings of a comparison with a reference of another implementation run in low precision: each
    module the map says the two implementations compute at different precisions (its [[precision]] table).
    Their tensors differ by that choice as well as by round-off, by design of the implementations; in fp32
    the choices vanish below the tolerance and nothing is said."""
    mapping = reference.correspondence
    if not mapping or not {reference.precision, candidate.precision} & set(LOW_PRECISIONS):
        return []
    return [f"precision-choice: {choice['candidate']} computes in {choice['candidate_computes']} in the candidate, "
            f"{choice['reference']} in {choice['reference_computes']} in the reference (map {mapping.get('map')}); "
            "its tensors differ by that choice as well as by round-off"
            for choice in mapping.get("precision", [])]
