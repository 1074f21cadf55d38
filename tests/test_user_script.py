"""Bring your own script: tests/user_script/train_traced.py is a user's DTensor script (2-D mesh, FSDP2 x TP,
activation checkpointing, a head called twice per micro-batch) with ttrace attached. It imports
nothing from ttrace's examples; `ttrace record` runs it under torchrun, and `ttrace estimate` /
`ttrace localize` relaunch its recorded command."""

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import record_script, ttrace_command

from ttrace_core.format.naming import LOSS_FUNCTION
from ttrace_core.record.session import SESSION_ENV, SessionSpec

SCRIPTS = Path(__file__).parent / "user_script"
PLAIN, TRACED = SCRIPTS / "train.py", SCRIPTS / "train_traced.py"
pytestmark = pytest.mark.distributed


def _ttrace(*args: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    return ttrace_command(*args, cwd=cwd, timeout=timeout)


def _record(out: Path, nproc: int, *flags: str) -> None:
    record_script(TRACED, out, nproc, *flags)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("byos")
    _record(root / "ref", 1)
    _record(root / "tp2", 2, "--tp", "2", "--checkpoint")
    _record(root / "bug", 2, "--tp", "2", "--checkpoint", "--bug")
    # AdamW turns round-off in gradients that are zero in exact arithmetic (an attention key bias)
    # into a full step: the perturbation estimate measures that, a fixed dtype tolerance cannot.
    done = _ttrace("estimate", "ref", "--samples", "2", cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_the_integration_is_at_most_10_lines():
    plain, traced = PLAIN.read_text().splitlines(), TRACED.read_text().splitlines()
    opcodes = difflib.SequenceMatcher(a=plain, b=traced, autojunk=False).get_opcodes()
    added_or_changed = sum(j2 - j1 for tag, _, _, j1, j2 in opcodes if tag in ("insert", "replace"))
    assert 0 < added_or_changed <= 10
    assert "ttrace_core" not in PLAIN.read_text() and "examples" not in TRACED.read_text()


def _plain_run(script: Path, cwd: Path, env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if line.startswith("step ")]


def test_a_plain_run_behaves_as_without_ttrace_even_with_stray_variables(tmp_path):
    stale = tmp_path / "stale.json"  # a spec whose launcher has ended
    SessionSpec(out=str(tmp_path / "never"), launcher_pid=2**22 + 12345, command=["x"]).write(stale)
    work = tmp_path / "work"
    work.mkdir()
    expected = _plain_run(PLAIN, work, {})
    for stray in ({SESSION_ENV: str(tmp_path / "missing.json")}, {SESSION_ENV: str(stale)},
                  {"TTRACE_REWRITE_FROM": str(tmp_path), "TTRACE_REWRITE_MODULE": "blocks.0"}):
        assert _plain_run(TRACED, work, stray) == expected, stray
    assert len(expected) == 2 and list(work.iterdir()) == [] and not (tmp_path / "never").exists()


def test_the_manifest_records_the_command_and_its_environment(runs):
    manifest = json.loads((runs / "tp2" / "manifest.json").read_text())
    command = manifest["entrypoint"]["command"]
    assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"] and command[-1] == "--checkpoint"
    assert manifest["entrypoint"]["cwd"] == str(runs) and manifest["world_size"] == 2
    assert manifest["environment"]["command"] == command and manifest["environment"]["packages"]["torch"]
    assert manifest["role"] == "candidate" and manifest["degrees"] == {"tp": 2}
    assert json.loads((runs / "ref" / "manifest.json").read_text())["role"] == "reference"


def test_clean_tp2_with_checkpointing_and_a_chunked_head_passes(runs):
    done = _ttrace("compare", "ref", "tp2", "--json", "tp2.json", cwd=runs)
    assert done.returncode == 0, done.stdout[-3000:]
    keys = [c["key"] for c in json.loads((runs / "tp2.json").read_text())["comparisons"]]
    assert {k["call"] for k in keys if k["fqn"] == "head"} == {0, 1}  # the head is compared call by call
    assert not any("_checkpoint_wrapped_module" in k["fqn"] for k in keys)
    assert sum(k["fqn"] == "blocks.0.attn.wq" and k["slot"] == "output.0" for k in keys) == 4  # 2 steps x 2 mbs
    # and without the estimate: the fixed fp32 row, AdamW's steps on the key biases' round-off judged as such
    done = _ttrace("compare", "ref", "tp2", "--tolerance", "dtype", "--json", "tp2-dtype.json", cwd=runs)
    assert done.returncode == 0, done.stdout[-3000:]


def test_the_bug_flag_fails_and_localize_names_its_module(runs):
    compared = _ttrace("compare", "ref", "bug", cwd=runs)
    assert compared.returncode == 1 and "blocks.0.attn" in compared.stdout.split("first divergence", 1)[1][:600]
    localized = _ttrace("localize", "ref", "bug", "--json", "loc.json", cwd=runs)
    assert localized.returncode == 1, localized.stdout[-2000:] + localized.stderr[-2000:]
    result = json.loads((runs / "loc.json").read_text())
    # only the bug: the key biases' gradients are round-off, never held to the exact-inputs bound in the replay
    assert result["culprits"] == ["blocks.0.attn"] and result["replay_scope"] == "whole model"


def test_estimate_relaunched_the_recorded_command(runs):
    estimate = json.loads((runs / "ref" / "tolerance_estimate.json").read_text())
    assert estimate["num_samples"] == 2 and len(estimate["tensors"]) > 100
    assert not (runs / "ref" / ".estimate").exists()


def test_fsdp2_over_tensor_parallel_on_a_2d_mesh_passes(runs, tmp_path):
    """4 ranks: TP2 inside, FSDP2 across (parameters are _StridedShard DTensors), with checkpointing. The
    recording prints no FSDP2 warning about views (the tracer's hooks made the model's output one: issue 41)."""
    out = runs / "fsdp2xtp2"
    command = ["torchrun", "--standalone", "--nproc-per-node", "4", str(TRACED), "--tp", "2", "--dp", "2", "--checkpoint"]
    recorded = ttrace_command("record", "--out", str(out), "--timeout", "240", "--", *command, cwd=runs)
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    assert "returned a view tensor" not in recorded.stdout + recorded.stderr, recorded.stderr[-3000:]
    done = _ttrace("compare", "ref", out.name, cwd=runs)
    assert done.returncode == 0, done.stdout[-3000:]
    assert json.loads((out / "manifest.json").read_text())["degrees"] == {"dp": 2, "tp": 2}


COMPILED_SCRIPT = '''
import torch, ttrace_core as ttrace
from torch import nn
model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
session = ttrace.attach(model, optimizer)
with session.step(0):
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).square().mean().backward()
    optimizer.step()
'''


def test_a_compiled_model_records_parameters_gradients_and_outputs_and_names_its_blind_spots(tmp_path):
    (tmp_path / "train.py").write_text(COMPILED_SCRIPT)
    done = _ttrace("record", "--out", "run", "--", sys.executable, "train.py", cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    from ttrace_core.format.reader import RunReader

    with RunReader(tmp_path / "run") as reader:
        keys = {(k.phase, k.fqn, k.slot) for k in reader.index}
        blind = reader.manifest.blind_spots
    assert {("grad", "0.weight", "grad"), ("param", "2.bias", "value"), ("forward", "", "output.0"),
            ("backward", "", "grad_output.0")} <= keys  # (a compiled root runs no full backward hook: tensor hooks)
    # no hook inside the graph (the loss is recorded where backward starts, outside it)
    assert not any(phase in ("forward", "backward") and fqn and fqn != LOSS_FUNCTION for phase, fqn, _ in keys)
    assert sorted(blind) == ["0", "1", "2"] and "torch.compile" in blind["0"]
    inspected = _ttrace("inspect", "run", cwd=tmp_path)
    assert "blind spot: 1: inside torch.compile" in inspected.stdout


COMPILED_DDP_SCRIPT = '''
import sys, torch, torch.distributed as dist, ttrace_core as ttrace
from torch import nn
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
if "--compile" in sys.argv:  # as DDP's docs advise: compile the DDP-wrapped model
    model = torch.compile(nn.parallel.DistributedDataParallel(model), backend="eager")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
session = ttrace.attach(model, optimizer, loss_scale=world / 4)
for step in range(2):
    with session.step(step):
        optimizer.zero_grad()
        for local in range(4 // world):
            micro_batch = local * world + rank
            inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro_batch))
            (model(inputs).square().mean() * world / 4).backward()
        optimizer.step()
dist.destroy_process_group()
'''


def _passing_pair(tmp_path: Path, script_text: str, nproc: int) -> dict:
    """A 1-rank reference of `script_text` and its `--compile` run on `nproc` ranks, compared: the comparison's JSON,
    which must pass."""
    script = tmp_path / "train.py"
    script.write_text(script_text)
    record_script(script, tmp_path / "ref", 1)
    record_script(script, tmp_path / "cand", nproc, "--compile")
    report = tmp_path / "compare.json"
    done = _ttrace("compare", "ref", "cand", "--json", str(report), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads(report.read_text())


def test_torch_compile_of_a_ddp_model_passes_against_an_uncompiled_reference(tmp_path):
    """`torch.compile(DDP(model))`: its local names hold DDP's `module.` below the compiled root and its data
    parallelism is the DDP's inside; both used to be missed (compare refused the pair: every parameter name
    differed). The compiled root's output gradients come from tensor hooks: it runs no full backward hook."""
    rows = _passing_pair(tmp_path, COMPILED_DDP_SCRIPT, 2)["comparisons"]
    assert rows and all(row["status"] == "pass" for row in rows)
    compared = {(r["key"]["phase"], r["key"]["fqn"], r["key"]["slot"]) for r in rows}
    assert {("grad", "0.weight", "grad"), ("param", "2.bias", "value"), ("backward", "", "grad_output.0")} <= compared
    assert {r["key"]["micro_batch"] for r in rows if r["key"]["phase"] == "forward"} == {0, 1, 2, 3}


COMPILED_LOSS_SCRIPT = '''
import sys, torch, ttrace_core as ttrace
from torch import nn
import torch.nn.functional as F
class WithLoss(nn.Module):  # (loss, logits), the loss computed inside, as a Hugging Face model given labels
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Linear(16, 5)

    def forward(self, x, labels):
        logits = self.head(self.body(x))
        return F.cross_entropy(logits, labels), logits

torch.manual_seed(0)
model = WithLoss()
if "--compile" in sys.argv:
    model = torch.compile(model, backend="eager")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
session = ttrace.attach(model, optimizer)
with session.step(0):
    generator = torch.Generator().manual_seed(0)
    loss, _ = model(torch.randn(4, 8, generator=generator), torch.randint(0, 5, (4,), generator=generator))
    loss.backward()
    optimizer.step()
'''


def test_a_compiled_root_computing_its_loss_inside_passes_without_its_logits_gradient(tmp_path):
    """A compiled root that returns (loss, logits) with the loss computed inside the compiled code: eager's backward
    hook says None for the unused logits and the compiled root's tensor hook gets zeros. The one-sided logits
    gradient is not counted (compiled_boundaries), and the loss's own gradient is compared. Before, a correct run
    failed with it extra to the candidate (the other way round, missing in the candidate, is the Hugging Face
    Trainer's torch_compile: tests/thirdparty/test_hf_trainer.py)."""
    result = _passing_pair(tmp_path, COMPILED_LOSS_SCRIPT, 1)
    compared = {(r["key"]["phase"], r["key"]["fqn"], r["key"]["slot"]) for r in result["comparisons"]}
    assert {("backward", "", "grad_output.0"), ("forward", "", "output.1"), ("grad", "head.weight", "grad")} <= compared
    assert ("backward", "", "grad_output.1") not in compared
    assert any("compiled_boundaries; e.g. step 0 / mb 0 / backward / <root> / grad_output.1" in note
               for note in result["notes"])


COMPILED_PARTS_SCRIPT = '''
import sys, torch, ttrace_core as ttrace
from torch import nn
class Block(nn.Module):  # (a model's own class: dynamo skips the frames of torch's containers)
    def __init__(self):
        super().__init__()
        self.linear, self.act = nn.Linear(16, 16), nn.GELU()

    def forward(self, x):
        return x + self.act(self.linear(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))

torch.manual_seed(0)
model = Model()
if sys.argv[1] == "blocks":  # as torchtitan compiles its blocks: in place, one graph each
    model.block.compile(backend="eager", fullgraph=True)
elif sys.argv[1] == "root":
    model.compile(backend="eager", fullgraph=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
session = ttrace.attach(model, optimizer)
for step in range(2):
    with session.step(step):
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
'''


def test_modules_compiled_in_place_with_fullgraph_train_under_ttrace_and_pass(tmp_path):
    """A hook inside code compiled with fullgraph=True is an error that stops the training (it used to, for a block
    or a root compiled in place): the compiled modules are left to the compiler, the rest is traced, and the run
    passes against an uncompiled reference."""
    (tmp_path / "train.py").write_text(COMPILED_PARTS_SCRIPT)
    for name in ("none", "blocks", "root"):
        done = _ttrace("record", "--out", name, "--", sys.executable, "train.py", name, cwd=tmp_path, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    for name, hidden in (("blocks", {"block", "block.linear", "block.act"}),
                         ("root", {"", "inp", "block", "block.linear", "block.act", "out"})):
        report = tmp_path / f"{name}.json"
        done = _ttrace("compare", "none", name, "--json", str(report), cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:]
        rows = json.loads(report.read_text())["comparisons"]
        assert {("grad", "block.linear.weight"), ("param", "out.bias")} <= {(r["key"]["phase"], r["key"]["fqn"]) for r in rows}
        traced = {r["key"]["fqn"] for r in rows if r["key"]["phase"] in ("forward", "backward")}
        assert not traced & hidden and (name == "root" or {"inp", "out"} <= traced)


def test_clipping_on_every_step_passes_with_and_without_the_estimate(runs):
    """clip_grad_norm_ scales every gradient by a coefficient whose round-off grows with the reduction's
    length: the gradients are recorded before it, the norm and coefficient judged on their own.

    Without the estimate the fixed dtype tolerance judges everything, including the attention key bias, whose
    gradient is zero in exact arithmetic: where a CPU's kernels round it apart in the two runs (on one machine of
    this kind they did at step 1, on another not), AdamW steps it by about lr in directions of their own, and
    the row passes only by saying so (compare/roundoff_steps.py)."""
    _record(runs / "clip-ref", 1, "--clip", "0.05")
    _record(runs / "clip-dp2", 2, "--dp", "2", "--clip", "0.05")
    for estimated in (False, True):
        if estimated:
            done = _ttrace("estimate", "clip-ref", "--samples", "2", cwd=runs)
            assert done.returncode == 0, done.stderr[-3000:]
        report = runs / f"clip-{estimated}.json"
        done = _ttrace("compare", "clip-ref", "clip-dp2", "--json", str(report), cwd=runs)
        assert done.returncode == 0, done.stdout[-3000:]
        data = json.loads(report.read_text())
        rows = data["comparisons"]
        assert {"scalar.grad_norm", "scalar.clip_coef", "scalar.loss"} <= {r["key"]["slot"] for r in rows}
        relaxed = [r["key"]["fqn"] for r in rows if r["key"]["phase"] == "param" and "round-off" in r["message"]]
        assert all(fqn.endswith("attn.wk.bias") for fqn in relaxed), relaxed
        assert bool(relaxed) == any("round-off" in note for note in data["notes"])
