"""megatron-gpt end to end: real megatron-core layouts on CPU ranks against the single-rank reference."""

from pathlib import Path

import pytest

from tests.conftest import MEGATRON_SIZE, load_comparison, run_ttrace

pytestmark = pytest.mark.distributed

LAYOUTS = {"tp2": ["--tp", "2"], "tp2-sp": ["--tp", "2", "--sp"], "pp2": ["--pp", "2"], "dp2": ["--dp", "2"],
           "dp2-dist-opt": ["--dp", "2", "--dist-opt"], "tp2xpp2-sp": ["--tp", "2", "--pp", "2", "--sp"]}
TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "ttrace_examples" / "megatron_gpt" / "train.py"


@pytest.mark.parametrize("name", list(LAYOUTS), ids=list(LAYOUTS))
def test_clean_megatron_layout_matches_the_reference(traces, megatron_reference, name):
    out = traces / f"megatron-{name}"
    run_ttrace("example", "megatron-gpt", *MEGATRON_SIZE, *LAYOUTS[name], "--steps", "2", "--out", str(out), check_codes=(0,))
    report = traces / f"megatron-{name}.json"
    result = run_ttrace("compare", str(megatron_reference), str(out), "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    comparison = load_comparison(report)
    assert comparison.steps_compared == [0, 1] and all(comparison.comparisons)
    assert {c.key.phase for c in comparison.comparisons} == {"forward", "backward", "grad", "step", "param"}
    assert len(comparison.comparisons) > 1200
    if name == "tp2":  # a clean candidate: localization names no culprit
        localized = run_ttrace("localize", str(megatron_reference), str(out), check_codes=(0,))
        assert "no divergence: no culprit" in localized.stdout


def test_integration_takes_at_most_10_lines():
    marked = [line for line in TRAIN_SCRIPT.read_text().splitlines() if line.rstrip().endswith("# ttrace")]
    assert 0 < len(marked) <= 10 and any("ttrace.attach(ddp, optimizer" in line for line in marked), marked


def test_moe_under_expert_parallelism_matches_the_reference(traces, megatron_moe_reference):
    """Experts of EP rank r are global experts r * num_local + i; their gradients map back, and their
    activations are traced by token through megatron's allgather dispatcher."""
    out = traces / "megatron-moe-dp2-ep2"
    run_ttrace("example", "megatron-gpt", *MEGATRON_SIZE, "--moe", "--dp", "2", "--ep", "2", "--out", str(out), check_codes=(0,))
    report = traces / "megatron-moe-dp2-ep2.json"
    result = run_ttrace("compare", str(megatron_moe_reference), str(out), "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    fqns = {c.key.fqn for c in load_comparison(report).comparisons}
    assert {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
            "decoder.layers.0.mlp.experts.local_experts.1", "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2"} <= fqns
