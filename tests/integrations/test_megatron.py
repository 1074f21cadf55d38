"""The megatron adapter's plain-Python parts (ttrace_core/integrations/megatron.py): names of model
chunks, and the configuration megatron-core runs silently wrong under virtual pipelining."""

from types import SimpleNamespace

import pytest
from torch import nn

from ttrace_core.format.naming import global_fqn
from ttrace_core.integrations.megatron import interleaved_p2p_hazard, megatron_rename


def _chunk(layer_numbers: list[int]) -> nn.Module:
    """A stand-in GPTModel chunk: decoder.layers.<local> carrying megatron's global (1-based) layer_number."""
    chunk, decoder = nn.Module(), nn.Module()
    decoder.layers = nn.ModuleList(nn.Linear(2, 2) for _ in layer_numbers)
    for layer, number in zip(decoder.layers, layer_numbers):
        layer.layer_number = number
    chunk.decoder = decoder
    return chunk


@pytest.mark.parametrize(("local", "expected"), [
    ("0.decoder.layers.0.mlp", "decoder.layers.0.mlp"),
    ("1.decoder.layers.0.mlp", "decoder.layers.2.mlp"),
    ("1.decoder", "decoder"),
    ("1", ""),
    ("10.decoder", "10.decoder"),
], ids=["chunk 0 keeps its layer", "chunk 1's first layer is global 2", "prefix dropped", "chunk root", "whole components"])
def test_chunk_names_map_to_global_layers(local, expected):
    """pp 2 x vpp 2 with 4 layers: rank 0 holds global layers 0 (chunk 0) and 2 (chunk 1)."""
    rename = megatron_rename(nn.ModuleList([_chunk([1]), _chunk([3])]))
    assert global_fqn(local, rename) == expected


@pytest.mark.parametrize(("pipeline_size", "vpp", "batch", "overlap", "warned"), [
    (2, 2, True, False, True),
    (2, 2, False, True, False),
    (4, 2, True, False, False),
    (2, None, True, False, False),
], ids=["pp2 vpp2 batched: crossed", "overlap_p2p_comm", "pp4", "no vpp"])
def test_the_crossed_p2p_configuration_is_named_in_one_line(pipeline_size, vpp, batch, overlap, warned):
    config = SimpleNamespace(virtual_pipeline_model_parallel_size=vpp, batch_p2p_comm=batch, overlap_p2p_comm=overlap)
    message = interleaved_p2p_hazard(config, pipeline_size)
    assert (message is not None) == warned
    assert message is None or ("#1450" in message and "overlap_p2p_comm=True" in message and "\n" not in message)
