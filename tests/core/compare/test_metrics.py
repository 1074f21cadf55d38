"""compare/metrics.py: the chunked one-pass value sums equal a plain float64 reference implementation.

`reference_value_sums` below is the comparison as it was before the one-pass rewrite: both sides
promoted to float64 as whole tensors, loss scale undone, then the norms, largest differences and
mismatch count in separate passes. The chunked version must give the same numbers (norms within
float rounding: they are summed chunk by chunk) and the same indices and counts exactly, on values
chosen to break it, on slabs, and on every sample trace pair's whole table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ttrace_core.compare import bounded, engine, metrics
from ttrace_core.compare.batched import batched_sums
from ttrace_core.compare.engine import compare_runs
from ttrace_core.compare.exact_inputs import ExactInputs
from ttrace_core.compare.metrics import CHUNK_ELEMENTS, ValueSums, metrics_from_sums, value_sums
from ttrace_core.compare.results import Tolerance
from ttrace_core.compare.step_scalars import with_step_scalars
from ttrace_core.compare.tolerances import select_tolerances
from ttrace_core.format.reader import RunReader
from tests.support.paths import SAMPLES_DIR

TOL = Tolerance(rel=1e-5, abs=1e-7, source="test")
SAMPLES = json.loads((SAMPLES_DIR / "samples.json").read_text())


def reference_value_sums(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, *,
                         shape: tuple[int, ...] | None = None, offset: tuple[int, ...] | None = None,
                         scales: tuple[float, float] = (1.0, 1.0)) -> ValueSums:
    """The straightforward float64 comparison: whole tensors, masks, one pass per number."""
    actual, expected = actual.double() / scales[0], expected.double() / scales[1]
    sums = ValueSums(shape=shape or tuple(expected.shape), numel=expected.numel())
    if not expected.numel():
        return sums
    sums.num_nan = (int(torch.isnan(actual).sum()), int(torch.isnan(expected).sum()))
    sums.num_inf = (int(torch.isinf(actual).sum()), int(torch.isinf(expected).sum()))
    both_finite = torch.isfinite(actual) & torch.isfinite(expected)
    diff = torch.where(both_finite, actual - expected, 0.0)
    finite_expected = torch.where(both_finite, expected, 0.0)
    sums.abs_error = float(torch.linalg.vector_norm(diff))
    sums.reference_norm = float(torch.linalg.vector_norm(finite_expected))
    abs_diff, magnitude = diff.abs().flatten(), finite_expected.abs().flatten()
    rel_diff = abs_diff / torch.where(magnitude == 0, math.inf, magnitude).clamp_min(torch.finfo(torch.float64).tiny)

    def placed(flat_index: int) -> tuple[int, ...]:
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), expected.shape)) if expected.dim() else ()
        return index if offset is None else tuple(i + o for i, o in zip(index, offset))

    position, rel_position = int(abs_diff.argmax()), int(rel_diff.argmax())
    sums.max_abs = (float(abs_diff[position]), placed(position))
    sums.max_rel = (float(rel_diff[rel_position]), placed(rel_position))
    sums.num_mismatched = int((abs_diff > tolerance.abs + tolerance.rel * magnitude).sum())
    return sums


def assert_same_sums(found: ValueSums, expected: ValueSums) -> None:
    """Equal but for the norms, which may differ by rounding (summed chunk by chunk)."""
    for name in ("shape", "numel", "num_nan", "num_inf", "max_abs", "max_rel", "num_mismatched"):
        assert getattr(found, name) == getattr(expected, name), name
    for name in ("abs_error", "reference_norm"):
        assert getattr(found, name) == pytest.approx(getattr(expected, name), rel=1e-12, abs=0.0), name


def _noisy(numel: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    expected = torch.randn(numel, generator=generator, dtype=torch.float64)
    actual = expected * (1 + 1e-6 * torch.randn(numel, generator=generator, dtype=torch.float64))
    return actual.to(dtype), expected.to(dtype)


def _with_nonfinite(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    actual, expected = _noisy(3 * CHUNK_ELEMENTS + 17, dtype, 1)
    actual[[5, CHUNK_ELEMENTS + 3]] = math.nan
    expected[[9, 2 * CHUNK_ELEMENTS]] = math.inf
    actual[2 * CHUNK_ELEMENTS] = math.inf  # Inf on both sides at one place: counted, not compared
    expected[-1] = -math.inf
    return actual, expected


def _zeros_in_reference() -> tuple[torch.Tensor, torch.Tensor]:
    """Where the reference is 0 the relative difference is 0, however large the absolute one."""
    actual, expected = _noisy(CHUNK_ELEMENTS + 100, torch.float32, 2)
    expected[::3] = 0.0
    actual[::6] = 0.0
    actual[3] = 1e3  # the largest absolute difference, at a zero of the reference
    return actual, expected


def _denormals() -> tuple[torch.Tensor, torch.Tensor]:
    tiny32 = torch.finfo(torch.float32).smallest_normal
    expected = torch.tensor([tiny32 / 8, tiny32 / 1024, 0.0, 1.0, tiny32 * 2], dtype=torch.float32)
    actual = torch.tensor([tiny32 / 4, tiny32 / 1024, tiny32 / 2, 1.0, tiny32], dtype=torch.float32)
    return actual, expected


def _huge_fp32() -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of squares of 1e30 (1e60) exceed float32, not float64: no overflow, all counted."""
    actual, expected = _noisy(1000, torch.float32, 3)
    return actual * 1e30, expected * 1e30


