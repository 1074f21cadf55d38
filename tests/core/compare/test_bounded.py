"""Compare in bounded memory (bounded.py): slab by slab gives the row the whole tensor gives, and a
`ttrace compare --max-memory` on a trace several times larger than the budget stays under it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bounded_pair import same_rows, write_pair
from ttrace_core.compare.bounded import BYTES_PER_ELEMENT, free_dims, slab_lengths
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


def test_slabs_cut_only_dims_no_placement_shards():
    rows = Layout(global_shape=(8, 4, 6), mesh_shape=(2,), coordinate=(0,), placements=("S(0)",))
    cols = Layout(global_shape=(8, 4, 6), mesh_shape=(2,), coordinate=(0,), placements=("S(-1)",))
    assert free_dims([_meta(Layout.replicated((8, 4, 6)))], [_meta(rows)]) == [1, 2]
    assert free_dims([_meta(rows)], [_meta(cols)]) == [1]
    flat = Layout(global_shape=(8, 4, 6), flat_range=(0, 100))
    assert free_dims([_meta(rows)], [_meta(flat)]) == []  # a flat range cannot be cut: compared whole
    # one index of dim 1 is 48 elements: a budget of 100 elements' bytes takes 2 of them, then stops
    assert slab_lengths((8, 4, 6), [1, 2], 100 * BYTES_PER_ELEMENT) == {1: 2}
    # a budget under one index of the outer free dim goes on to cut the next one
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
