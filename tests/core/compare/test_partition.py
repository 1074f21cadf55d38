"""Partitioned compare (partition.py): two workers, spawned (`--workers 2`) or under torchrun, give
exactly the table one worker gives, row for row, also where the exact-inputs rule re-compares rows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PAIRS = [("fp32/reference", "fp32/tp2_row_parallel_bias"), ("fp8/reference", "fp8/tp2_clean")]


def _compare(pair, out, *extra: str, launcher: tuple[str, ...] = (sys.executable, "-m")) -> dict:
    command = [*launcher, "ttrace_core", "compare", str(pair[0]), str(pair[1]), "--rebuild", "--json", str(out), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return json.loads(out.read_text())


def _copied(tmp_path, names):
    pair = []
    for name in names:
        shutil.copytree(ROOT / "sample_traces" / name, tmp_path / name, ignore=shutil.ignore_patterns(".ttrace"))
        pair.append(tmp_path / name)
    return pair


@pytest.mark.slow
@pytest.mark.parametrize("names", PAIRS, ids=["fp32-bug", "fp8-clean-with-exact-inputs"])
def test_two_spawned_workers_give_the_one_worker_table(tmp_path, names):
    pair = _copied(tmp_path, names)
    one = _compare(pair, tmp_path / "one.json")
    two = _compare(pair, tmp_path / "two.json", "--workers", "2")
    assert one["comparisons"] == two["comparisons"] and one["coverage"] == two["coverage"]
    assert one["verdict"] == two["verdict"] == ("not equivalent" if "bias" in names[1] else "equivalent")
    tightened = [row for row in two["comparisons"] if row["tolerance"] and row["tolerance"]["method"] == "exact-inputs"]
    assert bool(tightened) == names[0].startswith("fp8")  # rows the workers could not judge alone, compared again


@pytest.mark.distributed
def test_torchrun_workers_give_the_one_worker_table(tmp_path):
    pair = _copied(tmp_path, PAIRS[0])
    one = _compare(pair, tmp_path / "one.json")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m")
    two = _compare(pair, tmp_path / "two.json", launcher=torchrun)
    assert one["comparisons"] == two["comparisons"]
