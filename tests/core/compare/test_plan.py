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


def test_a_low_precision_pair_judged_by_the_flat_dtype_table_is_told_what_that_misses(tmp_path):
    """bf16 without the reference's estimate: the dtype table's bf16 row judges every tensor, and a note says how
    wide it is and what `ttrace estimate` adds; with the estimate, or in fp32, no such note."""
    import shutil

    reference_dir = tmp_path / "reference"
    shutil.copytree(SAMPLES_DIR / "bf16" / "reference", reference_dir)
    (reference_dir / "tolerance_estimate.json").unlink()
    pairs = {"bf16 without estimate": (reference_dir, SAMPLES_DIR / "bf16" / "tp2_sp_clean"),
             "bf16 with estimate": (SAMPLES_DIR / "bf16" / "reference", SAMPLES_DIR / "bf16" / "tp2_sp_clean"),
             "fp32": (SAMPLES_DIR / "fp32" / "reference", SAMPLES_DIR / "fp32" / "tp2_sp_clean")}
    found = {}
    for name, (reference_path, candidate_path) in pairs.items():
        with RunReader(reference_path) as reference, RunReader(candidate_path) as candidate:
            result, _ = plan_comparison(reference, candidate)
        found[name] = [note for note in result.notes if note.startswith("tolerances: the flat")]
    assert found["bf16 with estimate"] == [] and found["fp32"] == []
    assert len(found["bf16 without estimate"]) == 1
    assert "bf16 row of the dtype table (relative 0.04 on every tensor)" in found["bf16 without estimate"][0]
    assert f"`ttrace estimate {reference_dir}`" in found["bf16 without estimate"][0]