def _bf16_max() -> tuple[torch.Tensor, torch.Tensor]:
    largest = torch.finfo(torch.bfloat16).max
    expected = torch.tensor([largest, -largest, 1.0, 0.0], dtype=torch.bfloat16)
    actual = torch.tensor([-largest, -largest, 1.0078125, 0.5], dtype=torch.bfloat16)
    return actual, expected


def _float64_beyond_1e154() -> tuple[torch.Tensor, torch.Tensor]:
    """Finite float64 values whose squares overflow: the norm is inf in both implementations."""
    expected = torch.tensor([1e200, 1.0, -3e160], dtype=torch.float64)
    return torch.tensor([1.1e200, 1.0, -3e160], dtype=torch.float64), expected


def _ties() -> tuple[torch.Tensor, torch.Tensor]:
    """Equal largest differences in several chunks: the first in row-major order wins."""
    expected = torch.ones(4 * CHUNK_ELEMENTS, dtype=torch.float32)
    actual = expected.clone()
    actual[[CHUNK_ELEMENTS + 7, 3 * CHUNK_ELEMENTS, 2 * CHUNK_ELEMENTS - 1]] = 1.5
    return actual.reshape(4, 256, -1), expected.reshape(4, 256, -1)


def _equal_with_zeros() -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.zeros(2 * CHUNK_ELEMENTS, dtype=torch.float16)
    values[CHUNK_ELEMENTS:] = 2.0
    return values.clone(), values


def _integers() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(20, dtype=torch.int64).reshape(4, 5), torch.arange(20, dtype=torch.int64).reshape(4, 5).flip(0)


CASES = {
    "fp32 noise over 3 chunks": lambda: _noisy(3 * CHUNK_ELEMENTS + 5, torch.float32, 0),
    "bf16 noise": lambda: _noisy(5000, torch.bfloat16, 4),
    "fp32 NaN and Inf": lambda: _with_nonfinite(torch.float32),
    "fp16 NaN and Inf": lambda: _with_nonfinite(torch.float16),
    "zeros in the reference": _zeros_in_reference,
    "fp32 denormals": _denormals,
    "fp32 1e30": _huge_fp32,
    "bf16 max": _bf16_max,
    "fp64 beyond 1e154": _float64_beyond_1e154,
    "ties across chunks": _ties,
    "equal, zeros and values": _equal_with_zeros,
    "int64": _integers,
    "scalar": lambda: (torch.tensor(2.0), torch.tensor(1.5)),
    "empty": lambda: (torch.empty(0, 3), torch.empty(0, 3)),
}


