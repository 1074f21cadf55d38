"""Compare in bounded memory (bounded.py): slab by slab gives the row the whole tensor gives, and a
`ttrace compare --max-memory` on a trace several times larger than the budget stays under it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.bounded_pair import same_rows, write_pair
from ttrace_core.compare.bounded import BYTES_PER_ELEMENT, cuts, slab_lengths
from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.schema import Layout, TensorKey, TensorMeta
from ttrace_core.format.reader import RunReader
from tests.support.paths import REPO

ROOT = REPO
MIB = 2**20
PEAK_RSS = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code, file=sys.stderr)")
"""Runs its arguments as its only child and prints that child's peak RSS (KiB) and exit code: the test
process's own RUSAGE_CHILDREN would also count every child it ran before."""


def _meta(layout: Layout) -> TensorMeta:
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn="x", slot="output.0")
    return TensorMeta(key=key, rank=0, dtype="float32", local_shape=layout.global_shape, layout=layout, seq=0)


def test_slabs_cut_dims_every_shard_holds_one_run_of_at_the_shards_bounds():
    rows = Layout(global_shape=(8, 4, 6), mesh_shape=(2,), coordinate=(0,), placements=("S(0)",))
    cols = Layout(global_shape=(8, 4, 6), mesh_shape=(2,), coordinate=(1,), placements=("S(-1)",))
    assert cuts([_meta(Layout.replicated((8, 4, 6)))], [_meta(rows)]) == [(0, (0, 4, 8)), (1, (0, 4)), (2, (0, 6))]
    assert cuts([_meta(rows)], [_meta(cols)]) == [(0, (0, 4, 8)), (1, (0, 4)), (2, (0, 3, 6))]
    uneven = Layout(global_shape=(7, 4), mesh_shape=(2, 2), coordinate=(1, 1), placements=("R", "S(0)"))
    assert cuts([_meta(Layout.replicated((7, 4)))], [_meta(uneven)]) == [(0, (0, 4, 7)), (1, (0, 4))]
    strided = Layout(global_shape=(8, 4, 6), mesh_shape=(2,), coordinate=(0,), placements=("SS(0,2)",))
    assert [cut.dim for cut in cuts([_meta(rows)], [_meta(strided)])] == [1, 2]  # a strided shard holds 2 runs
    flat = Layout(global_shape=(8, 4, 6), flat_range=(0, 100))
    assert cuts([_meta(rows)], [_meta(flat)]) == []  # a flat range cannot be cut: compared whole
    # one index of dim 1 is 48 elements: a budget of 100 elements' bytes takes 2 of them, then stops
    assert slab_lengths((8, 4, 6), [1, 2], 100 * BYTES_PER_ELEMENT) == {1: 2}
    # a budget under one index of the outer dim goes on to cut the next one
    assert slab_lengths((8, 4, 6), [1, 2], 20 * BYTES_PER_ELEMENT) == {1: 1, 2: 2}
    assert slab_lengths((8, 4, 6), [1, 2], 10**9) == {}


def test_slab_by_slab_gives_the_rows_of_the_whole_tensors(tmp_path):
    reference, candidate = write_pair(tmp_path, num_tensors=4, rows=32)
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        whole = compare_runs(ref, cand)
        reads = []
        original = cand.read
        cand.read = lambda meta, region=None: reads.append(region) or original(meta, region)
        slabbed = compare_runs(ref, cand, max_bytes=64 * 1024)
    assert sum(region is not None for region in reads) > 4 * 2, "the budget did not cut the tensors into slabs"
    assert [c.status for c in whole.comparisons] == ["pass", "replica_drift", "mismatch", "pass"]
    assert same_rows({"comparisons": [c.to_dict() for c in slabbed.comparisons]},
                                    {"comparisons": [c.to_dict() for c in whole.comparisons]})
    mismatch = slabbed.comparisons[2]
    assert mismatch.max_abs_index == (16, 2, 1) and mismatch.num_mismatched == 1  # rank 1's first row, placed globally
    assert slabbed.comparisons[1].replica_drift.ranks == (0, 1)


