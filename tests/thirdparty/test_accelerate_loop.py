"""A user's own loop on Hugging Face accelerate (tests/thirdparty/accelerate_train.py), launched by
`accelerate launch` as its docs say: two processes with 2 accumulation steps must pass against one process with 4,
every micro-batch, reduced gradient and post-step parameter compared (accelerate's DDP, its data loader sharded by
process, its `accumulate()` skipping the gradient all-reduce on all but the last micro-batch). A block wrong on
process 1 fails first at that block in a micro-batch process 1 ran."""

import json
from pathlib import Path

import pytest

from tests.cli_support import ttrace_command
from ttrace_core.record.launch import free_port

import accelerate  # noqa: F401  (pinned in requirements.txt: CI must never pass this test by skipping it)

SCRIPT = Path(__file__).parent / "accelerate_train.py"


def _record(root: Path, name: str, processes: int, *flags: str) -> None:
    # --multi_gpu is accelerate's multi-process launcher (torchrun); the script's Accelerator(cpu=True) runs it on gloo.
    # (`--cpu --num_processes 2` would start one process: compare's micro-batch-mismatch note, test_evidence.py.)
    launcher = ["accelerate", "launch", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--num_processes", str(processes), "--main_process_port", str(free_port())]
    if processes > 1:
        launcher.append("--multi_gpu")
    done = ttrace_command("record", "--out", name, "--timeout", "240", "--", *launcher, str(SCRIPT), *flags,
                          cwd=root, timeout=300)
    assert done.returncode == 0, f"record {name}: " + done.stdout[-1500:] + done.stderr[-3000:]


def _compare(root: Path, candidate: str) -> tuple[int, str, dict]:
    report = root / f"{candidate}.json"
    done = ttrace_command("compare", "reference", candidate, "--json", str(report), cwd=root, timeout=300)
    return done.returncode, done.stdout, json.loads(report.read_text()) if report.exists() else {}


@pytest.mark.distributed
def test_two_processes_pass_against_one_and_a_block_wrong_on_process_1_fails_there(tmp_path):
    _record(tmp_path, "reference", 1, "--accumulation", "4")
    _record(tmp_path, "ddp2", 2, "--accumulation", "2")
    _record(tmp_path, "ddp2-bug", 2, "--accumulation", "2", "--bug")

    code, out, report = _compare(tmp_path, "ddp2")
    rows = report.get("comparisons", [])
    assert code == 0 and rows and {row["status"] for row in rows} == {"pass"}, out[-3000:]
    keys = [row["key"] for row in rows]
    assert {(key["step"], key["micro_batch"]) for key in keys if key["phase"] == "forward"} == \
        {(step, micro_batch) for step in (0, 1) for micro_batch in range(4)}
    assert {("grad", "grad"), ("param", "value")} <= {(key["phase"], key["slot"]) for key in keys}

    code, out, report = _compare(tmp_path, "ddp2-bug")
    assert code == 1, out[-3000:]
    # the first failing row in execution order; process 1 runs the odd global micro-batches (local k of process r
    # is 2k + r), and micro-batch 0 (process 0's) passes whole
    first = next(row["key"] for row in report["comparisons"] if row["status"] != "pass")
    assert (first["step"], first["micro_batch"], first["phase"], first["fqn"], first["slot"]) == \
        (0, 1, "forward", "blocks.0", "output.0"), first
    assert all(row["status"] == "pass" for row in report["comparisons"] if row["key"]["micro_batch"] == 0
               and row["key"]["step"] == 0 and row["key"]["phase"] == "forward")
