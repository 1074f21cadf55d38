"""Bring your own megatron-core script: tests/user_script/megatron_train_traced.py is a user's script of
the usual kind (GPTModel with the local spec, Megatron DDP, the Megatron optimizer clipping on every
step, get_forward_backward_func) with ttrace attached by `attach(ddp, optimizer)` alone. It imports
nothing from ttrace's examples; `ttrace record` runs it under torchrun, and `ttrace estimate` /
`ttrace localize` relaunch its recorded command."""

import difflib
import json
import subprocess
from pathlib import Path

import pytest

from tests.cli_support import record_script, ttrace_command

SCRIPTS = Path(__file__).parent / "user_script"
PLAIN, TRACED = SCRIPTS / "megatron_train.py", SCRIPTS / "megatron_train_traced.py"
pytestmark = pytest.mark.distributed


def _ttrace(*args: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    return ttrace_command(*args, cwd=cwd, timeout=timeout)


def _record(out: Path, nproc: int, *flags: str) -> None:
    record_script(TRACED, out, nproc, *flags)


def _compare(root: Path, candidate: str, *flags: str, reference: str = "ref") -> tuple[int, dict]:
    report = root / f"{candidate}{'-'.join(flags)}.json"
    done = _ttrace("compare", reference, candidate, "--json", str(report), *flags, cwd=root)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return done.returncode, json.loads(report.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_byos")
    _record(root / "ref", 1)
    _record(root / "tp2", 2, "--tp", "2")
    return root


def _failing(report: dict) -> list[dict]:
    return [c for c in report["comparisons"] if c["status"] not in ("pass",)]


def test_the_integration_is_at_most_10_lines():
    plain, traced = PLAIN.read_text().splitlines(), TRACED.read_text().splitlines()
    opcodes = difflib.SequenceMatcher(a=plain, b=traced, autojunk=False).get_opcodes()
    code = [line for tag, _, _, j1, j2 in opcodes if tag in ("insert", "replace") for line in traced[j1:j2]
            if not line.startswith(("step)", "megatron_train.py"))]  # the docstring's two lines
    assert 0 < len(code) <= 10, code
    assert "examples" not in TRACED.read_text() and "ttrace_core as ttrace" not in PLAIN.read_text()


def test_tp2_passes_with_every_step_clipped_and_records_the_step_scalars(runs):
    code, report = _compare(runs, "tp2")
    assert code == 0, _failing(report)[:3]
    scalars = {c["key"]["slot"] for c in report["comparisons"] if c["key"]["phase"] == "step"}
    assert {"scalar.grad_norm", "scalar.clip_coef", "scalar.lr", "scalar.loss_scale", "scalar.skipped_steps"} <= scalars
    coefficients = [c for c in report["comparisons"] if c["key"]["slot"] == "scalar.clip_coef"]
    assert coefficients and all(c["status"] == "pass" for c in coefficients)
    losses = [c for c in report["comparisons"] if c["key"]["slot"] == "scalar.loss"]
    assert len(losses) == 2 * 4  # two steps of four micro-batches
    manifest = json.loads((runs / "tp2" / "manifest.json").read_text())
    assert manifest["degrees"]["tp"] == 2 and manifest["model"]["parameters"]["output_layer.weight"] == [128, 64]


def test_tp2_passes_against_the_perturbation_estimate(runs):
    done = _ttrace("estimate", "ref", "--samples", "2", cwd=runs)
    assert done.returncode == 0, done.stderr[-3000:]
    code, report = _compare(runs, "tp2")
    assert code == 0, _failing(report)[:3]


@pytest.mark.parametrize("flags", [("--tp", "2", "--sp"), ("--pp", "2"), ("--tp", "2", "--recompute")],
                         ids=["tp2-sp", "pp2", "tp2-full-recompute"])
def test_sequence_and_pipeline_parallel_pass(runs, flags):
    """(Full recompute runs each layer's first forward with autograd off: its modules' backward used to be missing.)"""
    name = "-".join(f.strip("-") for f in flags)
    _record(runs / name, 2, *flags)
    code, report = _compare(runs, name)
    assert code == 0, _failing(report)[:3]


@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_learnable_attention_sinks_map_as_head_shards(runs, precision):
    """softmax_offset carries no TP attribute; the masked softmax gets it as a 1-D input. One step: from
    the second on, megatron's own TP bug (rank 1's sinks left out of the clipped norm) shows."""
    reference, candidate = f"ref-sinks{''.join(precision)}", f"sinks{''.join(precision)}"
    _record(runs / reference, 1, "--sinks", "--steps", "1", *precision)
    _record(runs / candidate, 2, "--tp", "2", "--sinks", "--steps", "1", *precision)
    code, report = _compare(runs, candidate, reference=reference)
    assert code == 0, _failing(report)[:3]
    sinks = [c for c in report["comparisons"] if c["key"]["fqn"].endswith("softmax_offset")]
    assert sinks and all(c["status"] == "pass" for c in sinks)


def test_a_module_bug_fails_and_localize_names_the_module(runs):
    _record(runs / "bug", 2, "--tp", "2", "--bug", "module")
    code, report = _compare(runs, "bug")
    assert code == 1
    done = _ttrace("localize", "ref", "bug", cwd=runs, timeout=600)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    assert "culprit: decoder.layers.1.mlp.linear_fc2" in done.stdout, done.stdout[-3000:]


def test_a_grad_norm_bug_fails_at_the_gradient_norm_and_is_localized_there(runs):
    _record(runs / "norm-bug", 2, "--tp", "2", "--bug", "grad-norm")
    code, report = _compare(runs, "norm-bug")
    assert code == 1
    failing = [c for c in _failing(report) if c["key"]["step"] == 0]  # step 1 inherits the clipped update
    assert failing and all(c["key"]["phase"] in ("step", "param") for c in failing), failing[:3]
    assert any(c["key"]["slot"] == "scalar.grad_norm" for c in failing)
    done = _ttrace("localize", "ref", "norm-bug", cwd=runs, timeout=600)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    culprits = [line for line in done.stdout.splitlines() if line.startswith("culprit:")]
    assert culprits == ["culprit: the gradient norm / clipping  (introduces error in step)"], done.stdout[-3000:]