def _sharded_pair(root: Path, shape: tuple[int, ...], layouts: list[Layout]) -> tuple[Path, Path]:
    """A 1-rank reference of one fp32 tensor of `shape` (a weight's gradient, say) and a candidate whose rank r
    holds `layouts[r]`'s block of it; the last rank's first held element is off by 1 (a mismatch), and any
    rank but the first holding the same block as another drifts by 1e-3 there (a replica drift)."""
    from ttrace_core.canonicalize import placements as pl
    from ttrace_core.format.schema import RunManifest
    from ttrace_core.format.writer import RunWriter, write_manifest

    full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    key = TensorKey(step=0, micro_batch=0, phase="grad", fqn="w", slot="value")
    mesh = layouts[0].mesh_shape
    for role, world in (("reference", [Layout.replicated(shape)]), ("candidate", layouts)):
        run_dir = root / role
        axes = mesh if role == "candidate" else (1,)
        write_manifest(run_dir, RunManifest(role=role, world_size=len(world), model={"shape": list(shape)},
                                            degrees={f"a{i}": size for i, size in enumerate(axes)}, mesh_shape=list(axes),
                                            mesh_axis_names=[f"a{i}" for i in range(len(axes))],
                                            rank_coordinates=[list(layout.coordinate) or [0] for layout in world]))
        seen = set()
        for rank, layout in enumerate(world):
            runs = pl.local_runs(layout)
            local = full[tuple(slice(start, start + length) for ((start, length),) in runs)].clone()
            if role == "candidate" and rank == len(world) - 1:
                local.view(-1)[0] += 1.0
            if role == "candidate" and rank and runs in seen:
                local *= 1 + 1e-3
            seen.add(runs)
            writer = RunWriter(run_dir, rank)
            writer.begin_step(0)
            writer.write(TensorMeta(key=key, rank=rank, dtype="float32", local_shape=tuple(local.shape), layout=layout,
                                    seq=0), local)
            writer.end_step()
    return root / "reference", root / "candidate"


def _tp(shape, coordinates, mesh, placements):
    return [Layout(global_shape=shape, mesh_shape=mesh, coordinate=c, placements=placements) for c in coordinates]


@pytest.mark.parametrize("shape, layouts", [
    ((64, 96), _tp((64, 96), [(0,), (1,)], (2,), ("S(0)",))),
    ((61, 96), _tp((61, 96), [(0,), (1,)], (2,), ("S(0)",))),  # uneven: 31 and 30 rows
    ((64, 96), _tp((64, 96), [(d, t) for d in range(2) for t in range(2)], (2, 2), ("R", "S(0)"))),
    ((64, 48, 2), _tp((64, 48, 2), [(0,), (1,), (2,)], (3,), ("S(0)",))),  # 22, 22, 20 rows; a 3-dim tensor
], ids=["tp2", "tp2-uneven", "dp2-x-tp2", "tp3-uneven-3d"])
def test_a_row_sharded_tensor_is_cut_by_rows_within_its_shards_and_gives_the_whole_row(tmp_path, monkeypatch, shape,
                                                                                       layouts):
    """A weight sharded along its rows (megatron's qkv and fc1) was cut only into slabs of columns, and each slab
    read every row of its shard again (its columns lie close together: packs._read_region reads the rows whole). It
    is now cut by rows at its shards' bounds: the bytes read are about the bytes stored, and the row equals the whole
    tensor's."""
    reference, candidate = _sharded_pair(tmp_path, shape, layouts)
    budget = math.prod(shape) * BYTES_PER_ELEMENT // 5  # about 5 slabs
    stored = 4 * (math.prod(shape) + sum(math.prod(pl_len(layout)) for layout in layouts))
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        whole = compare_runs(ref, cand)
        reads, regions, real_preadv, original = [], [], os.preadv, cand.read
        monkeypatch.setattr(os, "preadv", lambda *args: reads.append(real_preadv(*args)) or reads[-1])
        cand.read = lambda meta, region=None: regions.append(region) or original(meta, region)
        slabbed = compare_runs(ref, cand, max_bytes=budget)
    assert len(regions) > len(layouts) and all(region[0] != slice(None) for region in regions), regions
    assert stored <= sum(reads) <= 1.1 * stored, f"{sum(reads)} bytes read for {stored} stored"
    replicas = len(layouts) == 4
    assert whole.comparisons[0].status == ("replica_drift" if replicas else "mismatch")
    # (a replica's values show as its drift; the canonical values are the first replica's)
    assert whole.comparisons[0].num_mismatched == (0 if replicas else 1)
    assert (whole.comparisons[0].replica_drift is not None) == replicas
    assert same_rows({"comparisons": [c.to_dict() for c in slabbed.comparisons]},
                     {"comparisons": [c.to_dict() for c in whole.comparisons]})


