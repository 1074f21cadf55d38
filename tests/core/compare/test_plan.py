"""compare/plan.py: what a comparison will compare, decided from the two indexes alone."""

from __future__ import annotations

from ttrace_core.compare import plan as plan_module
from ttrace_core.compare.plan import plan_comparison
from ttrace_core.format.reader import RunReader
from tests.support.paths import SAMPLES_DIR


def _pair():
    return RunReader(SAMPLES_DIR / "fp32" / "reference"), RunReader(SAMPLES_DIR / "fp32" / "tp2_sp_clean")


def test_the_reference_keys_in_execution_order_and_the_common_ones():
    reference, candidate = _pair()
    with reference, candidate:
        result, plan = plan_comparison(reference, candidate)
        order = [(*key.execution_order(), min(m.seq for m in reference.index[key])) for key in plan.ordered]
        assert order == sorted(order) and set(plan.ordered) == set(reference.index)
        assert plan.common == set(reference.index) & set(candidate.index)
        assert set(plan.extras) == set(candidate.index) - set(reference.index)
        assert result.steps_compared == [0] and plan.to_compare == [k for k in plan.ordered if k in plan.common]


def test_keys_compared_are_those_of_the_compared_steps_no_tracer_left_out():
    reference, _ = _pair()
    with reference:
        keys = list(reference.index)
        left_out = set(keys[::7])
        assert plan_module._keys_compared(reference, [0], set()) == keys  # every step compared, nothing left out
        assert plan_module._keys_compared(reference, [0], left_out) == [k for k in keys if k not in left_out]
        assert plan_module._keys_compared(reference, [1], set()) == []  # step 0 not compared
