"""CI-sized slice of benchmarks/robustness.py: the first cases of every corruption class, applied to a
copy of the bf16 sample pair (a 1-rank reference with its tolerance estimate, a TP2 + SP candidate),
each answered by inspect, compare and the dashboard's API in a forked process with a time limit.
None may crash, hang, give an error that names nothing, or pass silently."""

from __future__ import annotations

import random
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import h5py
import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import corruptions  # noqa: E402
import robustness  # noqa: E402
from ttrace_core.store import INVENTORY_ATTR  # noqa: E402

CASES_PER_CLASS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("robustness")
    pair = root / "base" / "reference", root / "base" / "candidate"
    shutil.copytree(ROOT / "sample_traces" / "bf16" / "reference", pair[0])
    shutil.copytree(ROOT / "sample_traces" / "bf16" / "tp2_sp_clean", pair[1])
    for step_file in [*pair[0].glob("*.h5"), *pair[1].glob("*.h5")]:  # the samples predate the inventory attribute
        with h5py.File(step_file, "r+") as handle:
            found = []
            handle.visititems(lambda name, node: found.append(name) if isinstance(node, h5py.Dataset) else None)
            handle.attrs[INVENTORY_ATTR] = len(found)
    robustness.replay_base(*pair)  # the finished replay job the "replay job files" cases damage
    return pair


def _bad_answers(results: list[dict]) -> list:
    return [(r["kind"], r["name"], {c: r[c] for c in robustness.COMMANDS}) for r in results
            if r["silent"] or any(r[c]["outcome"] in ("crash", "hang", "unclear error", "not run") for c in robustness.COMMANDS)]


def _slice(cases, per_class: int):
    by_class = defaultdict(list)
    for case in cases:
        by_class[case.kind].append(case)
    rng = random.Random(0)
    return [case for group in by_class.values() for case in rng.sample(group, min(per_class, len(group)))]


def test_no_damaged_trace_crashes_hangs_or_passes_silently(base, tmp_path):
    cases = _slice(robustness.catalogue(base, seed=0, scale=1), CASES_PER_CLASS)
    kinds = {case.kind for case in cases}
    assert {"bit flip", "truncation", "lying metadata", "attributes", "values", "duplicated tensor",
            "missing rank or step", "hostile manifest", "tolerance estimate", "way out of the trace",
            "replay job files"} <= kinds
    results = robustness.run_all(cases, base, tmp_path, jobs=2)
    assert len(results) == len(cases)
    bad = _bad_answers(results)
    assert not bad and not any(r["read_outside"] for r in results), bad
    # the slice exercises every answer ttrace gives: errors naming a file, findings, and passes on harmless damage
    outcomes = {r["compare"]["outcome"] for r in results}
    assert {"error", "finding"} <= outcomes, outcomes


JOB_CASES = ("status.json running as this process", "status.json running as init", "spec.json result_file outside the trace",
             "spec.json result_file ../../manifest.json", "lock names this process", "log.txt a directory",
             "status.json deep nesting", "spec.json a list", "result.json NaN", "result.json culprits = {}",
             "status.json supervisor = 10000000000000000000")


def test_a_shared_replay_job_is_read_as_untrusted(base, tmp_path):
    """A candidate shared with its replay job: the dashboard's reading of it (status, log, verdict, a
    cancel) never crashes, never signals a process it names, never reads a result outside the trace."""
    cases = [case for case in corruptions.job_file_damage() if case.name in JOB_CASES]
    assert len(cases) == len(JOB_CASES)
    results = robustness.run_all(cases, base, tmp_path, jobs=2)
    assert not _bad_answers(results) and not any(r["read_outside"] for r in results), _bad_answers(results)
    assert {r["api"]["outcome"] for r in results} == {"pass", "error"}, [r["api"] for r in results]
