"""megatron-gpt with virtual pipeline chunks (--pp 2 --vpp 2, megatron's interleaved 1F1B schedule)
against the single-rank reference: every chunk traced under the reference's global layer names and
micro-batch ids, and a reduction skipped in one chunk named at that chunk's layers."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

from tests.conftest import load_comparison, run_ttrace

pytestmark = pytest.mark.distributed

VPP_SIZE = ("--num-layers", "4", "--steps", "2")
"""pp 2 x vpp 2 deals 4 layers out as rank 0: global layers 0 and 2, rank 1: 1 and 3, one per chunk."""
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def vpp_reference(traces) -> Path:
    out = traces / "megatron-vpp-reference"
    run_ttrace("example", "megatron-gpt", *VPP_SIZE, "--out", str(out), check_codes=(0,))
    return out


def _keys_per_layer(keys) -> collections.Counter:
    """Global layer index -> how many tensor keys name a module or parameter inside it."""
    return collections.Counter(int(key.fqn.split(".")[2]) for key in keys if key.fqn.startswith("decoder.layers."))


def test_two_virtual_chunks_per_rank_match_the_reference_tensor_for_tensor(traces, vpp_reference):
    from ttrace_core.format.reader import RunReader

    out = traces / "megatron-pp2-vpp2"
    run_ttrace("example", "megatron-gpt", *VPP_SIZE, "--pp", "2", "--vpp", "2", "--out", str(out), check_codes=(0,))
    report = traces / "megatron-pp2-vpp2.json"
    result = run_ttrace("compare", str(vpp_reference), str(out), "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    comparison = load_comparison(report)
    assert comparison.steps_compared == [0, 1] and all(comparison.comparisons)
    coverage = comparison.coverage
    assert coverage.missing_in_candidate == coverage.missing_in_reference == coverage.not_compared == 0
    assert coverage.compared_elementwise == coverage.tensors_expected == len(comparison.comparisons)
    assert {c.key.phase for c in comparison.comparisons} == {"forward", "backward", "grad", "step", "param"}
    with RunReader(vpp_reference) as reference:
        expected = _keys_per_layer(reference.keys())
    compared = _keys_per_layer(c.key for c in comparison.comparisons)
    # Every global layer, whichever chunk of whichever rank holds it, is compared key for key with the
    # reference: a chunk left untraced (or traced under its local name) would leave its layers short.
    assert sorted(compared) == list(range(NUM_LAYERS)) and compared == expected
    assert len(set(compared.values())) == 1 and min(compared.values()) > 600, compared
    micro_batches = {c.key.micro_batch for c in comparison.comparisons if c.key.fqn == "decoder.layers.2"}
    assert micro_batches == {0, 1, 2, 3}  # rank 0's second chunk: the interleaved schedule's own order


def test_a_chunk_whose_gradients_skip_the_data_parallel_reduction_is_named_at_its_layers(traces, vpp_reference):
    """pp 2 x vpp 2 x dp 2 (4 ranks): the last virtual stage's DDP all-reduce is skipped, so global layers
    2 and 3 (the second chunk of each pipeline rank) step with each DP rank's own gradient."""
    from ttrace_core.record.command import session_environment
    from ttrace_core.record.launch import run_ranks
    from ttrace_core.record.session import SESSION_ENV, SessionSpec
    from ttrace_examples.launch import run_config

    out = traces / "megatron-pp2-vpp2-dp2-unreduced-chunk"
    # One step: the skipped reduction shows in its gradients (compared against the reference's first step).
    config = run_config("megatron-gpt", {"pp": 2, "vpp": 2, "dp": 2, "steps": 1, "model": {"num_layers": NUM_LAYERS}})
    spec = SessionSpec(out=str(out), launcher_pid=os.getpid(), seed=config.seed)
    with session_environment(spec) as env:
        run_ranks("tests.examples.megatron_vpp_workers:train_with_one_chunk_unreduced", config.to_dict(),
                  config.world_size, timeout_s=400, env={SESSION_ENV: env[SESSION_ENV]})
    report = traces / "megatron-pp2-vpp2-dp2-unreduced-chunk.json"
    result = run_ttrace("compare", str(vpp_reference), str(out), "--json", str(report))
    assert result.returncode == 1, result.stdout + result.stderr
    comparisons = load_comparison(report).comparisons
    first = next(c for c in comparisons if not c)
    assert first.key.phase == "grad" and first.key.fqn.startswith(("decoder.layers.2.", "decoder.layers.3.")), first.key
    assert first.replica_drift is not None and first.ratio > 100  # each DP rank kept its own gradient
    failing_layers = {int(c.key.fqn.split(".")[2]) for c in comparisons
                      if not c and c.key.step == 0 and c.key.phase == "grad" and c.key.fqn.startswith("decoder.layers.")}
    assert failing_layers == {2, 3}  # the reduced chunk's layers 0 and 1 keep their step-0 gradients
