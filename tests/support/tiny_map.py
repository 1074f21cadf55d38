"""A hand-written pair of two implementations and the correspondence map between them: separate q, k, v
projections in the reference against one fused qkv (megatron's [q_g; k_g; v_g] per query group) in the
candidate, with tensors either side has no counterpart for.

Used by tests/core/canonicalize/test_mapped_run.py (mapping and comparing through it) and
tests/app/test_map_pages.py (the dashboard with a map)."""

from __future__ import annotations

from pathlib import Path

import torch

from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, write_manifest

TINY_MAP = '''
name = "tiny"
reference = "separate q, k, v"
candidate = "fused qkv"
[facts]
groups = "num_key_value_heads"
[candidate_model]
num_layers = "num_hidden_layers"
[[parameters]]
candidate = "layers.{layer}.qkv.weight"
reference = ["l.{layer}.q.weight", "l.{layer}.k.weight", "l.{layer}.v.weight"]
transform = [{op = "concat", dim = 0, groups = "groups"}]
[[tensors]]
candidate = "layers.{layer}.qkv"
slots = ["output.0"]
reference = ["l.{layer}.q", "l.{layer}.k", "l.{layer}.v"]
transform = [{op = "permute", dims = [1, 0, 2]}, {op = "concat", dim = -1, groups = "groups"}]
[[tensors]]
candidate = "layers.{layer}.qkv"
slots = ["grad_input.0"]
reference = ["l.{layer}.q/grad_input.0", "l.{layer}.k/grad_input.0", "l.{layer}.v/grad_input.0"]
transform = [{op = "permute", dims = [1, 0, 2]}, {op = "sum"}]
[[unmapped]]
side = "candidate"
tensors = ["forward/layers.*.rotary/**"]
reason = "angles against cosines"
[[unmapped]]
side = "reference"
tensors = ["forward/l.*.act/**"]
reason = "a module on one side only"
'''
SIZES = {"q": 4, "k": 2, "v": 2}
"""Rows of each projection: 4 query rows, 2 key and 2 value rows, in 2 query groups."""


def write_run(run_dir: Path, values: dict[TensorKey, torch.Tensor], model: dict, *, role: str = "reference") -> Path:
    """One rank, one step, every tensor whole (replicated) in float32, and a manifest with `model`."""
    writer = RunWriter(run_dir, 0)
    writer.begin_step(0)
    for seq, (key, value) in enumerate(values.items()):
        writer.write(TensorMeta(key=key, rank=0, dtype="float32", local_shape=tuple(value.shape),
                                layout=Layout.replicated(tuple(value.shape)), seq=seq), value.contiguous())
    writer.end_step()
    write_manifest(run_dir, RunManifest(role=role, world_size=1, model=model))
    return run_dir


def interleaved(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """megatron's fused qkv: [q_g; k_g; v_g] for each of the 2 groups."""
    return torch.cat([piece.chunk(2, dim=dim)[g] for g in range(2) for piece in pieces], dim=dim)
