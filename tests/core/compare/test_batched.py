"""compare/batched.py: many small tensors' value sums in one vectorized pass equal each tensor's own.

Every case of test_metrics.py is cut into small tensors of several shapes and dtypes, which are summed
in batches together (several batches, dtypes mixed) and each checked against the plain float64
reference implementation there: indices, counts and the mismatch count exactly, the norms to rounding.
A tensor holding NaN, Inf or values too large to square is handed back (None) for `value_sums`.
"""

from __future__ import annotations

import pytest
import torch

from ttrace_core.compare import batched
from ttrace_core.compare.batched import SMALL_ELEMENTS, SmallPair, batchable, batched_sums
from ttrace_core.compare.results import Tolerance
from tests.core.compare.test_metrics import CASES, TOL, assert_same_sums, reference_value_sums

def _pieces(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The case cut into tensors of at most SMALL_ELEMENTS, of growing sizes and of ranks 1 to 3."""
    actual, expected = CASES[name]()
    if expected.dim() == 0:
        return [(actual, expected)]
    actual, expected = actual.reshape(-1), expected.reshape(-1)
    pieces, start, size = [], 0, 7
    while start < expected.numel():
        stop = min(start + size, expected.numel())
        shape = (1, 3, -1) if (stop - start) % 6 == 0 else (2, -1) if (stop - start) % 2 == 0 else (-1,)
        pieces.append((actual[start:stop].reshape(shape), expected[start:stop].reshape(shape)))
        start, size = stop, min(SMALL_ELEMENTS, size * 3)
    return pieces


def _square_overflows(values: torch.Tensor) -> bool:
    values = values.double()
    return not torch.isfinite(values).all() or bool((values.abs() > 1e150).any())


BATCHABLE = [name for name in CASES if CASES[name]()[1].numel()]


@pytest.mark.parametrize("scales", [(1.0, 1.0), (1024.0, 3.0)], ids=["unscaled", "loss scales"])
def test_every_small_tensor_of_every_case_equals_the_float64_reference(scales, monkeypatch) -> None:
    monkeypatch.setattr(batched, "BATCH_ELEMENTS", 5000)  # many batches, the tensors of one split across none
    pairs = [(name, actual, expected) for name in BATCHABLE for actual, expected in _pieces(name)]
    found = batched_sums([SmallPair(actual, expected, *scales, TOL) for _, actual, expected in pairs])
    assert len({actual.dtype for _, actual, _ in pairs}) >= 4
    handed_back = 0
    for (name, actual, expected), sums in zip(pairs, found):
        assert batchable(expected.numel())
        if sums is None:
            assert _square_overflows(actual / scales[0]) or _square_overflows(expected / scales[1]), name
            handed_back += 1
            continue
        assert_same_sums(sums, reference_value_sums(actual, expected, TOL, scales=scales))
    assert 0 < handed_back < len(pairs) // 4


def test_each_tensor_is_counted_under_its_own_tolerance() -> None:
    expected = torch.tensor([1.0, 2.0, 4.0])
    actual = expected + torch.tensor([0.001, 0.01, 0.1])
    tolerances = [Tolerance(rel=rel, abs=0.0, source="test") for rel in (1e-4, 1e-2, 1.0)]
    found = batched_sums([SmallPair(actual, expected, 1.0, 1.0, tolerance) for tolerance in tolerances])
    assert [sums.num_mismatched for sums in found] == [3, 1, 0]  # allowed: rel * (1, 2, 4)


def test_ties_and_zeros_pick_what_argmax_picks_in_each_tensor() -> None:
    """The first index in row-major order of each tensor, though another tensor of the batch holds a larger value."""
    ties = (torch.tensor([[1.0, 1.5], [1.0, 1.5]]), torch.tensor([[1.0, 1.0], [1.0, 1.0]]))
    zeros = (torch.tensor([5.0, 1.5, 0.0]), torch.tensor([0.0, 1.0, 0.0]))
    equal = (torch.zeros(4), torch.zeros(4))
    first, second, third = batched_sums([SmallPair(a, e, 1.0, 1.0, TOL) for a, e in (ties, zeros, equal)])
    assert (first.max_abs, first.max_rel) == ((0.5, (0, 1)), (0.5, (0, 1)))
    assert (second.max_abs, second.max_rel) == ((5.0, (0,)), (0.5, (1,)))
    assert (third.max_abs, third.max_rel, third.num_mismatched) == ((0.0, (0,)), (0.0, (0,)), 0)


def test_a_tensor_gets_the_same_bits_alone_and_anywhere_in_a_batch() -> None:
    """So a row does not depend on the tensors it was batched with (partition.py's workers batch their share
    of the keys, and their rows must equal one worker's bit for bit)."""
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=generator) for n in (3, 17, 1000, 4096, 5, 333)]
    pairs = [SmallPair(t * (1 + 1e-6 * torch.randn(t.shape, generator=generator)), t, 1.0, 1.0, TOL) for t in tensors]
    alone = [batched_sums([pair])[0] for pair in pairs]
    for order in (pairs, pairs[::-1], pairs[2:] + pairs[:2]):
        together = dict(zip(map(id, order), batched_sums(order)))
        assert [together[id(pair)] for pair in pairs] == alone
