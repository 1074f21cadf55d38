"""A pass must rest on complete, consistent evidence (ttrace_core/compare/evidence.py, records.py).

Each test damages a copy of a recorded sample trace (fp32, megatron-core TP2 + SP, clean) the way a
trace gets damaged in ordinary use, and checks the exact finding or exit code; the undamaged copy
passes with full coverage.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import h5py
import pytest

from tests.cli_support import run_main
from tests.faults.meta_rows import drop_tensor, read_meta, write_meta
from ttrace_core.compare.engine import compare_runs
from ttrace_core.format.reader import INVENTORY_ATTR, RunReader, step_file_name
from ttrace_core.compare.tolerances import DtypeTolerances
from tests.support.paths import SAMPLES_DIR

SAMPLES = SAMPLES_DIR / "fp32"
# A module output that both TP ranks hold whole (placement R on the tp axis) and one that each holds a shard of.
REPLICATED = "forward/mb_0000/decoder.layers.0.mlp#output.1"
SHARDED = "forward/mb_0000/decoder.layers.0.self_attention.linear_qkv#output.0"


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    reference, candidate = tmp_path / "reference", tmp_path / "candidate"
    shutil.copytree(SAMPLES / "reference", reference)
    shutil.copytree(SAMPLES / "tp2_sp_clean", candidate)
    return reference, candidate


def _compare(reference: Path, candidate: Path, **kwargs):
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        return compare_runs(ref, cand, DtypeTolerances(), **kwargs)


def _edit_meta(run: Path, rank: int, dataset: str, **changes) -> None:
    with h5py.File(run / step_file_name(rank, 0), "r+") as handle:
        meta = read_meta(handle, dataset)
        for name, value in changes.items():
            target = next(part for part in (meta["key"], meta["layout"], meta) if name in part)
            target[name] = value
        write_meta(handle, dataset, meta)


def _drop_dataset(run: Path, rank: int, dataset: str, *, keep_inventory: bool) -> None:
    with h5py.File(run / step_file_name(rank, 0), "r+") as handle:
        drop_tensor(handle, dataset, keep_row=keep_inventory)
        if not keep_inventory:  # the writer itself never recorded it: its index and inventory agree with the file
            handle.attrs[INVENTORY_ATTR] = handle.attrs[INVENTORY_ATTR] - 1


def test_a_clean_trace_passes_with_full_coverage(runs):
    result = _compare(*runs)
    coverage = result.coverage
    assert result.verdict == "equivalent" and result.passed and result.findings == []
    assert coverage.full and coverage.tensors_expected == coverage.compared_elementwise == len(result.comparisons) == 787
    assert coverage.copies_present == coverage.copies_expected == 2361  # 787 on the reference, 1574 on 2 TP ranks
    assert (coverage.ranks_present, coverage.ranks_expected, coverage.steps_compared) == (3, 3, [0])


def test_a_shard_whose_metadata_disagrees_with_its_sibling_is_a_named_finding(runs):
    reference, candidate = runs
    _edit_meta(candidate, 1, SHARDED, scale=0.5)  # rank 0 keeps 1.0: one of them was recorded under another loss scale
    result = _compare(reference, candidate)
    (row,) = [c for c in result.comparisons if c.status == "inconsistent"]
    assert "linear_qkv" in str(row.key) and "rank 0 recorded scale 1.0, rank 1 recorded scale 0.5" in row.message
    assert not result and result.first_divergence is row and row.value_ratio is None
    assert "incomplete: 1 tensors could not be compared by value" in result.findings[0]


def test_a_coordinate_that_contradicts_the_manifest_is_a_named_finding(runs):
    reference, candidate = runs
    _edit_meta(candidate, 1, REPLICATED, coordinate=[0])  # rank 1 claims rank 0's place on the tp axis
    (row,) = [c for c in _compare(reference, candidate).comparisons if c.status == "inconsistent"]
    assert "rank 1 recorded coordinate 0 on mesh axis 'tp', the manifest places rank 1 at 1" in row.message


def test_metadata_naming_another_tensor_than_its_place_is_a_named_finding(runs):
    reference, candidate = runs
    _edit_meta(candidate, 1, SHARDED, micro_batch=1)  # stored under mb 0, says mb 1
    (row,) = [c for c in _compare(reference, candidate).comparisons if c.status == "inconsistent"]
    assert "mb 0" in str(row.key) and "says it is step 0 / mb 1" in row.message and "rank 1's file" in row.message


@pytest.mark.parametrize("keep_inventory, findings", [
    (True, [f"incomplete: rank_00001.step_000000.h5: its tensor index lists {REPLICATED}, whose pack the file does "
            "not hold",
            "missing-replica: 1 of"]),
    (False, ["missing-replica: 1 of 2361 expected copies were not recorded, e.g. step 0 / mb 0 / forward / "
             "decoder.layers.0.mlp / output.1: 1 of 2 copies in candidate (ranks [0])"]),
], ids=["file-damaged", "never-recorded"])
def test_a_replica_recorded_on_one_rank_only_fails_as_incomplete(runs, capsys, keep_inventory, findings):
    reference, candidate = runs
    _drop_dataset(candidate, 1, REPLICATED, keep_inventory=keep_inventory)
    result = _compare(reference, candidate)
    assert all(result.comparisons) and not result.coverage.full and result.verdict == "incomplete" and not result
    assert len(result.findings) == len(findings)
    assert all(found.startswith(expected) for found, expected in zip(result.findings, findings)), result.findings
    code, out, _ = run_main(["compare", str(reference), str(candidate)], capsys)
    assert code == 1 and "FAILED (incomplete)" in out and "finding: missing-replica" in out
    code, out, _ = run_main(["compare", str(reference), str(candidate), "--partial"], capsys)
    assert code == 0 and "PASSED (partial: 787/787 tensors compared element-wise; 2360/2361 copies" in out


def test_a_partial_step_fails_as_incomplete_unless_a_partial_verdict_is_asked_for(runs):
    reference, candidate = runs
    shutil.copy(candidate / step_file_name(0, 0), candidate / (step_file_name(0, 1) + ".partial"))
    result = _compare(reference, candidate)
    assert result.verdict == "incomplete" and "incomplete: steps [1] were not compared" in result.findings[0]
    assert _compare(reference, candidate, partial=True).verdict == "partial"


def test_statistics_only_tensors_in_a_full_run_are_a_finding_and_a_stats_only_run_passes_by_statistics(runs):
    reference, candidate = runs
    _edit_meta(candidate, 0, SHARDED, stats_only=True)
    _edit_meta(candidate, 1, SHARDED, stats_only=True)
    result = _compare(reference, candidate)
    assert all(result.comparisons) and result.coverage.compared_by_stats == 1 and result.verdict == "incomplete"
    assert "incomplete: 1 tensors hold statistics only, in runs recorded in full" in result.findings
    manifest = json.loads((candidate / "manifest.json").read_text())
    manifest["tracer"]["stats_only"] = True  # the user's choice: the verdict says by statistics, and how many
    (candidate / "manifest.json").write_text(json.dumps(manifest))
    result = _compare(reference, candidate)
    assert result.verdict == "equivalent by statistics" and result.coverage.full and result.findings == []


@pytest.mark.parametrize("field, value, message", [
    ("world_size", 0, "field $.world_size: Expected `int` >= 1"),
    ("world_size", -1, "field $.world_size: Expected `int` >= 1"),
    ("world_size", True, "field $.world_size: Expected `int`, got `bool`"),
    ("world_size", 3, "mesh_shape [1, 1, 1, 2] holds 2 ranks, world_size is 3"),
    ("degrees", {"pp": 1, "dp": 1, "cp": 1, "tp": 4}, "degrees['tp'] is 4 but mesh axis 'tp' has size 2"),
    ("degrees", {}, "mesh axis 'pp' (size 1) has no entry in degrees {}"),
    ("rank_coordinates", [[0, 0, 0, 0], [0, 0, 0, 2]],
     "rank_coordinates[1] [0, 0, 0, 2] lies outside mesh_shape [1, 1, 1, 2]"),
    ("rank_coordinates", [], "mesh_shape [1, 1, 1, 2] is given but rank_coordinates is empty"),
    ("role", "judge", "field $.role: Invalid enum value 'judge'"),
], ids=["world-size-0", "world-size-negative", "world-size-bool", "mesh-not-world", "degree-not-mesh", "degrees-empty",
        "coordinate-outside", "no-coordinates", "unknown-role"])
def test_an_impossible_manifest_is_bad_input_naming_the_field(runs, capsys, field, value, message):
    reference, candidate = runs
    manifest = json.loads((candidate / "manifest.json").read_text())
    manifest[field] = value
    (candidate / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_main(["compare", str(reference), str(candidate)], capsys)
    (line,) = err.strip().splitlines()
    assert code == 2 and f"{candidate}/manifest.json: not a valid manifest ({message}" in line, line


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["tensors"][0].update(deviation=math.inf), "field $.tensors[0].deviation: Expected `float` <= "),
    (lambda d: d["tensors"][0].update(deviation=math.nan), "field $.tensors[0].deviation: Expected `float` >= 0.0"),
    (lambda d: d["tensors"][0].update(reference_norm=-1.0), "field $.tensors[0].reference_norm: Expected `float` >= 0.0"),
    (lambda d: d.update(relative="4e-3"), "field $.relative: Expected `float`, got `str`"),
    (lambda d: d.update(num_samples=0), "field $.num_samples: Expected `int` >= 1"),
], ids=["infinite", "nan", "negative", "wrong-type", "no-samples"])
def test_a_tolerance_estimate_with_impossible_numbers_is_refused_naming_the_field(tmp_path, capsys, edit, message):
    reference = tmp_path / "reference"
    shutil.copytree(SAMPLES.parent / "bf16" / "reference", reference)
    path = reference / "tolerance_estimate.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    code, _, err = run_main(["compare", str(reference), str(SAMPLES.parent / "bf16" / "tp2_sp_clean")], capsys)
    (line,) = err.strip().splitlines()
    assert code == 2 and f"{path}: not a valid tolerance estimate ({message}" in line, line


@pytest.mark.parametrize("changes, message", [
    ({"global_shape": [-16, 2, 16]}, "field $.meta.layout.global_shape[0]: Expected `int` >= 0"),
    ({"global_shape": [2**40, 2**20, 16]}, "holds more than 2**48 elements"),
    ({"phase": "sideways"}, "field $.meta.key.phase: Invalid enum value 'sideways'"),
    ({"dtype": "float128"}, "field $.meta.dtype: Invalid enum value 'float128'"),
    ({"scale": 0.0}, "field $.meta.scale: Expected `float` > 0.0"),
], ids=["negative-size", "absurd-size", "unknown-phase", "unknown-dtype", "zero-scale"])
def test_metadata_that_cannot_be_right_is_bad_input(runs, capsys, changes, message):
    reference, candidate = runs
    _edit_meta(candidate, 1, SHARDED, **changes)
    code, _, err = run_main(["compare", str(reference), str(candidate)], capsys)
    (line,) = err.strip().splitlines()
    assert code == 2 and str(candidate / step_file_name(1, 0)) in line and message in line, line


def test_localize_on_incomplete_evidence_names_what_is_missing_instead_of_replaying(runs):
    from ttrace_core.workflows.localize import localize

    reference, candidate = runs
    _drop_dataset(candidate, 1, REPLICATED, keep_inventory=False)
    result = localize(reference, candidate)
    assert not result.diverged and result.replay is None
    assert result.notes[0] == "no compared tensor diverged: nothing to localize; but the evidence is incomplete"
    assert result.notes[1].startswith("missing-replica: 1 of 2361 expected copies")
    # compare fails on incomplete evidence (exit 1), and so does localize: the two never disagree
    assert result.exit_code == 1


@pytest.mark.parametrize("reference_shape, candidate_shape, dim", [
    ((2, 32, 64), (2, 32, 32), 2),
    ((8, 4), (4, 4), 0),
    ((8, 4), (3, 4), None),          # not an even fraction
    ((8, 4), (4, 2), None),          # two dims differ
    ((8, 4), (16, 4), None),         # larger, not a shard
    ((8,), (8, 1), None),            # another rank
], ids=["colwise output", "rows", "uneven", "two dims", "larger", "ndim"])
def test_a_local_shard_recorded_as_whole_is_told_from_another_shape(reference_shape, candidate_shape, dim):
    from ttrace_core.compare.evidence import local_shard_dim, shape_mismatch_message
    from ttrace_core.format.schema import Layout, TensorKey

    assert local_shard_dim(reference_shape, candidate_shape) == dim
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn="model.layers.0.self_attn.q_proj", slot="output.0")
    message = shape_mismatch_message(key, Layout(global_shape=reference_shape), Layout(global_shape=candidate_shape))
    assert message.startswith(f"global shape {candidate_shape} in the candidate, {reference_shape} in the reference")
    assert ("recorded without its layout" in message) == (dim is not None)
    if dim is not None:
        assert f"session.declare('model.layers.0.self_attn.q_proj', 'output.0', [Shard({dim})], mesh)" in message


def test_a_layout_never_learned_fails_on_shape_and_localize_says_so_without_blaming_carried_state(tmp_path):
    """A candidate whose ranks hold half of every activation as if whole: compare names the missing layout,
    and localize reports the structural failure (exit 4) instead of replaying and blaming state."""
    import torch
    from torch import nn

    from ttrace_core.record.tracer import Tracer
    from ttrace_core.workflows.localize import localize

    for name, width in (("ref", 8), ("cand", 4)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, width), nn.Tanh())
        tracer = Tracer(tmp_path / name, model, role="reference" if name == "ref" else "candidate")
        with tracer.step(0):
            model(torch.randn(3, 4)).sum().backward()
        tracer.close()
    with RunReader(tmp_path / "ref") as reference, RunReader(tmp_path / "cand") as candidate:
        result = compare_runs(reference, candidate)
    first = result.first_divergence
    assert first.status == "shape" and "a local shard (1/2 of dim" in first.message
    localization = localize(tmp_path / "ref", tmp_path / "cand")
    assert localization.exit_code == 4 and localization.replay is None and not localization.culprits
    assert localization.notes[0].startswith(f"the first divergence, {first.key}, is structural (shape")
    assert not any("carried" in note for note in localization.notes)


def test_activations_the_candidate_leaves_out_by_configuration_are_not_missing_evidence(tmp_path):
    """An adapter's blind spot (torchtitan's experts under expert parallelism: exclude_activations) is said in
    a note, and the pair still passes; a module left out without saying so would be missing evidence."""
    import torch
    from torch import nn

    from ttrace_core.record.tracer import Tracer, TracerConfig

    for name, config in (("ref", None), ("cand", TracerConfig(exclude_activations=("1",)))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        tracer = Tracer(tmp_path / name, model, role="reference" if name == "ref" else "candidate", config=config)
        with tracer.step(0):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
        tracer.close()
    with RunReader(tmp_path / "ref") as reference, RunReader(tmp_path / "cand") as candidate:
        result = compare_runs(reference, candidate)
    assert result.passed, result.findings
    assert not any(c.key.fqn == "1" for c in result.comparisons)
    assert any("tracer configuration leaves out" in note and "activations" in note for note in result.notes)


def test_a_candidate_whose_steps_cover_other_micro_batches_is_told_so_in_one_note(tmp_path):
    """A launcher that started one process where two were asked (accelerate launch --cpu --num_processes 2 runs
    one): the candidate's steps ran 2 micro-batches against the reference's 4. Compare says so in one note,
    naming the step, both runs' micro-batches and the candidate's data-parallel size; runs that cover the same
    micro-batches get no such note."""
    import torch
    from torch import nn

    from ttrace_core.record.tracer import Tracer, TracerConfig

    for name, micro_batches in (("ref", 4), ("same", 4), ("fewer", 2)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        tracer = Tracer(tmp_path / name, model, role="reference" if name == "ref" else "candidate",
                        config=TracerConfig(loss_scale=1 / micro_batches))
        for step in range(2):
            with tracer.step(step):
                for micro_batch in range(micro_batches):
                    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + micro_batch))
                    (model(inputs).sum() / micro_batches).backward()
        tracer.close()
    for name, expected in (("same", None),
                           ("fewer", "micro-batch-mismatch: in step 0 (and 1 more step) the reference ran global micro-batches "
                                     "0-3, the candidate 0, 1 (1 rank, data-parallel size 1)")):
        with RunReader(tmp_path / "ref") as reference, RunReader(tmp_path / name) as candidate:
            notes = compare_runs(reference, candidate).notes
        found = [note for note in notes if note.startswith("micro-batch-mismatch")]
        assert (found[0][:len(expected)] if found else None) == expected, notes
