"""compare/window.py: a window's small tensors summed straight from their shards' bytes give, bit for bit, the
sums of their assembled tensors; what it cannot take that way it leaves to the engine, whose rows are then those
of reading every tensor alone."""

from __future__ import annotations

import math

import pytest
import torch

from tests.core.canonicalize.test_shards import LAYOUTS
from ttrace_core.canonicalize import placements as pl
from ttrace_core.canonicalize.shards import RecordedShard, canonicalize, shard
from ttrace_core.compare import engine
from ttrace_core.compare.batched import SmallPair, batched_sums
from ttrace_core.compare.results import Tolerance
from ttrace_core.compare.window import window_sums
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, write_manifest

TOL = Tolerance(rel=1e-3, abs=1e-6, source="test")
DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
PARTIAL = {name for name, (_, _, placements) in LAYOUTS.items() if any(p.startswith("P") for p in placements)}
BLOCKED = {name for name, (_, _, placements) in LAYOUTS.items() if any(p.startswith("SB") for p in placements)}


def _key(name: str, dtype: torch.dtype) -> TensorKey:
    return TensorKey(step=0, micro_batch=0, phase="forward", fqn=f"{name}.{str(dtype).removeprefix('torch.')}",
                     slot="output.0")


def _meta(key: TensorKey, rank: int, layout: Layout, value: torch.Tensor, seq: int, scale: float) -> TensorMeta:
    return TensorMeta(key=key, rank=rank, dtype=str(value.dtype).removeprefix("torch."), local_shape=tuple(value.shape),
                      layout=layout, seq=seq, scale=scale)


