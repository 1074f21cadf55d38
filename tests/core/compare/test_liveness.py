"""The negative control (ttrace_core/compare/liveness.py): a reference that did not train refuses a pass.

Each run is a tiny MLP recorded in this process by the Tracer for one step. A dead reference is
compared with a candidate that died the same way, so every tensor agrees and only the control stands
between the comparison and a meaningless "equivalent".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.cli_support import run_main
from ttrace_core.compare.engine import compare_runs
from ttrace_core.compare.liveness import reference_liveness
from ttrace_core.compare.tolerances import DtypeTolerances
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import Layout, NO_MICRO_BATCH, PRE_STEP_SLOT, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, write_manifest
from ttrace_core.record.tracer import Tracer, TracerConfig

from tests.support.tiny_mlp import recorded_pair as _pair

HINT = "check that the reference's loss reaches backward (a detached loss or lr 0 makes a pass meaningless)"


def _compare(reference: Path, candidate: Path):
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        return compare_runs(ref, cand, DtypeTolerances())


DEAD = [
    ("zero-gradients", {"loss_factor": 0.0},
     f"refused: the reference did not train: every one of its 4 parameter gradients is zero at step 0; {HINT}"),
    ("learning-rate-0", {"lr": 0.0},
     "refused: the reference did not train: every one of its 4 parameters kept its value through the optimizer "
     f"step at step 0; {HINT}"),
]


@pytest.mark.parametrize(("how", "finding"), [case[1:] for case in DEAD], ids=[case[0] for case in DEAD])
def test_a_reference_that_did_not_train_refuses_the_pass(tmp_path, how, finding):
    result = _compare(*_pair(tmp_path, **how))
    assert all(result.comparisons), "the two dead runs agree on every tensor: only the control refuses them"
    assert result.verdict == "refused" and not result.passed and not result
    assert result.coverage.reference_trained is False
    assert result.findings[0] == finding
    level, text = result.summary().banner()
    assert level == "error" and text.startswith(f"FAILED (refused): {finding.removeprefix('refused: ')}.")


@pytest.mark.parametrize(("how", "finding"), [case[1:] for case in DEAD], ids=[case[0] for case in DEAD])
def test_ttrace_compare_exits_1_naming_the_dead_reference(tmp_path, capsys, how, finding):
    reference, candidate = _pair(tmp_path, **how)
    code, out, _ = run_main(["compare", str(reference), str(candidate)], capsys)
    assert code == 1
    assert f"finding: {finding}" in out.splitlines()
    assert out.splitlines()[-1].startswith("FAILED (refused) | ")


def test_localize_against_a_dead_reference_names_it_instead_of_replaying(tmp_path):
    from ttrace_core.workflows.localize import localize

    how, finding = DEAD[0][1:]
    result = localize(*_pair(tmp_path, **how))
    assert not result.diverged and result.replay is None
    assert result.notes == ["no compared tensor diverged: nothing to localize; but the reference did not train", finding]
    assert result.exit_code == 1  # as `ttrace compare` exits on a refused reference


def test_a_reference_that_trained_is_not_refused(tmp_path):
    result = _compare(*_pair(tmp_path))
    assert result.coverage.reference_trained is True and result.coverage.dead_reference == ""
    assert result.verdict == "equivalent" and result.findings == []


def test_a_trace_without_gradients_or_parameters_cannot_tell_and_is_not_refused(tmp_path):
    result = _compare(*_pair(tmp_path, config=TracerConfig(slots=("input", "output"))))
    assert result.coverage.reference_trained is None
    assert result.verdict == "equivalent"


def test_a_reference_where_only_the_last_layer_trains_is_not_refused(tmp_path):
    """The first layer's output is detached, so it neither gets a gradient nor moves: one layer that
    trains is enough (a frozen embedding is no dead run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(tmp_path, model, role="reference", optimizer=optimizer)
    with tracer.step(0):
        optimizer.zero_grad()
        model[1](model[0](torch.randn(3, 4)).detach()).square().mean().backward()
        optimizer.step()
    tracer.close()
    with RunReader(tmp_path) as reader:
        assert {key.fqn for key in reader.index if key.phase == "grad"} == {"1.weight", "1.bias"}
        assert reference_liveness(reader, [0]).trained is True


def _write_unsummarized(run_dir: Path, tensors: dict[tuple[str, str], torch.Tensor]) -> Path:
    """A reference of one step holding {(phase, slot): values} of parameter "lin.weight", written without
    statistics (as older traces are): their values decide."""
    write_manifest(run_dir, RunManifest(role="reference", world_size=1, model={}))
    writer = RunWriter(run_dir, 0)
    writer.begin_step(0)
    for seq, ((phase, slot), values) in enumerate(tensors.items()):
        key = TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase=phase, fqn="lin.weight", slot=slot)
        writer.write(TensorMeta(key=key, rank=0, dtype="float32", local_shape=tuple(values.shape),
                                layout=Layout.replicated(tuple(values.shape)), seq=seq), values)
    writer.end_step()
    return run_dir


WEIGHT = torch.arange(6.0).reshape(3, 2)
UNSUMMARIZED = [
    ("zero-gradient", {("grad", "grad"): torch.zeros(3, 2)}, False),
    ("nonzero-gradient", {("grad", "grad"): torch.eye(3, 2)}, True),
    ("weight-kept", {("param", PRE_STEP_SLOT): WEIGHT, ("param", "value"): WEIGHT.clone()}, False),
    ("weight-moved", {("param", PRE_STEP_SLOT): WEIGHT, ("param", "value"): WEIGHT + 1e-7 * torch.eye(3, 2)}, True),
]


@pytest.mark.parametrize(("tensors", "trained"), [case[1:] for case in UNSUMMARIZED], ids=[case[0] for case in UNSUMMARIZED])
def test_tensors_without_statistics_are_judged_by_their_values(tmp_path, tensors, trained):
    with RunReader(_write_unsummarized(tmp_path, tensors)) as reader:
        assert all(meta.stats is None for metas in reader.index.values() for meta in metas)
        assert reference_liveness(reader, [0]).trained is trained
