"""Lightning's own `Trainer`, traced by `ttrace.attach_trainer(trainer)` and nothing else.

tests/thirdparty/lightning_train.py is a user's Lightning script: Lightning wraps the model in DDP and routes
`training_step` through the wrapper, runs the optimizer with a closure (the last micro-batch's forward and
backward happen inside `optimizer.step`), divides each loss by `accumulate_grad_batches`, clips the gradients and
shuffles the data with an unseeded `RandomSampler`; both runs validate every 3 batches, which in the reference
falls inside an optimizer step. A two-process DDP run with 2 accumulated batches must pass
against one process with 4, every micro-batch, loss, gradient and post-step parameter compared. A module that
computes otherwise on one process fails there first, and `ttrace localize`, re-running the Lightning script with
that module's inputs rewritten, names it. A user's own loop on Lightning Fabric (tests/thirdparty/fabric_train.py),
attached on the model `fabric.setup` returned, passes under DDP too."""

import json
import sys
from pathlib import Path

import pytest

from tests.cli_support import ttrace_command

# Imported, not skipped when missing: requirements.txt pins it, and CI must never pass this tier by skipping it.
import lightning  # noqa: F401

SCRIPT = Path(__file__).parent / "lightning_train.py"
FABRIC_SCRIPT = Path(__file__).parent / "fabric_train.py"
BUGGY_MODULE = "blocks.1.mlp"
_FLAGS = {"reference": ["--accumulation", "4", "--validate-every", "3"],
          "ddp2": ["--accumulation", "2", "--validate-every", "3"],
          "ddp2-bug": ["--accumulation", "2", "--bug", BUGGY_MODULE]}
_TORCHRUN = ["torchrun", "--standalone", "--nproc-per-node", "2"]


def _record(root: Path, name: str, command: list[str], script: list[str] | None = None) -> None:
    script = script or [str(SCRIPT), "--shuffle", *_FLAGS[name]]
    done = ttrace_command("record", "--out", name, "--timeout", "240", "--", *command, *script, cwd=root, timeout=300)
    assert done.returncode == 0, f"record {name}: " + done.stdout[-1500:] + done.stderr[-3000:]


def _compare(root: Path, candidate: str, reference: str = "reference") -> tuple[int, str, list[dict]]:
    report = root / f"{candidate}.json"
    done = ttrace_command("compare", reference, candidate, "--json", str(report), cwd=root, timeout=300)
    rows = json.loads(report.read_text())["comparisons"] if report.exists() else []
    return done.returncode, done.stdout, rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lightning")
    _record(root, "reference", [sys.executable])
    _record(root, "ddp2", _TORCHRUN)
    _record(root, "ddp2-bug", _TORCHRUN)
    _record(root, "fabric-reference", [sys.executable], [str(FABRIC_SCRIPT), "--accumulation", "4"])
    _record(root, "fabric-ddp2", _TORCHRUN, [str(FABRIC_SCRIPT), "--accumulation", "2"])
    return root


@pytest.mark.distributed
def test_the_integration_is_one_line():
    text = SCRIPT.read_text()
    calls = [line.strip() for line in text.splitlines() if "ttrace." in line and not line.strip().startswith(("python", "torchrun"))]
    assert "import ttrace_core as ttrace" in text and calls == ["ttrace.attach_trainer(trainer)"]


@pytest.mark.distributed
def test_ddp_with_accumulation_shuffling_and_validation_passes_against_one_process_with_every_micro_batch_compared(runs):
    code, out, rows = _compare(runs, "ddp2")
    assert code == 0, out[-3000:]
    assert {row["status"] for row in rows} == {"pass"}, out[-3000:]
    keys = [row["key"] for row in rows]
    # local batch k of process p is the reference's k x 2 + p, and the module is called once per micro-batch
    # (the DDP wrapper's call of it with the whole batch is not a module call)
    assert {(key["step"], key["micro_batch"], key["call"]) for key in keys if key["phase"] == "forward" and key["fqn"] == ""} \
        == {(step, micro_batch, 0) for step in (0, 1) for micro_batch in range(4)}
    # gradients after the closure's backward and post-step parameters, though the step hooks fire before the closure
    phases = {(key["phase"], key["slot"]) for key in keys}
    assert {("grad", "grad"), ("param", "value"), ("backward", "grad_output.0")} <= phases
    assert sum(1 for key in keys if key["phase"] == "grad") == 2 * 23
    assert sum(1 for key in keys if key["slot"] == "scalar.loss") == 8  # Lightning's 1 / accumulation undone


@pytest.mark.distributed
def test_a_module_wrong_on_one_process_fails_there_first_and_localize_names_it(runs):
    code, out, _ = _compare(runs, "ddp2-bug")
    assert code != 0
    assert f"step 0 / mb 1 / forward / {BUGGY_MODULE} / output.0" in out.split("first divergence")[1].splitlines()[2], out[-3000:]
    localized = ttrace_command("localize", "reference", "ddp2-bug", "--json", "localized.json", cwd=runs, timeout=500)
    assert localized.returncode == 1, localized.stdout[-2000:] + localized.stderr[-2000:]
    assert json.loads((runs / "localized.json").read_text())["culprits"] == [BUGGY_MODULE]


@pytest.mark.distributed
def test_a_loop_on_lightning_fabric_attached_on_what_setup_returned_passes_under_ddp(runs):
    # Fabric's wrapper names the model's modules `_forward_module.` on one device and `_forward_module.module.`
    # under DDP: attach traces the model inside it, so both runs name them as the model does
    code, out, rows = _compare(runs, "fabric-ddp2", "fabric-reference")
    assert code == 0 and {row["status"] for row in rows} == {"pass"}, out[-3000:]
    keys = [row["key"] for row in rows]
    assert "embed.weight" in {key["fqn"] for key in keys if key["phase"] == "grad"}
    assert {key["micro_batch"] for key in keys if key["phase"] == "forward"} == set(range(4))
