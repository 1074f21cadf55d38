"""The Hugging Face `transformers.Trainer`, traced by `ttrace.attach_trainer(trainer)` and nothing else.

tests/thirdparty/hf_trainer_train.py is a user's Trainer script: the Trainer builds the optimizer (accelerate's
AcceleratedOptimizer), wraps the model in DDP, shards the batches and normalizes the loss by the step's token
count. A two-process DDP run with 2 accumulation steps must pass against one process with 4, every micro-batch,
gradient and post-step parameter compared. With `average_tokens_across_devices=False` each process divides its
loss by its own token count, and the gradients are no longer one process's: ttrace must fail, first at the
token count the model was handed. A module that computes otherwise on one process fails, and `ttrace localize`,
re-running the Trainer script with that module's inputs rewritten, names it. (On CPU accelerate runs the Trainer as DDP only: its FSDP and tensor
parallelism need a GPU backend, docs/transformers.md.)"""

import json
import sys
from pathlib import Path

import pytest

from tests.cli_support import ttrace_command

# Imported, not skipped when missing: requirements.txt pins them, and CI must never pass this tier by skipping it.
import accelerate  # noqa: F401
import transformers  # noqa: F401

SCRIPT = Path(__file__).parent / "hf_trainer_train.py"
BUGGY_MODULE = "model.layers.1.mlp.down_proj"


def _record(root: Path, name: str, command: list[str]) -> None:
    done = ttrace_command("record", "--out", name, "--timeout", "240", "--", *command, str(SCRIPT), *_FLAGS[name],
                          cwd=root, timeout=300)
    assert done.returncode == 0, f"record {name}: " + done.stdout[-1500:] + done.stderr[-3000:]


_FLAGS = {"reference": ["--accumulation", "4"], "ddp2": ["--accumulation", "2"],
          "ddp2-local-tokens": ["--accumulation", "2", "--local-tokens"],
          "ddp2-bug": ["--accumulation", "2", "--bug", BUGGY_MODULE],
          # the Trainer's torch_compile; the eager backend spares the suite inductor's C++ build (inductor passes too,
          # by hand: 167/167)
          "ddp2-compile": ["--accumulation", "2", "--compile", "eager"]}
_TORCHRUN = ["torchrun", "--standalone", "--nproc-per-node", "2"]


def _compare(root: Path, candidate: str) -> tuple[int, str, list[dict]]:
    report = root / f"{candidate}.json"
    done = ttrace_command("compare", "reference", candidate, "--json", str(report), cwd=root, timeout=300)
    rows = json.loads(report.read_text())["comparisons"] if report.exists() else []
    return done.returncode, done.stdout, rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_trainer")
    _record(root, "reference", [sys.executable])
    _record(root, "ddp2", _TORCHRUN)
    _record(root, "ddp2-local-tokens", _TORCHRUN)
    _record(root, "ddp2-bug", _TORCHRUN)
    _record(root, "ddp2-compile", _TORCHRUN)
    return root


@pytest.mark.distributed
def test_the_integration_is_one_line():
    text = SCRIPT.read_text()
    lines = [line.strip() for line in text.splitlines() if "ttrace" in line and not line.startswith(("#", '"', " "))]
    calls = [line.strip() for line in text.splitlines() if "ttrace." in line and not line.strip().startswith(("python", "torchrun"))]
    assert lines == ["import ttrace_core as ttrace"] and calls == ["ttrace.attach_trainer(trainer)"]


@pytest.mark.distributed
def test_ddp_with_accumulation_passes_against_one_process_with_every_micro_batch_and_parameter_compared(runs):
    code, out, rows = _compare(runs, "ddp2")
    assert code == 0, out[-3000:]
    assert {row["status"] for row in rows} == {"pass"}, out[-3000:]
    keys = [row["key"] for row in rows]
    # local micro-batch k of process p is the reference's k x 2 + p: all four of each step, from both processes
    assert {(key["step"], key["micro_batch"]) for key in keys if key["phase"] == "forward"} == \
        {(step, micro_batch) for step in (0, 1) for micro_batch in range(4)}
    # the optimizer inside accelerate's wrapper is hooked: reduced gradients and post-step parameters are compared
    phases = {(key["phase"], key["slot"]) for key in keys}
    assert {("grad", "grad"), ("param", "value"), ("backward", "grad_output.0")} <= phases
    assert sum(1 for key in keys if key["phase"] == "param" and key["slot"] == "value") >= 2 * 21
    # the loss the Trainer scales by the data-parallel size compares at the model's own scale
    assert sum(1 for key in keys if key["slot"] == "scalar.loss") == 8


@pytest.mark.distributed
def test_a_loss_normalized_by_each_process_own_token_count_fails_at_that_count(runs):
    code, out, rows = _compare(runs, "ddp2-local-tokens")
    assert code != 0
    failed = [row for row in rows if row["status"] != "pass"]
    assert failed and all(row["status"] == "mismatch" for row in failed), out[-3000:]
    first = out.split("first divergence")[1].splitlines()[2]
    assert "step 0 / mb 0 / forward" in first and "num_items_in_batch" in first, out[-3000:]
    # and what it changes downstream: the reduced gradients
    assert any(row["key"]["phase"] == "grad" for row in failed)


@pytest.mark.distributed
def test_a_module_wrong_on_one_process_fails_and_localize_names_it(runs):
    code, out, _ = _compare(runs, "ddp2-bug")
    assert code != 0 and f"forward / {BUGGY_MODULE} / output.0" in out.split("first divergence")[1].splitlines()[2]
    localized = ttrace_command("localize", "reference", "ddp2-bug", "--json", "localized.json", cwd=runs, timeout=500)
    assert localized.returncode == 1, localized.stdout[-2000:] + localized.stderr[-2000:]
    assert json.loads((runs / "localized.json").read_text())["culprits"] == [BUGGY_MODULE]


@pytest.mark.distributed
def test_the_trainers_torch_compile_passes_with_the_compiled_model_a_blind_spot(runs):
    """torch_compile=True: the model inside is compiled whole, so its modules are blind spots and its own outputs,
    parameters, gradients and updates are compared. It computes its loss from its logits inside the compiled code,
    which hands the logits no gradient: the reference's logits gradient is not counted missing. Before, the correct
    run failed with it missing for every micro-batch."""
    code, out, rows = _compare(runs, "ddp2-compile")
    assert code == 0, out[-3000:]
    keys = {(row["key"]["phase"], row["key"]["fqn"], row["key"]["slot"]) for row in rows}
    assert {("forward", "", "output.1"), ("backward", "", "grad_output.0"), ("grad", "lm_head.weight", "grad"),
            ("param", "model.layers.1.mlp.down_proj.weight", "value")} <= keys
    assert not any(phase in ("forward", "backward") and fqn not in ("", "(loss)") for phase, fqn, _ in keys)
    assert "compiled_boundaries; e.g. step 0 / mb 0 / backward / <root> / grad_output.1" in out