def pl_len(layout: Layout) -> tuple[int, ...]:
    from ttrace_core.canonicalize import placements as pl

    return tuple(length for ((_, length),) in pl.local_runs(layout))


def _compare_peak_rss(reference: Path, candidate: Path, out: Path, *extra: str) -> tuple[int, dict]:
    """Peak RSS in bytes of `ttrace compare --rebuild --json` in a fresh process, and the table it wrote."""
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "ttrace_core", "compare", str(reference),
                           str(candidate), "--rebuild", "--json", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    peak_kib, code = (int(x) for x in done.stderr.strip().splitlines()[-1].split())
    assert code in (0, 1), done.stderr[-2000:]
    return peak_kib * 1024, json.loads(out.read_text())


@pytest.mark.slow
def test_max_memory_bounds_peak_rss_of_a_trace_larger_than_it(tmp_path):
    """Peak RSS of `ttrace compare --max-memory 8M` on a 120 MiB trace whose tensors each take ~60 MiB to
    compare whole, against the fixed margin: the same command on tiny tensors (+4 MiB of measuring noise).
    (Tensors of half that size no longer show the budget: a replicated one is compared without a copy.)
    benchmarks/compare_memory.py measures the same at several budgets on a larger pair."""
    tiny = write_pair(tmp_path / "tiny", num_tensors=6, rows=2)
    big = write_pair(tmp_path / "big", num_tensors=6, rows=512)
    margin, _ = _compare_peak_rss(*tiny, tmp_path / "tiny.json")
    unbounded_peak, unbounded = _compare_peak_rss(*big, tmp_path / "unbounded.json")
    bounded_peak, bounded = _compare_peak_rss(*big, tmp_path / "bounded.json", "--max-memory", "8M")
    assert sum(path.stat().st_size for run in big for path in run.glob("*.h5")) > 6 * 8 * MIB
    assert unbounded_peak - margin > 3 * 8 * MIB, "the pair is too small to show the budget"
    assert bounded_peak - margin <= 8 * MIB + 4 * MIB, f"peak {(bounded_peak - margin) / MIB:.1f} MiB above the margin"
    assert same_rows(bounded, unbounded)


def test_the_compared_whole_note_survives_rows_compared_by_partitioned_workers(tmp_path):
    """`--workers N --max-memory M`: the workers' rows come back precomputed, and the note that some tensors
    could not be cut into slabs must still be made (it was lost: only compare_key made it)."""
    import torch
    from torch import nn

    from ttrace_core.record.tracer import Tracer

    for name in ("ref", "cand"):  # the candidate's weight gradient is a flat range of its block: no slab cuts it
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tracer = Tracer(tmp_path / name, model, role="reference" if name == "ref" else "candidate", optimizer=optimizer)
        if name == "cand":
            tracer.declare_flat_range("0.weight", "grad", 0, 64)
        with tracer.step(0):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
            optimizer.step()
        tracer.close()
    reference, candidate = tmp_path / "ref", tmp_path / "cand"
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        alone = compare_runs(ref, cand, max_bytes=1)
        precomputed = {row.key: row for row in alone.comparisons}
        partitioned = compare_runs(ref, cand, max_bytes=1, precomputed=precomputed)
    whole = [note for note in alone.notes if "were compared whole" in note]
    assert whole and [note for note in partitioned.notes if "were compared whole" in note] == whole