@pytest.mark.parametrize("name", CASES, ids=list(CASES))
def test_one_pass_equals_the_float64_reference(name: str) -> None:
    actual, expected = CASES[name]()
    assert_same_sums(value_sums(actual, expected, TOL), reference_value_sums(actual, expected, TOL))


@pytest.mark.parametrize("scales", [(1.0, 1.0), (1024.0, 65536.0), (3.0, 0.5)], ids=str)
def test_loss_scales_are_undone_before_comparing(scales: tuple[float, float]) -> None:
    actual, expected = _with_nonfinite(torch.float32)
    found = value_sums(actual, expected, TOL, scales=scales)
    assert_same_sums(found, reference_value_sums(actual, expected, TOL, scales=scales))


def test_ties_pick_the_first_index_in_row_major_order() -> None:
    actual, expected = _ties()
    found = value_sums(actual, expected, TOL)
    assert found.max_abs == (0.5, (1, 0, 7))
    assert found.max_rel == (0.5, (1, 0, 7))
    assert found.num_mismatched == 3


def test_relative_difference_is_zero_where_the_reference_is_zero() -> None:
    found = value_sums(torch.tensor([5.0, 1.5, 0.0]), torch.tensor([0.0, 1.0, 0.0]), TOL)
    assert found.max_abs == (5.0, (0,))
    assert found.max_rel == (0.5, (1,))
    assert found.num_mismatched == 2


def test_nonfinite_values_are_counted_and_left_out() -> None:
    found = value_sums(torch.tensor([math.nan, 1.0, math.inf, 4.0]), torch.tensor([1.0, math.inf, math.inf, 2.0]), TOL)
    assert (found.num_nan, found.num_inf) == ((1, 0), (1, 2))
    assert (found.abs_error, found.reference_norm, found.max_abs, found.num_mismatched) == (2.0, 2.0, (2.0, (3,)), 1)


@pytest.mark.parametrize("actual, expected, apart", [
    ([math.nan, 1.0], [1.0, math.nan], 2),             # the same counts in other places
    ([math.nan, 1.0], [math.nan, 1.0], 0),
    ([math.inf, 1.0], [-math.inf, 1.0], 1),            # an Inf of the other sign
    ([math.inf, -math.inf], [math.inf, -math.inf], 0),
    ([math.nan, 2.0], [math.inf, 2.0], 1),
], ids=["nan swapped", "nan alike", "inf sign", "inf alike", "nan for inf"])
def test_nonfinite_values_in_other_places_are_counted(actual, expected, apart) -> None:
    found = value_sums(torch.tensor(actual), torch.tensor(expected), TOL)
    assert found.num_nonfinite_apart == apart


def test_nan_in_other_places_fails_though_the_counts_agree(tmp_path) -> None:
    from ttrace_core.compare.engine import _verdict

    metrics = metrics_from_sums(value_sums(torch.tensor([math.nan, 1.0]), torch.tensor([1.0, math.nan]), TOL), TOL)
    status, message = _verdict(metrics, None, TOL)
    assert status == "nonfinite" and message.startswith("NaN/Inf in other places: 2 elements")


@pytest.mark.parametrize("name", ["fp32 NaN and Inf", "ties across chunks", "zeros in the reference"])
def test_slabs_add_up_to_the_whole_tensor(name: str) -> None:
    actual, expected = CASES[name]()
    usable = actual.numel() // 8 * 8
    actual, expected = actual.flatten()[:usable].reshape(8, -1), expected.flatten()[:usable].reshape(8, -1)
    shape = tuple(expected.shape)
    sums = ValueSums(shape=shape)
    for start in range(0, 8, 3):  # slabs of 3, 3 and 2 rows
        sums.add(value_sums(actual[start:start + 3], expected[start:start + 3], TOL, shape=shape, offset=(start, 0)))
    assert_same_sums(sums, reference_value_sums(actual, expected, TOL))


def _table(reference_dir: Path, candidate_dir: Path) -> list[dict]:
    """Every row of `ttrace compare REF CAND`'s table, field by field."""
    with RunReader(reference_dir) as reference, RunReader(candidate_dir) as candidate:
        result = compare_runs(reference, candidate, select_tolerances("auto", reference, candidate))
    return [{field.name: getattr(row, field.name) for field in dataclasses.fields(row)} for row in result.comparisons]


