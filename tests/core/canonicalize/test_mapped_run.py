"""A reference of another implementation, mapped into the candidate's names and layouts
(canonicalize/mapped_run.py, workflows/mapped_reference.py), then compared as any reference: hand-written runs
of a "fused QKV" module against separate q/k/v, with tensors either side has no counterpart for."""

from pathlib import Path

import pytest
import torch

from ttrace_core.canonicalize.correspondence import load_map
from ttrace_core.canonicalize.mapped_run import write_mapped_run
from ttrace_core.compare.engine import compare_runs
from ttrace_core.compare.estimate_file import PerturbationEstimate, TensorDeviation, read_estimate, write_estimate
from ttrace_core.errors import MapError
from ttrace_core.format.reader import RunReader, read_manifest
from ttrace_core.format.schema import RunManifest, TensorKey
from ttrace_core.workflows.mapped_reference import mapped_deviation, mapped_estimate, mapped_reference

from tests.support.tiny_map import SIZES, TINY_MAP, write_run

MAP = TINY_MAP
Q, K, V = "q", "k", "v"


def tensors_of_reference() -> dict[TensorKey, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    found = {}
    for name, size in SIZES.items():
        found[TensorKey(step=0, micro_batch=-1, phase="param", fqn=f"l.0.{name}.weight", slot="value.initial")] = \
            torch.randn(size, 5, generator=generator)
        found[TensorKey(step=0, micro_batch=-1, phase="grad", fqn=f"l.0.{name}.weight", slot="grad")] = torch.randn(size, 5, generator=generator)
        found[TensorKey(step=0, micro_batch=0, phase="forward", fqn=f"l.0.{name}", slot="output.0")] = torch.randn(2, 3, size, generator=generator)
        found[TensorKey(step=0, micro_batch=0, phase="backward", fqn=f"l.0.{name}", slot="grad_input.0")] = torch.randn(2, 3, 5, generator=generator)
    found[TensorKey(step=0, micro_batch=0, phase="forward", fqn="l.0.act", slot="output.0")] = torch.randn(2, 3, 4, generator=generator)
    return found


def fused(values: dict[TensorKey, torch.Tensor], phase: str, slot: str, suffix: str = "") -> torch.Tensor:
    pieces = [values[TensorKey(step=0, micro_batch=-1 if phase in ("grad", "param") else 0, phase=phase, fqn=f"l.0.{n}{suffix}",
                               slot=slot)] for n in SIZES]
    if phase in ("grad", "param"):
        return torch.cat([piece.chunk(2)[g] for g in range(2) for piece in pieces])
    pieces = [piece.transpose(0, 1) for piece in pieces]
    if slot.startswith("grad_input"):
        return pieces[0] + pieces[1] + pieces[2]
    return torch.cat([piece.chunk(2, dim=-1)[g] for g in range(2) for piece in pieces], dim=-1)


def candidate_values(reference: dict[TensorKey, torch.Tensor], extra: str | None = None) -> dict[TensorKey, torch.Tensor]:
    found = {
        TensorKey(step=0, micro_batch=-1, phase="param", fqn="layers.0.qkv.weight", slot="value.initial"):
            fused(reference, "param", "value.initial", ".weight"),
        TensorKey(step=0, micro_batch=-1, phase="grad", fqn="layers.0.qkv.weight", slot="grad"): fused(reference, "grad", "grad", ".weight"),
        TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.rotary", slot="output.0"): torch.ones(3, 1, 2),
        TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.qkv", slot="output.0"): fused(reference, "forward", "output.0"),
        TensorKey(step=0, micro_batch=0, phase="backward", fqn="layers.0.qkv", slot="grad_input.0"):
            fused(reference, "backward", "grad_input.0"),
    }
    if extra:
        found[TensorKey(step=0, micro_batch=0, phase="forward", fqn=extra, slot="output.0")] = torch.ones(3)
    return found


@pytest.fixture
def runs(tmp_path):
    values = tensors_of_reference()
    reference = write_run(tmp_path / "ref", values, {"config": {"num_key_value_heads": 2, "num_hidden_layers": 1}})
    map_path = tmp_path / "tiny.toml"
    map_path.write_text(MAP)
    return values, reference, map_path


def compare(mapped: Path, candidate: Path):
    with RunReader(mapped) as reference, RunReader(candidate) as cand:
        return compare_runs(reference, cand)


def test_a_faithful_candidate_passes_and_the_unmapped_are_listed(runs, tmp_path):
    values, reference, map_path = runs
    candidate = write_run(tmp_path / "cand", candidate_values(values), {"num_layers": 1})
    mapped = mapped_reference(reference, map_path)
    assert mapped == reference / ".ttrace" / "mapped" / "tiny"
    correspondence = read_manifest(mapped).correspondence
    assert correspondence["map"] == "tiny" and correspondence["num_unaccounted"] == 0
    assert read_manifest(mapped).model == {"num_layers": 1}
    result = compare(mapped, candidate)
    assert result.verdict == "equivalent", [str(c.key) for c in result.failures]
    assert {c.key.fqn for c in result.comparisons} == {"layers.0.qkv", "layers.0.qkv.weight"}
    assert result.coverage.unmapped == 2 and result.coverage.num_unaccounted == 0
    assert result.coverage.unmapped_reasons == [
        "map tiny: candidate: angles against cosines (1 tensor, e.g. forward/layers.0.rotary/output.0)",
        "map tiny: reference: a module on one side only (1 tensor, e.g. forward/l.0.act/output.0)"]
    assert result.coverage.summary().endswith("; 2 without counterpart through the map")


def test_a_tensor_no_rule_relates_is_listed_not_skipped(runs, tmp_path):
    values, reference, map_path = runs
    candidate = write_run(tmp_path / "cand", candidate_values(values, extra="layers.0.other"), {"num_layers": 1})
    result = compare(mapped_reference(reference, map_path), candidate)
    assert result.verdict == "not equivalent"
    extra = next(c for c in result.comparisons if c.key.fqn == "layers.0.other")
    assert extra.status == "extra" and "map tiny gives it no counterpart" in extra.message
    assert result.coverage.num_unaccounted == 1 and result.coverage.unaccounted == ["candidate: forward/layers.0.other/output.0"]
    assert any(f.startswith("unmapped: 1 tensors have no counterpart through the map") for f in result.findings)


def test_a_reference_tensor_no_rule_uses_is_unaccounted(runs, tmp_path):
    values, reference, map_path = runs
    map_path.write_text(MAP.replace('tensors = ["forward/l.*.act/**"]', 'tensors = ["forward/l.*.nothing/**"]'))
    candidate = write_run(tmp_path / "cand", candidate_values(values), {"num_layers": 1})
    result = compare(mapped_reference(reference, map_path), candidate)
    assert result.verdict == "incomplete"
    assert result.coverage.unaccounted == ["reference: forward/l.0.act/output.0"]


def test_a_wrong_candidate_fails_at_the_fused_tensor(runs, tmp_path):
    values, reference, map_path = runs
    wrong = candidate_values(values)
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.qkv", slot="output.0")
    wrong[key] = wrong[key].flip(-1)  # q, k and v fused in the wrong order
    result = compare(mapped_reference(reference, map_path), write_run(tmp_path / "cand", wrong, {"num_layers": 1}))
    assert result.first_divergence.key == key and result.first_divergence.status == "mismatch"


def test_the_mapped_run_is_reused_until_its_inputs_change(runs):
    _, reference, map_path = runs
    mapped = mapped_reference(reference, map_path)
    stamp = (mapped / "manifest.json").stat().st_mtime_ns
    assert mapped_reference(reference, map_path) == mapped and (mapped / "manifest.json").stat().st_mtime_ns == stamp
    map_path.write_text(MAP.replace('reason = "angles against cosines"', 'reason = "angles, not cosines"'))
    mapped_reference(reference, map_path)
    assert "angles, not cosines" in str(read_manifest(mapped).correspondence["candidate_unmapped"])
    with pytest.raises(MapError, match="already a reference mapped through tiny"):
        mapped_reference(mapped, map_path)


def test_the_estimate_is_translated_through_the_map(runs):
    values, reference, map_path = runs
    deviations = {}
    for index, key in enumerate(k for k in values if k.phase == "forward" and k.fqn != "l.0.act"):
        norm = float(values[key].norm())
        deviations[key] = TensorDeviation(key=key, deviation=(index + 1) * 1e-6, reference_norm=norm, numel=values[key].numel(),
                                          per_sample=[(index + 1) * 1e-6 / norm, 0.5e-6 / norm], structure={"scale": [1e-7, 2e-7]})
    write_estimate(reference, PerturbationEstimate(precision="fp32", num_samples=2, relative=6e-8, tensors=deviations))
    mapped = mapped_reference(reference, map_path)
    estimate = read_estimate(mapped)
    (key,) = estimate.tensors
    translated = estimate.tensors[key]
    assert key.fqn == "layers.0.qkv" and key.slot == "output.0"
    assert translated.deviation == pytest.approx(((1e-6) ** 2 + (2e-6) ** 2 + (3e-6) ** 2) ** 0.5)  # concat: root of the squares
    assert translated.reference_norm == pytest.approx(float(fused(values, "forward", "output.0").norm()), rel=1e-6)
    assert translated.structure == {}  # several pieces: the structure statistics do not carry over


def test_a_sum_adds_the_deviations(runs, tmp_path):
    _, reference, map_path = runs
    loaded = load_map(map_path)
    with RunReader(reference) as reader:
        mapped = write_mapped_run(loaded, reader, tmp_path / "out", {})
    by_slot = {t.key.slot: t for t in mapped.tensors if t.key.phase in ("forward", "backward")}
    sources = [TensorDeviation(key=k, deviation=1.0, reference_norm=10.0, numel=6, per_sample=[0.1, 0.05]) for k in
               by_slot["grad_input.0"].sources]
    summed = mapped_deviation(by_slot["grad_input.0"], sources, norm=20.0)
    assert summed.deviation == pytest.approx(3.0) and summed.per_sample == pytest.approx([3.0 / 20, 1.5 / 20])
    assert mapped_estimate(PerturbationEstimate(precision="fp32", num_samples=2, relative=6e-8), mapped).tensors == {}


def test_a_mapped_run_is_not_estimated_itself(runs):
    from ttrace_core.errors import TtraceError
    from ttrace_core.workflows.estimate import estimate_reference

    _, reference, map_path = runs
    with pytest.raises(TtraceError, match="a reference mapped through tiny from .*; estimate that run"):
        estimate_reference(mapped_reference(reference, map_path))


def test_precision_choices_are_named_in_low_precision_only():
    from ttrace_core.compare.plan import precision_choices

    choice = {"candidate": "decoder.*layernorm", "reference": "model.*norm", "candidate_computes": "the input dtype",
              "reference_computes": "float32"}
    mapped = RunManifest(role="reference", world_size=1, precision="bf16", correspondence={"map": "m", "precision": [choice]})
    candidate = RunManifest(role="candidate", world_size=1, precision="bf16")
    (line,) = precision_choices(mapped, candidate)
    assert line.startswith("precision-choice: decoder.*layernorm computes in the input dtype in the candidate, model.*norm "
                           "in float32 in the reference (map m)")
    mapped.precision = candidate.precision = "fp32"
    assert precision_choices(mapped, candidate) == []
    assert precision_choices(RunManifest(role="reference", world_size=1, precision="bf16"), candidate) == []


def test_the_dashboard_finds_a_mapped_reference_beside_its_source(runs):
    from ttrace_core.service.runs import MAPPED_RUNS, find_runs
    from ttrace_core.workflows.mapped_reference import MAPPED_DIR

    _, reference, map_path = runs
    mapped_reference(reference, map_path)
    assert Path(*MAPPED_RUNS) == MAPPED_DIR
    assert [run.path for run in find_runs(reference.parent)] == ["ref", "ref/.ttrace/mapped/tiny"]
