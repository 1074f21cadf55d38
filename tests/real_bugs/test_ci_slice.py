"""The CI slice of the real-bug corpus: one upstream bug per framework, detected and localized, and one
negative control that must pass (benchmarks/real_bugs.py runs every case, in fp32 and bf16).

Each case records a one-rank reference and a 2-rank candidate (OMP_NUM_THREADS=1, free ports, a timeout on
every process the runner starts), then runs `ttrace compare` and `ttrace localize` as the CLI. The
megatron-core and PyTorch cases are here; the torchtitan and transformers cases keep their own test
functions. In-process tests check the registry and the culprit matching the runner reports.
"""

from __future__ import annotations

import warnings

import pytest

from tests.real_bugs.corpus import FRAMEWORKS, RealBug
from tests.real_bugs.runner import CaseResult, matches, run_case

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected on CPU
    import megatron.core  # noqa: F401 - imported, not skipped: CI must never pass this slice by skipping it

from tests.real_bugs import megatron_cases, pytorch_cases  # noqa: E402

MINE = megatron_cases.CASES + pytorch_cases.CASES


def _case(name: str) -> RealBug:
    return next(case for case in MINE if case.name == name)


def _assert_found(result: CaseResult, case: RealBug) -> None:
    assert result.error is None, result.error
    assert result.detected, f"{case.name}: compare passed ({result.verdict})"
    assert result.localized, f"{case.name}: localize named {result.culprits}, expected one of {case.expected_culprits}"


# ---- the registry --------------------------------------------------------------------------------


def test_every_case_names_a_public_upstream_link_and_what_the_fix_touched():
    assert len({case.name for case in MINE}) == len(MINE)
    for case in MINE:
        assert case.framework in FRAMEWORKS
        assert case.source.startswith(("https://github.com/NVIDIA/Megatron-LM/", "https://github.com/pytorch/pytorch/"))
        assert case.touched.strip() and case.summary.strip()
        assert bool(case.expected_culprits) != case.control, case.name
        assert case.fix is None or case.fix.startswith("https://github.com/"), case.name


def test_megatron_and_pytorch_cases_hold_bugs_moe_bugs_and_controls():
    bugs = [case for case in MINE if not case.control]
    assert len(bugs) >= 4 and sum(case.moe for case in bugs) >= 2
    assert {case.framework for case in bugs} == {"megatron-core", "pytorch"}
    assert {case.reproduced_by for case in bugs} == {"fix reverted", "as shipped"}
    assert sum(case.control for case in MINE) >= 3


@pytest.mark.parametrize(("culprits", "expected", "matched"), [
    (["decoder.layers.0.mlp.router.weight, decoder.layers.1.mlp.router.weight (TP (sequence parallel))"],
     ("*mlp.router*",), True),
    (["moe.experts.w1, moe.experts.w2 (EP)"], ("moe.experts*",), True),
    (["the loss function"], ("the loss function",), True),
    (["decoder.layers.1.self_attention"], ("*mlp.router*",), False),
    ([], ("moe.experts*",), False),
], ids=["sync-params", "ep-params", "loss", "other-module", "nothing-named"])
def test_a_culprit_matches_when_one_named_module_or_parameter_fits_a_glob(culprits, expected, matched):
    assert matches(culprits, expected) is matched


# ---- one bug per framework, and a control ---------------------------------------------------------


@pytest.mark.distributed
def test_megatron_core_599_router_under_sequence_parallel_is_detected_and_localized(tmp_path):
    case = _case("mcore-moe-router-sp-replica")
    result = run_case(case, tmp_path, "fp32")
    _assert_found(result, case)
    assert result.first_divergence == "step 0 / grad / decoder.layers.0.mlp.router.weight / grad"
    assert result.deciding_test == "replica drift"


@pytest.mark.distributed
def test_pytorch_167178_fsdp2_divide_factor_on_one_rank_is_detected_and_localized(tmp_path):
    case = _case("torch-fsdp2-divide-factor-one-rank")
    result = run_case(case, tmp_path, "fp32")
    _assert_found(result, case)
    assert result.first_divergence == "step 0 / grad / moe.experts.w1 / grad"
    assert result.deciding_test == "mismatch" and "scaling" in result.bug_class


@pytest.mark.distributed
def test_a_control_that_fixes_167178_by_hand_passes(tmp_path):
    result = run_case(_case("torch-control-expert-grads-divided-by-hand"), tmp_path, "fp32")
    assert result.error is None, result.error
    assert not result.detected, f"false alarm: {result.verdict} at {result.first_divergence} (ratio {result.ratio})"
