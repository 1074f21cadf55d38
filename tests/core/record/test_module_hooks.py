"""The module hooks (record/module_hooks.py): which tensors of a module's arguments and outputs they see."""

import contextlib
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


def _llama_gradients(tmp_path, traced: bool) -> dict[str, torch.Tensor]:
    """One backward of a tiny Hugging Face Llama (a residual stream: every layer's input feeds its attention or
    MLP and the skip connection), with the Tracer's hooks attached or not."""
    import transformers
    from ttrace_core.record.tracer import Tracer

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    tracer = Tracer(tmp_path, model, role="reference") if traced else None
    with tracer.step(0) if traced else contextlib.nullcontext():
        model(input_ids=tokens, labels=tokens).loss.backward()
    if tracer is not None:
        tracer.close()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_hooks_change_gradients_at_most_by_autograds_accumulation_order_on_a_residual_stream(tmp_path):
    """What docs/your-own-script.md claims: bit for bit without tensor reuse (test_tracer), and where a tensor feeds several
    consumers, equal up to the order autograd accumulates their gradients in: a full backward hook adds a node
    to the graph, and a sum of two or three fp32 gradients rounded in another order moves by an ulp or so."""
    plain, traced = _llama_gradients(tmp_path / "plain", False), _llama_gradients(tmp_path / "traced", True)
    assert plain.keys() == traced.keys()
    for name, expected in plain.items():
        actual = traced[name]
        # a few roundings of the largest summand, per element: what reordering a short sum can change
        bound = 8 * torch.finfo(torch.float32).eps * expected.abs().max()
        assert (actual - expected).abs().max() <= bound, name
