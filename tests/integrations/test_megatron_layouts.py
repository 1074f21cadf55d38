"""Layouts the megatron adapter gives module boundaries that no spawned run checks cheaply: the
multi-token prediction block's output, the decoder's and each MTP layer's hidden states concatenated
along the sequence (megatron-core transformer/multi_token_prediction.py MultiTokenPredictionBlock.forward),
and the weight GPTModel hands its output layer under tied embeddings (the vocab-parallel word
embedding's, gpt_model.py GPTModel._postprocess)."""

import pytest
import torch
from torch import nn

from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock as _Real
from ttrace_core.canonicalize.shards import shard
from ttrace_core.format.schema import Layout
from ttrace_core.integrations.megatron import _boundary_layout, _resolve, parameter_placement


class MultiTokenPredictionBlock(nn.Module):
    """Named as megatron's block (the adapter matches by class name), holding `num_layers` MTP layers."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Identity() for _ in range(num_layers))


def _mtp_output_placement(num_layers: int, sequence_parallel: bool) -> str:
    layout = _boundary_layout("mtp", MultiTokenPredictionBlock(num_layers))
    return _resolve(layout["output.0"], sequence_parallel)


def test_megatron_still_names_its_block_so():
    assert _Real.__name__ == MultiTokenPredictionBlock.__name__


@pytest.mark.parametrize("num_layers, sequence_parallel, placement",
                         [(1, True, "SS(0,2)"), (2, True, "SS(0,3)"), (1, False, "R")],
                         ids=["one-layer-sp", "two-layers-sp", "no-sp"])
def test_mtp_block_output_placement(num_layers, sequence_parallel, placement):
    assert _mtp_output_placement(num_layers, sequence_parallel) == placement


@pytest.mark.parametrize("num_layers", [1, 2], ids=["one-layer", "two-layers"])
def test_each_tp_rank_holds_its_sequence_shard_of_every_piece(num_layers):
    """What a rank's block returns under SP (its sequence shard of every piece, concatenated) is the
    declared layout's shard of the reference's concatenation."""
    seq, batch, hidden, tp = 8, 2, 3, 2
    pieces = [torch.randn(seq, batch, hidden) for _ in range(1 + num_layers)]
    full = torch.cat(pieces, dim=0)
    placement = _mtp_output_placement(num_layers, sequence_parallel=True)
    for rank in range(tp):
        local = torch.cat([p[rank * seq // tp:(rank + 1) * seq // tp] for p in pieces], dim=0)
        layout = Layout(global_shape=tuple(full.shape), mesh_shape=(tp,), coordinate=(rank,), placements=(placement,),
                        mesh_axis_names=("tp",))
        assert torch.equal(shard(full, layout), local)


class ColumnParallelLinear(nn.Module):
    """Named as megatron's column-parallel linear (GPTModel's output_layer)."""


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
def test_a_tied_output_layer_weight_is_laid_out_as_the_word_embedding(sequence_parallel):
    """Without the input.weight entry the handed-in weight took the hidden-state rule: R without SP
    (a (64, 64) shard recorded as whole against the reference's (128, 64)), and S(0) under SP only by
    the accident that both cut dim 0."""
    word_embedding = nn.Parameter(torch.zeros(64, 64))
    word_embedding.tensor_model_parallel, word_embedding.partition_dim = True, 0  # as VocabParallelEmbedding sets
    layout = _boundary_layout("output_layer", ColumnParallelLinear())
    assert _resolve(layout["input.weight"], sequence_parallel) == parameter_placement(word_embedding) == "S(0)"
