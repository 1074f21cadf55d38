"""megatron-core MoE on CPU ranks: experts traced by token (integrations/megatron_moe.py, record/token_rows.py).

4 experts, top-2, megatron's alltoall dispatcher, expert parallelism 2 over data parallelism 2: each
expert receives, in one call, the tokens of two data-parallel ranks' micro-batches that chose it.
"""

from pathlib import Path

import pytest

from tests.conftest import MEGATRON_SIZE, load_comparison, run_ttrace

pytestmark = pytest.mark.distributed

MOE = (*MEGATRON_SIZE, "--moe", "--num-experts", "4", "--micro-batches", "2", "--steps", "1")
EXPERT_PARALLEL = ("--dp", "2", "--ep", "2", "--dispatcher", "alltoall")
EXPERTS = {f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}" for layer in range(2) for expert in range(4)}


@pytest.fixture(scope="module")
def moe_reference(traces) -> Path:
    out = traces / "megatron-moe4-reference"
    run_ttrace("example", "megatron-gpt", *MOE, "--out", str(out), check_codes=(0,))
    return out


def test_experts_under_expert_parallelism_are_traced_by_token(traces, moe_reference):
    out = traces / "megatron-moe4-dp2-ep2"
    run_ttrace("example", "megatron-gpt", *MOE, *EXPERT_PARALLEL, "--out", str(out), check_codes=(0,))
    report = traces / "megatron-moe4-dp2-ep2.json"
    result = run_ttrace("compare", str(moe_reference), str(out), "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    comparisons = load_comparison(report).comparisons
    expert_activations = [c for c in comparisons if c.key.phase in ("forward", "backward") and ".local_experts." in c.key.fqn]
    # every expert, its two linears, forward and backward, for both global micro-batches
    assert {c.key.fqn for c in expert_activations if c.key.fqn in EXPERTS} == EXPERTS
    assert {c.key.micro_batch for c in expert_activations} == {0, 1}
    assert {c.key.slot for c in expert_activations} >= {"input.0", "output.0", "grad_output.0", "grad_input.0"}
    assert all(expert_activations) and len(expert_activations) >= 8 * 2 * 10
    # the token count per expert varies with the routing: rows really are the routed tokens, not a whole batch
    rows = {c.shape[0] for c in expert_activations if c.key.slot == "input.0" and c.key.fqn in EXPERTS}
    assert len(rows) > 1 and max(rows) < 32
    assert {"decoder.layers.0.mlp.router", "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"} <= \
        {c.key.fqn for c in comparisons}


def test_an_expert_wrong_on_one_expert_parallel_rank_is_named(traces, moe_reference):
    """expert-probs-twice: EP rank 1's first local expert (global expert 2) scales its output by the routing
    probabilities again. The first divergence is that expert's output, and localization names it."""
    out = traces / "megatron-moe4-expert-bug"
    run_ttrace("example", "megatron-gpt", *MOE, *EXPERT_PARALLEL, "--bug", "expert-probs-twice", "--out", str(out),
               check_codes=(0,))
    localized = run_ttrace("localize", str(moe_reference), str(out), timeout=600)
    assert localized.returncode == 1, localized.stdout + localized.stderr
    culprits = [line.split()[1] for line in localized.stdout.splitlines() if line.startswith("culprit:")]
    assert culprits and culprits[0] == "decoder.layers.0.mlp.experts.local_experts.2", localized.stdout
    assert set(culprits) <= {f"decoder.layers.{layer}.mlp.experts.local_experts.2" for layer in range(2)}
