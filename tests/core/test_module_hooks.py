"""The module hooks (record/module_hooks.py): which tensors of a module's arguments and outputs they see."""

from collections import namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten

from ttrace_core.record.module_hooks import tensors_of

A, B, C = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
P = torch.nn.Parameter(torch.ones(4))
Pair = namedtuple("Pair", "first second")


@pytest.mark.parametrize(("values", "expected"), [
    (A, [A]),
    ((A, None, 3, B), [A, B]),
    ([A, 1.5, "mask", True, B], [A, B]),
    ((A, (B, None), [C]), [A, B, C]),
    ({"hidden": A, "mask": None, "extra": (B, C)}, [A, B, C]),
    (Pair(A, B), [A, B]),
    ((A, Pair(B, C)), [A, B, C]),
    ((), []),
    (None, []),
    ((P, 0), [P]),
], ids=["a tensor", "flat tuple with scalars", "flat list with scalars", "nested", "dict", "namedtuple",
        "namedtuple inside a tuple", "empty", "None", "a parameter"])
def test_tensors_of_finds_the_tensors_in_pytree_order(values, expected):
    found = tensors_of(values)
    assert [id(t) for t in found] == [id(t) for t in expected]
    assert [id(t) for t in found] == [id(leaf) for leaf in tree_flatten(values)[0] if isinstance(leaf, torch.Tensor)]
