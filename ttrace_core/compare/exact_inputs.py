"""Which recorded tensors a tensor is computed from: the exact-inputs rule of stage 3 (compare).

A module whose inputs and parameters are bitwise equal to the reference's can only differ by its
own arithmetic (a different reduction order, one more rounding of a partial sum): none of the
round-off that separates two layouts upstream reaches it. Its results are then judged at depth 0
of the theorem, k * sqrt(n) * eps for a result combined from n partial results (one per rank, and
per micro-batch for a reduced gradient), however deep the module sits; the perturbation estimate, which assumes
upstream noise, would be far looser there (in fp8 a bf16-sized perturbation moves every amax,
so the whole tensor is requantized).

`ExactInputs` walks the comparisons in execution order and answers, for the next tensor, whether
everything it is computed from was exact:

- forward `M / output.*` of (step, micro-batch): every recorded forward input of M and of the
  modules inside M (state a module hands to a child, such as an fp8 scale, is caught there), and
  every module inside M that owns parameters must have been traced in that micro-batch (MoE
  experts are not: the tokens they see, hence their fp8 scales, depend on the layout);
- backward `M / grad_input.*`: the same forward inputs, plus every recorded grad_output of M's
  subtree in that micro-batch;
- `grad / P`: the forward inputs and grad_outputs of P's module in every micro-batch of the step
  (at least one grad_output must be recorded: no evidence, no rule);
- in every case, the parameters of the module's subtree at the start of the step: equal by the
  method's premise at step 0 (both runs start from the same logical weights); in a later step,
  every one of them recorded after the previous step must have been exact (a trace that starts
  at step 5, or holds no parameter values, gets no rule there).

Post-step parameters are never judged this way: the optimizer state is not recorded. Nor are the
pseudo-modules' scalars (format.naming LOSS_FUNCTION, GRADIENT_CLIPPING: slot family "scalar"), and
they are no module's inputs: only "input" and "grad_output" slots are sources.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ttrace_core.format.naming import SubtreeIndex, owner_of, slot_family
from ttrace_core.format.schema import NO_MICRO_BATCH, TensorKey

# The slot families a tensor's value is computed from, and the phase each is recorded in.
SOURCE_PHASES = {"input": "forward", "grad_output": "backward"}
_NO_SOURCES: SubtreeIndex[TensorKey] = SubtreeIndex(())


class ExactInputs:
    """Tracks which compared tensors were bitwise exact and applies the rule above. A question costs the
    size of the module's subtree, not of the run: the sources, the parameter owners and the parameters are
    indexed by module name (naming.SubtreeIndex), and what does not change as tensors are marked (which
    modules with parameters were traced) is answered once per module and micro-batches."""

    def __init__(self, keys: Iterable[TensorKey]) -> None:
        keys_list = list(keys)
        sources: dict[tuple[int, int], list[tuple[str, TensorKey]]] = defaultdict(list)
        params: dict[int, list[tuple[str, TensorKey]]] = defaultdict(list)
        self._micro_batches: dict[int, set[int]] = defaultdict(set)
        for key in keys_list:
            if key.phase == "param":
                params[key.step].append((owner_of(key.fqn), key))
            elif key.micro_batch != NO_MICRO_BATCH:
                self._micro_batches[key.step].add(key.micro_batch)
                if SOURCE_PHASES.get(slot_family(key.slot)) == key.phase:  # (only sources are ever asked about)
                    sources[key.step, key.micro_batch].append((key.fqn, key))
        self._sources = {place: SubtreeIndex(found) for place, found in sources.items()}
        self._params = {step: SubtreeIndex(found) for step, found in params.items()}
        self._exact: set[TensorKey] = set()
        self._param_owners = SubtreeIndex((owner, owner) for owner in {owner_of(k.fqn) for k in keys_list
                                                                         if k.phase in ("grad", "param")})
        self._traced = {(k.step, k.micro_batch, k.fqn) for k in keys_list if k.phase == "forward"}
        self._untraced_inside: dict[tuple[int, tuple[int, ...], str], bool] = {}

    def mark(self, key: TensorKey, exact: bool) -> None:
        if exact:
            self._exact.add(key)

    def num_partial_terms(self, key: TensorKey, world_size: int) -> int | None:
        """None when the rule does not apply; else how many partial results `key` may combine: one
        per rank (a row-parallel GEMM, a sequence-parallel gradient), and for a reduced gradient one
        per rank and micro-batch."""
        return self.partial_terms(key, world_size) if self.applies(key) else None

    def partial_terms(self, key: TensorKey, world_size: int) -> int | None:
        """How many partial results `key` would combine were the rule to apply; None for a key it never applies
        to (known before the keys ahead of it are compared, unlike whether it applies)."""
        if key.phase == "grad":
            return world_size * len(self._micro_batches[key.step]) if self._micro_batches.get(key.step) else None
        if (key.phase == "forward" and slot_family(key.slot) == "output") or \
                (key.phase == "backward" and slot_family(key.slot) == "grad_input"):
            return world_size
        return None

    def applies(self, key: TensorKey) -> bool:
        """Whether everything `key` is computed from was recorded and exact."""
        if key.phase == "forward" and slot_family(key.slot) == "output":
            return self._module_exact(key.step, [key.micro_batch], key.fqn, ("input",))
        if key.phase == "backward" and slot_family(key.slot) == "grad_input":
            return self._module_exact(key.step, [key.micro_batch], key.fqn, ("input", "grad_output"))
        if key.phase == "grad":
            micro_batches = sorted(self._micro_batches[key.step])
            return self._module_exact(key.step, micro_batches, owner_of(key.fqn), ("input", "grad_output"),
                                      needs_grad_output=True)
        return False

    def _module_exact(self, step: int, micro_batches: list[int], module: str, families: tuple[str, ...], *,
                      needs_grad_output: bool = False) -> bool:
        if not micro_batches or not self._params_exact(step, module):
            return False
        if self._untraced_owner_inside(step, micro_batches, module):
            return False  # an untraced module with weights inside (MoE experts): its scales are out of sight
        saw_grad_output = False
        for micro_batch in micro_batches:
            for dep in self._sources.get((step, micro_batch), _NO_SOURCES).within(module):
                if slot_family(dep.slot) not in families:
                    continue
                if dep not in self._exact:
                    return False
                saw_grad_output |= dep.phase == "backward" and dep.fqn == module
        return saw_grad_output or not needs_grad_output

    def _untraced_owner_inside(self, step: int, micro_batches: list[int], module: str) -> bool:
        """Whether a module owning parameters inside `module` went untraced in one of the micro-batches."""
        place = (step, tuple(micro_batches), module)
        if (found := self._untraced_inside.get(place)) is None:
            found = self._untraced_inside[place] = any(
                (step, micro_batch, owner) not in self._traced for owner in self._param_owners.within(module)
                for micro_batch in micro_batches)
        return found

    def _params_exact(self, step: int, module: str) -> bool:
        if step == 0:
            return True  # the method's premise: both runs start the first iteration from the same weights
        previous = self._params.get(step - 1)
        if not previous:
            return False
        return all(p in self._exact for p in previous.within(module))