def _tensors(name: str, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, candidate) logical values: the candidate off by a little, in the stored dtype."""
    shape = LAYOUTS[name][0]
    generator = torch.Generator().manual_seed(seed)
    reference = torch.randn(shape, generator=generator)
    candidate = reference * (1 + 0.01 * torch.randn(shape, generator=generator))
    return reference.to(dtype), candidate.to(dtype)


def _pieces(full: torch.Tensor, mesh_shape, placements) -> list[tuple[Layout, torch.Tensor]]:
    """Each rank's layout and values; a partial placement's pieces sum to `full` (each rank holds full / n)."""
    found = []
    for coordinate in pl.all_coordinates(mesh_shape):
        layout = Layout(global_shape=tuple(full.shape), mesh_shape=mesh_shape, coordinate=coordinate, placements=placements)
        if pl.axes_of_kind(layout, "partial"):
            found.append((layout, shard(full.float() / math.prod(mesh_shape), layout).to(full.dtype)))
        else:
            found.append((layout, shard(full, layout)))
    return found


def _write_pair(tmp_path, edit=None):
    """A 1-rank reference and a candidate of as many ranks as the largest mesh (ranks past a smaller mesh hold
    nothing of its tensor), one tensor per layout and dtype; `edit(key, rank, value)` may change a candidate shard."""
    reference_dir, candidate_dir = tmp_path / "reference", tmp_path / "candidate"
    write_manifest(reference_dir, RunManifest(role="reference", world_size=1))
    world_size = max(math.prod(mesh_shape) for _, mesh_shape, _ in LAYOUTS.values())
    write_manifest(candidate_dir, RunManifest(role="candidate", world_size=world_size))
    reference = RunWriter(reference_dir, 0)
    candidates = [RunWriter(candidate_dir, rank) for rank in range(world_size)]
    for writer in (reference, *candidates):
        writer.begin_step(0)
    seq = 0
    for index, (name, (shape, mesh_shape, placements)) in enumerate(sorted(LAYOUTS.items())):
        for dtype in DTYPES:
            key, scale = _key(name, dtype), 2.0 if dtype == torch.bfloat16 else 1.0
            expected, actual = _tensors(name, dtype, index)
            reference.write(_meta(key, 0, Layout(global_shape=tuple(shape)), expected, seq, scale), expected)
            for rank, (layout, value) in enumerate(_pieces(actual, mesh_shape, placements)):
                value = edit(key, rank, value) if edit else value
                candidates[rank].write(_meta(key, rank, layout, value, seq, scale), value)
            seq += 1
    for writer in (reference, *candidates):
        writer.end_step()
    return reference_dir, candidate_dir


def _assembled_sums(reference: RunReader, candidate: RunReader, key: TensorKey, tolerance: Tolerance = TOL):
    """`batched_sums` of the tensor assembled by `canonicalize`, as the engine takes a small tensor alone."""
    values = []
    for reader in (candidate, reference):
        metas = reader.index[key]
        values.append(canonicalize([RecordedShard(m.rank, m.layout, reader.read(m)) for m in metas], key).full)
    metas = candidate.index[key], reference.index[key]
    return batched_sums([SmallPair(values[0], values[1], metas[0][0].scale, metas[1][0].scale, tolerance)])[0]


def test_every_layout_and_dtype_sums_to_the_bits_of_its_assembled_tensor(tmp_path):
    with RunReader(_write_pair(tmp_path)[0]) as reference, RunReader(tmp_path / "candidate") as candidate:
        keys = sorted(reference.index)
        found = window_sums(keys, reference, candidate, {key: TOL for key in keys})
        for key in keys:
            if key in found:
                assert found[key] == _assembled_sums(reference, candidate, key), key
    taken = {key.fqn.rsplit(".", 1)[0] for key in found}
    # all but the tensors `canonicalize` sums (partial) or views (blocked), in every dtype
    assert taken == set(LAYOUTS) - PARTIAL - BLOCKED
    assert len(found) == len(taken) * len(DTYPES)


def test_a_candidate_replica_that_differs_or_a_nan_is_left_to_the_engine_with_the_same_rows(tmp_path, monkeypatch):
    replicated = _key("replicate", torch.float32)
    with_nan = _key("shard0-even", torch.bfloat16)

    def edit(key, rank, value):
        if key == replicated and rank == 1:
            return value * (1 + 2**-12)  # replica drift
        if key == with_nan and rank == 0:
            value = value.clone()
            value.view(-1)[3] = float("nan")
        return value
    _write_pair(tmp_path, edit)
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "candidate") as candidate:
        keys = sorted(reference.index)
        found = window_sums(keys, reference, candidate, {key: TOL for key in keys})
        assert replicated not in found and with_nan not in found
        assert len(found) == len(DTYPES) * len(set(LAYOUTS) - PARTIAL - BLOCKED) - 2
        fast = engine.compare_runs(reference, candidate).to_dict()
        monkeypatch.setattr(engine, "window_sums", lambda *args: {})  # every tensor read and assembled alone
        alone = engine.compare_runs(reference, candidate).to_dict()
    assert fast == alone
    rows = {row["key"]["fqn"]: row for row in fast["comparisons"]}
    assert rows[replicated.fqn]["replica_drift"] is not None and rows[with_nan.fqn]["status"] == "nonfinite"


def test_shards_not_read_are_left_to_the_engine(tmp_path, monkeypatch):
    _write_pair(tmp_path)
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "candidate") as candidate:
        keys = sorted(reference.index)
        real = RunReader.read_raw

        def half_read(self, metas):  # every other key's shards "could not be read"
            buffer, offsets = real(self, metas)
            return buffer, [offset if keys.index(meta.key) % 2 else None for meta, offset in zip(metas, offsets)]
        monkeypatch.setattr(RunReader, "read_raw", half_read)
        found = window_sums(keys, reference, candidate, {key: TOL for key in keys})
        for key in found:
            assert found[key] == _assembled_sums(reference, candidate, key)
        assert found and all(keys.index(key) % 2 for key in found)


@pytest.mark.parametrize("tolerance", [TOL, Tolerance(rel=0.0, abs=0.0, source="exact")])
def test_each_key_is_counted_under_its_own_tolerance(tmp_path, tolerance):
    with RunReader(_write_pair(tmp_path)[0]) as reference, RunReader(tmp_path / "candidate") as candidate:
        keys = sorted(reference.index)
        tolerances = {key: tolerance if index % 2 else TOL for index, key in enumerate(keys)}
        found = window_sums(keys, reference, candidate, tolerances)
        for key, sums in found.items():
            assert sums == _assembled_sums(reference, candidate, key, tolerances[key])
        if tolerance != TOL:  # (the exact one counts more elements out)
            assert sum(found[key].num_mismatched for key in found if tolerances[key] == tolerance) > \
                sum(_assembled_sums(reference, candidate, key).num_mismatched for key in found if tolerances[key] == tolerance)


def test_shards_are_read_a_bounded_part_at_a_time_with_the_same_sums(tmp_path, monkeypatch):
    """A small tensor replicated on many ranks has a shard on each: the keys are read in parts of at most
    READ_BYTES (or half the memory budget), and the sums are those of reading them all at once."""
    with RunReader(_write_pair(tmp_path)[0]) as reference, RunReader(tmp_path / "candidate") as candidate:
        keys = sorted(reference.index)
        reads: list[int] = []
        real = RunReader.read_raw

        def read_raw(self, metas):
            reads.append(len(metas))
            return real(self, metas)
        monkeypatch.setattr(RunReader, "read_raw", read_raw)
        whole = window_sums(keys, reference, candidate, {key: TOL for key in keys})
        assert len(reads) == 2  # each run's shards at once
        reads.clear()
        parts = window_sums(keys, reference, candidate, {key: TOL for key in keys}, max_bytes=512)
    assert parts == whole and len(reads) > 2 * 20  # a key or a few at a time (256 bytes, or one key's own)
