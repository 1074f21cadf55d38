"""torchtitan 0.3.0's llama3 judged against an independent implementation: transformers' LlamaForCausalLM trained as
torchtitan's Trainer trains it (ttrace_examples/hf_llama/torchtitan_reference.py), through the map
hf-llama--torchtitan-llama3 (docs/porting.md).

One HF reference (estimated, the default 4 samples) and three torchtitan runs of the smallest llama3 config
that still exercises the map (debug model, 1 step of 2 micro-batches of 2 x 64 tokens, fp32 parameters and
compute): torchtitan's TP2 candidate (sequence and loss parallelism) must pass with every tensor compared or
declared unmapped; RMSNorm with its epsilon outside the root (ttrace_examples/torchtitan/model_bugs.py), at
TP1 and TP2 alike, must fail against HF first at `layers.0.attention_norm` and pass against the same code on
one rank. About 2.5 minutes on 2 cores; the bug table with localization is benchmarks/porting.py --only torchtitan.

With 2 estimate samples the correct port fails at one post-step norm weight (ratio 1.3): an element of
layers.1.ffn_norm.weight's gradient cancels to about 1e-5 of the tensor's largest, its fp32 round-off is a few
percent of it, and AdamW's first step divides it by its own size. In float64 the two implementations agree to
about 1e-15 (docs/porting.md); 2 samples under-sample that spread.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.cli_support import ttrace_command

import torchtitan  # noqa: E402,F401 - imported, not skipped: CI must never pass this tier by skipping it
import transformers  # noqa: E402,F401
pytestmark = pytest.mark.distributed

MAP = "hf-llama--torchtitan-llama3"
BUG = "norm-eps-outside-sqrt"
TRAINING = ["--module", "ttrace_examples.torchtitan", "--config", "llama3_debugmodel", "--training.steps", "1",
            "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
            "--training.mixed_precision_param", "float32"]
"""torchtitan's CLI, the same for the HF reference and every candidate; fp32, the HF reference's only precision."""


def _record(out: Path, command: list[str]) -> None:
    done = ttrace_command("record", "--out", str(out), "--timeout", "300", "--", *command, *TRAINING,
                          cwd=out.parent, timeout=360)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _torchrun(nproc: int, *module: str) -> list[str]:
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", *module,
            "--parallelism.tensor_parallel_degree", str(nproc)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchtitan_hf")
    _record(root / "hf", [sys.executable, "-m", "ttrace_examples.hf_llama.torchtitan_reference"])
    estimated = ttrace_command("estimate", "hf", cwd=root, timeout=600)
    assert estimated.returncode == 0, estimated.stdout[-2000:] + estimated.stderr[-2000:]
    _record(root / "tp2", _torchrun(2, "ttrace_examples.torchtitan"))
    for nproc in (1, 2):
        _record(root / f"bug{nproc}", _torchrun(nproc, "ttrace_examples.torchtitan.model_bugs", "--bug", BUG))
    return root


def _compare(runs: Path, reference: str, candidate: str, *flags: str) -> tuple[int, dict]:
    out = f"{reference}-{candidate}.json"
    done = ttrace_command("compare", reference, candidate, "--json", out, *flags, cwd=runs)
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    return done.returncode, json.loads((runs / out).read_text())


def test_torchtitan_tp2_passes_against_hf_with_every_tensor_compared_or_declared(runs):
    returncode, result = _compare(runs, "hf", "tp2", "--map", MAP)
    failing = [(c["key"], c["message"]) for c in result["comparisons"] if c["status"] != "pass"]
    assert returncode == 0 and result["verdict"] == "equivalent", failing[:5]
    coverage = result["coverage"]
    assert coverage["num_unaccounted"] == 0, coverage["unaccounted"]
    assert coverage["compared_elementwise"] == coverage["tensors_expected"] == len(result["comparisons"])
    assert coverage["unmapped"] > 0 and all(f"map {MAP}" in reason for reason in coverage["unmapped_reasons"])
    compared = {(k["phase"], k["fqn"], k["slot"]) for k in (c["key"] for c in result["comparisons"])}
    # the map's non-trivial rules are exercised, not skipped: fused wqkv with rotary-permuted q and k rows,
    # its summed input gradient, the per-chunk lm_head, the step's clipping
    assert {("forward", "layers.0.attention.qkv_linear.wqkv", "output.0"), ("grad", "layers.0.attention.qkv_linear.wqkv.weight", "grad"),
            ("backward", "layers.0.attention.qkv_linear.wqkv", "grad_input.0"), ("forward", "lm_head", "output.0"),
            ("step", "(gradient clipping)", "scalar.grad_norm")} <= compared


def test_a_norm_bug_fails_against_hf_at_the_norm_and_passes_against_the_same_code(runs):
    for candidate in ("bug1", "bug2"):
        returncode, result = _compare(runs, "hf", candidate, "--map", MAP)
        assert returncode == 1, candidate
        first = next(c["key"] for c in result["comparisons"] if c["status"] != "pass")
        assert (first["phase"], first["fqn"], first["slot"]) == ("forward", "layers.0.attention_norm", "output.0"), first
    returncode, result = _compare(runs, "bug1", "bug2")
    assert returncode == 0 and result["verdict"] == "equivalent"
    assert any(c["key"]["fqn"] == "layers.0.attention_norm" for c in result["comparisons"])
