"""The CI slice of the real-bug corpus for torchtitan and transformers: one public upstream bug of each,
reproduced against the pinned framework, must be detected by `ttrace compare` and localized by
`ttrace localize` to what its fix touched. The whole corpus runs in benchmarks/real_bugs.py.

- torchtitan: https://github.com/pytorch/torchtitan/pull/3412 reverted (the chunked loss's gradient
  accumulator drops the Partial placement of lm_head's input gradient under TP), llama3's debug model,
  TP 2 against one rank.
- transformers: https://github.com/huggingface/transformers/pull/48205 reverted (the routing weights'
  gradient is not summed over the expert-parallel group), a tiny Qwen3-MoE, TP 2 x EP 2 against one
  rank.

Both together took 6 minutes on 2 cores shared with other jobs (load average about 10).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torchtitan  # noqa: F401 - imported, not skipped: CI must never pass this tier by skipping it
import transformers  # noqa: F401
from tests.real_bugs.corpus import RealBug
from tests.real_bugs.thirdparty_runs import ttrace
from tests.real_bugs.torchtitan_cases import CASES as TORCHTITAN_CASES
from tests.real_bugs.transformers_cases import CASES as TRANSFORMERS_CASES

pytestmark = pytest.mark.distributed

SLICE = {case.name: case for case in (*TORCHTITAN_CASES, *TRANSFORMERS_CASES)
         if case.name in ("torchtitan-chunked-loss-tp-grad-placement", "transformers-ep-router-grad-partial")}


def _first_divergence(report: dict) -> str:
    key = next(row["key"] for row in report["comparisons"] if row["status"] != "pass")
    return f"step {key['step']} / {key['phase']} / {key['fqn']} / {key['slot']}"


@pytest.mark.parametrize("name", sorted(SLICE))
def test_a_real_upstream_bug_is_detected_and_localized_to_what_its_fix_touched(name, tmp_path_factory):
    import fnmatch

    case: RealBug = SLICE[name]
    assert not case.slow and not case.control
    work = tmp_path_factory.mktemp("real_bugs") / case.name
    work.mkdir()
    reference, candidate = case.record(work, "fp32")

    compared = ttrace("compare", str(reference), str(candidate), "--json", "compare.json", cwd=work, timeout=600)
    assert compared.returncode == 1, compared.stdout[-3000:] + compared.stderr[-2000:]
    report = json.loads((work / "compare.json").read_text())
    assert not report["passed"]

    localized = ttrace("localize", str(reference), str(candidate), "--json", "localize.json", cwd=work, timeout=600)
    assert localized.returncode == 1, localized.stdout[-3000:] + localized.stderr[-2000:]
    culprits = json.loads((work / "localize.json").read_text())["culprits"]
    assert culprits and all(any(fnmatch.fnmatchcase(culprit, glob) for glob in case.expected_culprits)
                            for culprit in culprits), (culprits, case.expected_culprits, _first_divergence(report))
