"""One logical tensor of a recorded run: its shards read and canonicalized (stage 2).

Input: a `format.reader.RunReader` and a tensor's key. Output: the `CanonicalTensor` its shards
assemble into, or its full value in float64 with the recording's loss scale undone. Compare, the
estimate, localize's input rewriting and the tensor view all read logical tensors through here.
"""

from __future__ import annotations

import torch

from ttrace_core.canonicalize.shards import CanonicalTensor, RecordedShard, canonicalize
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TensorKey, TensorMeta


def canonical_tensor(reader: RunReader, metas: list[TensorMeta], key: TensorKey) -> CanonicalTensor:
    """The shards `metas` of `key` read from `reader` and assembled into the logical tensor."""
    shards = [RecordedShard(rank=m.rank, layout=m.layout, value=reader.read(m)) for m in metas]
    return canonicalize(shards, key)


def logical_value(reader: RunReader, key: TensorKey) -> torch.Tensor:
    """The full logical tensor of `key` in float64, with the recording's loss scale undone."""
    metas = reader.index[key]
    return canonical_tensor(reader, metas, key).full.double() / metas[0].scale
