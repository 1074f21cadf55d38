"""transformers' Mixtral as the independent reference of megatron-core's MoE (docs/porting.md, issue 44 item 4):
`ttrace example hf-llama --moe` against `ttrace example megatron-gpt --llama --moe` under expert parallelism
(DP 2 x EP 2, 4 experts, top-2, 2 layers, fp32), compared through the map hf-mixtral--megatron-gpt-moe.

Every expert's weights, gradients and updates are compared as slices of HF's fused 3-D expert parameters (the
map's `select` op); each expert's own activations, which no HF module holds, are listed as unmapped with
their reason. A correct port passes; a routing bug in megatron's model code (the top-k probabilities not
renormalized) fails against HF at the MoE layer and passes against the same code on one rank.
"""

from pathlib import Path

import pytest

from tests.conftest import load_comparison, run_ttrace

pytestmark = pytest.mark.distributed

MAP = "hf-mixtral--megatron-gpt-moe"
MOE = ("--num-layers", "2", "--micro-batches", "2", "--num-query-groups", "2", "--moe", "--num-experts", "4")
EXPERT_PARALLEL = ("--dp", "2", "--ep", "2")
BUG = ("--bug", "router-topk-unnormalized")
EXPERT_WEIGHTS = {f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc{fc}.weight"
                  for layer in range(2) for expert in range(4) for fc in (1, 2)}


def record(out: Path, workload: str, *flags: str) -> Path:
    if not (out / "manifest.json").exists():
        run_ttrace("example", workload, *MOE, *flags, "--out", str(out), timeout=600, check_codes=(0,))
    return out


def compare(reference: Path, candidate: Path, *flags: str, codes=(0, 1)):
    report = candidate.parent / f"{candidate.name}-vs-{reference.name}.json"
    result = run_ttrace("compare", str(reference), str(candidate), "--json", str(report), *flags, check_codes=codes)
    return result, load_comparison(report)


@pytest.fixture(scope="module")
def hf(traces) -> Path:
    return record(traces / "porting-moe-hf", "hf-llama")


def test_a_correct_moe_port_under_expert_parallelism_passes_against_hf(hf, traces):
    candidate = record(traces / "porting-moe-dp2-ep2", "megatron-gpt", "--llama", *EXPERT_PARALLEL)
    result, comparison = compare(hf, candidate, "--map", MAP, codes=(0,))
    assert comparison.verdict == "equivalent"
    compared = {(c.key.phase, c.key.fqn, c.key.slot) for c in comparison.comparisons}
    for weight in EXPERT_WEIGHTS:  # every expert of both EP ranks: its gradient and its updated value
        assert {("grad", weight, "grad"), ("param", weight, "value")} <= compared, weight
    assert {("forward", "decoder.layers.1.mlp", "output.0"), ("backward", "decoder.layers.1.mlp", "grad_input.0"),
            ("grad", "decoder.layers.0.mlp.router.weight", "grad"),
            ("backward", "decoder.layers.0.mlp.router", "grad_input.0")} <= compared
    assert not any(".local_experts." in fqn for phase, fqn, _ in compared if phase in ("forward", "backward"))
    coverage = comparison.coverage
    assert coverage.num_unaccounted == 0
    assert any("HF computes every expert in one MixtralExperts module" in line for line in coverage.unmapped_reasons)
    assert "unmapped: map hf-mixtral--megatron-gpt-moe: candidate: each expert's activations" in result.stdout


def test_a_routing_bug_fails_at_the_moe_layer_against_hf_and_passes_the_same_code(hf, traces):
    candidate = record(traces / "porting-moe-bug-dp2-ep2", "megatron-gpt", "--llama", *EXPERT_PARALLEL, *BUG)
    same_code = record(traces / "porting-moe-bug-ref", "megatron-gpt", "--llama", *BUG)
    _, against_hf = compare(hf, candidate, "--map", MAP, codes=(1,))
    first = against_hf.first_divergence
    assert (first.key.phase, first.key.fqn, first.key.slot) == ("forward", "decoder.layers.0.mlp", "output.0")
    assert first.status == "mismatch" and first.ratio > 100
    passing = {(c.key.fqn, c.key.slot) for c in against_hf.comparisons if c}
    assert ("decoder.layers.0.mlp.router.weight", "value.initial") in passing  # same weights, another routing function
    _, against_itself = compare(same_code, candidate, codes=(0,))
    assert against_itself.verdict == "equivalent"