def _assert_same_rows(found: list[dict], expected: list[dict]) -> None:
    assert len(found) == len(expected)
    for found_row, expected_row in zip(found, expected):
        assert found_row.keys() == expected_row.keys()
        for name, value in expected_row.items():
            if isinstance(value, float) and math.isfinite(value):
                assert found_row[name] == pytest.approx(value, rel=1e-9, abs=1e-300), (expected_row["key"], name)
            elif name != "message":  # the message prints ratios to 3 digits: checked through them
                assert found_row[name] == value, (expected_row["key"], name)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s["name"] for s in SAMPLES])
def test_sample_tables_equal_the_float64_reference(sample: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    reference_dir = SAMPLES_DIR / (sample["reference"] or sample["name"])
    batches = []
    monkeypatch.setattr(engine, "batched_sums", lambda pairs: batches.append(len(pairs)) or batched_sums(pairs))
    found = _table(reference_dir, SAMPLES_DIR / sample["name"])
    assert sum(batches) > 0  # its small tensors were summed in batches (batched.py)
    monkeypatch.setattr(engine, "batchable", lambda numel: False)  # every tensor alone, by the reference
    monkeypatch.setattr(engine, "value_sums", reference_value_sums)
    monkeypatch.setattr(bounded, "value_sums", reference_value_sums)
    expected = _table(reference_dir, SAMPLES_DIR / sample["name"])
    assert metrics.value_sums is not reference_value_sums  # (the patch reached the callers only)
    _assert_same_rows(found, expected)


@pytest.mark.parametrize("actual, expected, relative", [
    (1.5, 1.0, 0.5), (0.0, 0.0, 0.0), (1.0, 0.0, 0.0), (-2.0, 4.0, 1.5),
], ids=["plain", "both zero", "reference zero", "negative"])
def test_the_table_and_the_tensor_page_give_one_relative_difference(actual, expected, relative) -> None:
    """The table's max_rel_diff (value_sums) and the tensor page's worst elements (service/tensor_view.py)
    agree: 0 where the reference is 0, never inf on one page and 0 on the other (issue 42, defect 6)."""
    import numpy as np

    from ttrace_core.service.tensor_view import _worst_elements

    sums = value_sums(torch.tensor([actual], dtype=torch.float64), torch.tensor([expected], dtype=torch.float64), TOL)
    (worst,) = _worst_elements(np.array([expected]), np.array([actual]), np.array([abs(actual - expected)]), 1)
    assert sums.max_rel[0] == worst["rel_diff"] == relative



def test_compare_runs_torch_on_one_thread_and_gives_the_thread_count_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's BLAS pool (the sums of squares) and torch's OpenMP pool starved each other on a small machine
    (43.5 s against 0.9 s, compare_throughput.md): every value sum runs with torch on one thread, and the
    caller's thread count is back after, also when comparing fails."""
    seen: list[tuple[str, int]] = []
    real_sums, real_batched = engine.value_sums, engine.batched_sums
    monkeypatch.setattr(engine, "value_sums",
                        lambda *a, **k: seen.append(("one", torch.get_num_threads())) or real_sums(*a, **k))
    monkeypatch.setattr(engine, "batched_sums",
                        lambda *a, **k: seen.append(("batched", torch.get_num_threads())) or real_batched(*a, **k))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with RunReader(SAMPLES_DIR / "fp32" / "reference") as reference, \
                RunReader(SAMPLES_DIR / "fp32" / "tp2_sp_clean") as candidate:
            compare_runs(reference, candidate)
            assert torch.get_num_threads() == 2
            monkeypatch.setattr(engine, "tally_coverage", lambda *a, **k: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                compare_runs(reference, candidate)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen and {threads for _, threads in seen} == {1}


def _reads_counted(monkeypatch: pytest.MonkeyPatch) -> tuple[set, list]:
    """(the keys `prepare_small` summed ahead, the keys `assemble_pair` read and assembled), as comparing goes;
    structure tests, which need a tensor's values, left out."""
    monkeypatch.setattr(engine, "_has_structure_tests", lambda *args: False)
    ahead: set = set()
    again: list = []
    real_prepare, real_assemble = engine.prepare_small, engine.assemble_pair
    monkeypatch.setattr(engine, "prepare_small", lambda *a: (ready := real_prepare(*a)) and ahead.update(ready) or ready)
    monkeypatch.setattr(engine, "assemble_pair", lambda key, *a: again.append(key) or real_assemble(key, *a))
    return ahead, again


@pytest.mark.parametrize("sample", ["bf16/tp2_sp_clean", "fp8/tp2_clean"])
def test_small_tensors_summed_ahead_are_judged_with_those_sums(sample: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each small tensor's sums are taken ahead in a batch under its own row's tolerance, whatever the dtypes of
    the others in its window: its row uses them instead of reading and summing it again (structure tests, which
    need its values, left out here)."""
    ahead, again = _reads_counted(monkeypatch)
    with RunReader(SAMPLES_DIR / sample.split("/")[0] / "reference") as reference, \
            RunReader(SAMPLES_DIR / sample) as candidate:
        dtypes = {metas[0].dtype for metas in candidate.index.values()}
        compare_runs(reference, candidate, exact_inputs_k=None)
    assert len(dtypes) > 1 and len(ahead) > 100 and not ahead.intersection(again), (dtypes, len(ahead.intersection(again)))


@pytest.mark.parametrize("sample", ["bf16/tp2_sp_clean", "fp8/tp2_clean"])
def test_small_tensors_the_exact_inputs_rule_tightens_are_judged_with_sums_taken_ahead(
        sample: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the exact-inputs rule on (derived tolerances: the reference's perturbation estimate), a
    small tensor whose tolerance the rule tightens when its turn comes is judged with sums taken ahead under that
    tolerance too, not read and summed again alone; the rows equal those of a comparison that sums every tensor
    alone. (The rule is made to apply wherever it could: these samples record every module's inputs, which TP
    changes, so it rarely does.)"""
    monkeypatch.setattr(ExactInputs, "applies", lambda self, key: self.partial_terms(key, 1) is not None)
    ahead, again = _reads_counted(monkeypatch)
    with RunReader(SAMPLES_DIR / sample.split("/")[0] / "reference") as reference, \
            RunReader(SAMPLES_DIR / sample) as candidate:
        tolerances = with_step_scalars(select_tolerances("auto", reference, candidate), reference, candidate)
        rows = compare_runs(reference, candidate, tolerances)
        judged = {row.key for row in rows.comparisons if row.status != "mismatch"}  # (a mismatch is judged again)
        read_again = set(again)
        monkeypatch.setattr(engine, "window_sums", lambda *args, **kwargs: {})  # every tensor read and summed alone
        alone = compare_runs(reference, candidate, tolerances)
    tightened = {row.key for row in rows.comparisons if row.tolerance is not None and row.tolerance.method == "exact-inputs"}
    assert len(tightened & ahead) > 20 and not ahead & judged & read_again, \
        (len(tightened & ahead), len(ahead & judged & read_again))
    assert rows.to_dict()["comparisons"] == alone.to_dict()["comparisons"]


def test_a_shape_row_from_assembling_is_returned_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor whose assembled values differ in shape though its metadata agree is a SHAPE row, not an error."""
    def shape_row(key, reference, candidate):
        return engine.TensorComparison(key=key, status=engine.ComparisonStatus.SHAPE, message="shapes differ")
    monkeypatch.setattr(engine, "window_sums", lambda *args, **kwargs: {})  # every tensor assembled alone
    monkeypatch.setattr(engine, "assemble_pair", shape_row)
    with RunReader(SAMPLES_DIR / "fp32" / "reference") as reference, \
            RunReader(SAMPLES_DIR / "fp32" / "tp2_sp_clean") as candidate:
        rows = compare_runs(reference, candidate).comparisons
    assert rows and {str(row.status) for row in rows if row.message == "shapes differ"} == {"shape"}
    assert sum(row.message == "shapes differ" for row in rows) > 100
