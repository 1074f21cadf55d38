"""format/step_file.py, the one wall a step file is opened through: where a tensor lives in its file
(`dataset_path`, and back), what `open_step` indexes (all of it, only the tensors wanted, or the file's
attributes alone), what it reads from the file of an unfinished step, and the one line naming the file
that refuses an attribute, a name or a record ttrace does not write.

Format 5's packs and the lies an index tells about them are tests/core/format/test_packs.py; a format-4
index against its datasets, and a row naming another tensor, tests/core/format/test_tensor_index.py; what
`contained` refuses, tests/core/format/test_containment.py."""

from __future__ import annotations

import os

import h5py
import pytest
import torch

from tests.faults.meta_rows import index_rows, write_index_rows, write_index_text, write_legacy_copy
from ttrace_core.errors import TraceFormatError
from ttrace_core.format.findings import FINDINGS
from ttrace_core.format.schema import NO_MICRO_BATCH, Finding, Layout, RunManifest, TensorKey, TensorMeta, TensorStats
from ttrace_core.format.step_file import (
    MAX_STOPPED_CHARS, PARTIAL_SUFFIX, STEP_FILE, STOPPED_ATTR, dataset_path, key_from_dataset_path, open_step, remedy_of,
    step_file_name,
)
from ttrace_core.format.writer import RunWriter, write_manifest

NAME = step_file_name(0, 0)
REMEDY = remedy_of(0)

ROUND_TRIP = [
    (TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0.mlp", slot="output.0"),
     "forward/mb_0000/layers.0.mlp#output.0"),
    (TensorKey(step=0, micro_batch=12, phase="forward", fqn="", slot="output.0"), "forward/mb_0012/<root>#output.0"),
    (TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="grad", fqn="layers.0.mlp.fc1.weight", slot="grad"),
     "grad/all/layers.0.mlp.fc1.weight#grad"),
    (TensorKey(step=0, micro_batch=1, phase="forward", fqn="lm_head", slot="input.hidden_states", call=2),
     "forward/mb_0001/lm_head#input.hidden_states@2"),
    (TensorKey(step=0, micro_batch=12345, phase="backward", fqn="", slot="grad_input.0", call=11),
     "backward/mb_12345/<root>#grad_input.0@11"),
    (TensorKey(step=0, micro_batch=0, phase="forward", fqn="(loss)", slot="scalar.loss"), "forward/mb_0000/(loss)#scalar.loss"),
    (TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="step", fqn="(gradient clipping)", slot="scalar.grad_norm"),
     "step/all/(gradient clipping)#scalar.grad_norm"),
    (TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="param", fqn="norm.weight", slot="value.initial"),
     "param/all/norm.weight#value.initial"),
]


@pytest.mark.parametrize("key, path", ROUND_TRIP, ids=["activation", "root", "gradient", "call-2", "root-call-11",
                                                       "loss", "step-scalar", "pre-step-value"])
def test_a_tensors_place_in_its_file_names_its_key_and_back(key, path):
    """Micro-batch in four digits or more ("all" for none), the root module as <root>, a call past the first after @;
    the step is the file's, not the name's."""
    assert dataset_path(key) == path
    assert key_from_dataset_path(path, 0) == key
    assert key_from_dataset_path(path, 7) == TensorKey(step=7, micro_batch=key.micro_batch, phase=key.phase, fqn=key.fqn,
                                                       slot=key.slot, call=key.call)


NOT_TTRACES = {
    "pack": "packs/0", "index": "tensor_index", "no-slot": "forward/mb_0000/lin", "two-parts": "forward/lin#output.0",
    "four-parts": "x/forward/mb_0000/lin#output.0", "unknown-phase": "activation/mb_0000/lin#output.0",
    "group-not-a-number": "forward/mb_x/lin#output.0", "other-group": "forward/batch_0000/lin#output.0",
    "negative-group": "forward/mb_-001/lin#output.0", "call-not-a-number": "forward/mb_0000/lin#output.0@b",
    # names that parse, but that ttrace never writes: dataset_path gives each key one name only
    "three-digits": "forward/mb_001/lin#output.0", "five-digits": "forward/mb_00001/lin#output.0",
    "empty-call": "forward/mb_0000/lin#output.0@", "call-0": "forward/mb_0000/lin#output.0@0",
    "call-01": "forward/mb_0000/lin#output.0@01", "root-unnamed": "forward/mb_0000/#output.0",
}


@pytest.mark.parametrize("path", list(NOT_TTRACES.values()), ids=list(NOT_TTRACES))
def test_a_name_ttrace_does_not_write_names_no_key(path):
    assert key_from_dataset_path(path, 0) is None


def test_step_files_are_named_by_rank_and_step():
    assert step_file_name(3, 12) == "rank_00003.step_000012.h5"
    assert STEP_FILE.match("rank_00003.step_000012.h5").groups() == ("00003", "000012", None)
    assert STEP_FILE.match("rank_00003.step_000012.h5" + PARTIAL_SUFFIX).groups() == ("00003", "000012", ".partial")
    for name in ("rank_3.step_12.h5", "rank_00003.step_000012.h5.tmp", "x_rank_00003.step_000012.h5"):
        assert STEP_FILE.match(name) is None
    assert remedy_of(3) == "re-record rank 3 (or copy its file again)"


def _meta(fqn: str, seq: int, *, step: int = 0, rank: int = 0, shape=(2, 3), stats_only=False) -> TensorMeta:
    stats = TensorStats(numel=6, sum=15.0, sumsq=55.0, min=0.0, max=5.0, num_nan=0, num_inf=0)
    return TensorMeta(key=TensorKey(step=step, micro_batch=0, phase="forward", fqn=fqn, slot="output.0"), rank=rank,
                      dtype="float32", local_shape=shape, layout=Layout.replicated(shape), seq=seq, stats=stats,
                      stats_only=stats_only)


VALUE = torch.arange(6, dtype=torch.float32).view(2, 3)


def _written(run_dir, *, blind_spots=None, stop: str | None = None):
    """Rank 0's step 0: modules "a" and "a.b" with values, "c" stats-only, and a finding; `stop`: left
    unfinished with that word (RunWriter.close), else completed with `blind_spots`."""
    write_manifest(run_dir, RunManifest(role="reference", world_size=1))
    writer = RunWriter(run_dir, 0)
    writer.begin_step(0)
    writer.write(_meta("a", 0), VALUE)
    writer.write(_meta("a.b", 1), VALUE + 1)
    writer.write(_meta("c", 2, stats_only=True), None)
    writer.add_finding(Finding(step=0, rank=0, fqn="d", slot="output.0", message="d output.0: not recorded (a test)"))
    if stop is None:
        writer.end_step(blind_spots)
    else:
        writer.close(stop)
    return run_dir / (NAME if stop is None else NAME + PARTIAL_SUFFIX)


def test_an_opened_step_file_holds_its_tensors_findings_and_blind_spots(tmp_path):
    _written(tmp_path, blind_spots={"layers.1": "inside a torch.compile region"})
    descriptors = set(os.listdir("/proc/self/fd"))
    with open_step(tmp_path, 0, 0) as step_file:
        assert (step_file.path, step_file.rank, step_file.step) == (tmp_path / NAME, 0, 0)
        assert [meta.key.fqn for meta in step_file.metas] == ["a", "a.b", "c"]
        assert [meta.stats_only for meta in step_file.metas] == [False, False, True]
        assert step_file.blind_spots == {"layers.1": "inside a torch.compile region"}
        assert [finding.fqn for finding in step_file.findings] == ["d"]
        assert not step_file.misplaced and not step_file.inventory_gaps and step_file.stopped is None
        assert torch.equal(step_file.read(step_file.metas[1]), VALUE + 1)
        with pytest.raises(TraceFormatError) as raised:
            step_file.read(step_file.metas[2])
    assert str(raised.value) == f"{tmp_path / NAME}:forward/mb_0000/c#output.0: recorded in stats-only mode; it holds no values"
    step_file.close()  # twice: nothing left to close
    assert set(os.listdir("/proc/self/fd")) == descriptors


def test_only_the_tensors_wanted_are_indexed_and_the_rest_are_no_gap(tmp_path):
    _written(tmp_path)
    asked = []

    def wanted(path: str) -> bool:
        asked.append(path)
        return path.split("/")[-1].startswith("a.")

    with open_step(tmp_path, 0, 0, wanted=wanted) as step_file:
        assert [meta.key.fqn for meta in step_file.metas] == ["a.b"]
        assert not step_file.inventory_gaps  # the file holds all 3 its writer recorded
        assert torch.equal(step_file.read(step_file.metas[0]), VALUE + 1)
    assert asked == ["forward/mb_0000/a#output.0", "forward/mb_0000/a.b#output.0", "forward/mb_0000/c#output.0"]


def test_without_tensors_only_the_attributes_are_read(tmp_path):
    """`tensors=False` (a run's blind spots) does not read the tensor index: a damaged one does not stop it."""
    path = _written(tmp_path, blind_spots={"layers.1": "compiled"})
    with h5py.File(path, "r+") as handle:
        write_index_text(handle, b"not an index")
    with open_step(tmp_path, 0, 0, tensors=False) as step_file:
        assert step_file.blind_spots == {"layers.1": "compiled"}
        assert step_file.metas == [] and step_file.findings == []
    with pytest.raises(TraceFormatError, match="tensor_index"):
        open_step(tmp_path, 0, 0)


def _refusal(run_dir) -> str:
    with pytest.raises(TraceFormatError) as raised:
        open_step(run_dir, 0, 0)
    return str(raised.value)


@pytest.mark.parametrize("name, value, line", [
    ("blind_spots", "{not json", "attribute blind_spots is not JSON (Expecting property name enclosed in double quotes: "
                                 "line 1 column 2 (char 1)); re-record rank 0"),
    ("blind_spots", '["layers.1"]', "attribute blind_spots must map module names to text; re-record rank 0"),
    ("blind_spots", '{"layers.1": 1}', "attribute blind_spots must map module names to text; re-record rank 0"),
    ("blind_spots", 7, "attribute blind_spots is an integer, not the one string ttrace writes: its header is damaged; "
                       + REMEDY),
    ("format_version", "5", "attribute format_version is a string, not the one integer ttrace writes: its header is "
                            "damaged; " + REMEDY),
    ("num_tensors", [3, 3], "attribute num_tensors is an integer of shape (2,), not the one integer ttrace writes: its "
                            "header is damaged; " + REMEDY),
], ids=["blind-spots-not-json", "blind-spots-a-list", "blind-spots-not-text", "blind-spots-an-integer",
        "format-version-a-string", "inventory-an-array"])
def test_an_attribute_ttrace_would_not_write_is_one_line_naming_the_file(tmp_path, name, value, line):
    path = _written(tmp_path)
    with h5py.File(path, "r+") as handle:
        handle.attrs[name] = value
    assert _refusal(tmp_path) == f"{path}: {line}"


def test_a_file_hdf5_cannot_open_is_one_line_naming_it(tmp_path):
    path = _written(tmp_path)
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(200))  # the signature, then nothing HDF5 can use
    line = _refusal(tmp_path)
    assert line.startswith(f"{path}: not a readable HDF5 file (")
    assert line.endswith("); it is truncated or corrupted, re-record rank 0 (or copy its file again)")


def _rename_row(path, old: str, new: str) -> None:
    with h5py.File(path, "r+") as handle:
        rows = index_rows(handle)
        next(row for row in rows if row["dataset"] == old)["dataset"] = new
        write_index_rows(handle, rows)


@pytest.mark.parametrize("alias", ["forward/mb_0/a#output.0", "forward/mb_0000/a#output.0@0"], ids=["mb_0", "call-0"])
def test_an_index_row_under_a_name_ttrace_never_writes_is_refused_on_open(tmp_path, alias):
    """Another name for the place of the very tensor the row describes: not a misplaced tensor (it would say it
    is itself), nor a tensor whose span is looked up under its true name later, but a file ttrace did not write."""
    path = _written(tmp_path)
    _rename_row(path, "forward/mb_0000/a#output.0", alias)
    assert _refusal(tmp_path) == (f"{path}: dataset {alias} is not where ttrace writes tensors; the file was not written "
                                  "by ttrace")


def test_a_format_3_dataset_under_a_name_ttrace_never_writes_is_refused_on_open(tmp_path):
    _written(tmp_path / "run")
    write_legacy_copy(tmp_path / "run", tmp_path / "legacy")
    path = tmp_path / "legacy" / NAME
    with h5py.File(path, "r+") as handle:
        handle.require_group("forward/mb_0")
        handle.move("forward/mb_0000/a#output.0", "forward/mb_0/a#output.0")
    assert _refusal(tmp_path / "legacy") == (f"{path}: dataset forward/mb_0/a#output.0 is not where ttrace writes "
                                             "tensors; the file was not written by ttrace")


def test_a_format_3_dataset_without_its_metadata_is_refused_on_open(tmp_path):
    _written(tmp_path / "run")
    write_legacy_copy(tmp_path / "run", tmp_path / "legacy")
    path = tmp_path / "legacy" / NAME
    with h5py.File(path, "r+") as handle:
        del handle["forward/mb_0000/a.b#output.0"].attrs["meta"]
    assert _refusal(tmp_path / "legacy") == (f"{path}: dataset forward/mb_0000/a.b#output.0 has no ttrace metadata; the "
                                             "file was not written by ttrace")


def test_a_stats_only_record_of_another_step_or_rank_is_placed_where_the_file_keeps_it(tmp_path):
    """It stays a stats-only record of this file's step and rank, and says what it claimed."""
    path = _written(tmp_path)
    with h5py.File(path, "r+") as handle:
        rows = index_rows(handle)
        stats_only = next(row for row in rows if row["dataset"] is None)
        stats_only["meta"]["key"]["step"], stats_only["meta"]["rank"] = 4, 2
        rows.append({"dataset": None, "meta": {**rows[0]["meta"], "key": {**rows[0]["meta"]["key"], "fqn": "e"}}})
        write_index_rows(handle, rows)
    with open_step(tmp_path, 0, 0) as step_file:
        placed = {meta.key.fqn: meta for meta in step_file.metas}
        assert [(placed[fqn].key.step, placed[fqn].rank, placed[fqn].stats_only) for fqn in ("c", "e")] == \
            [(0, 0, True), (0, 0, True)]
        c_key, e_key = placed["c"].key, placed["e"].key
        assert step_file.misplaced == {
            c_key: f"{c_key}: the stats-only record in rank 0's file of step 0 says it is step 4 / mb 0 / forward / c / "
                   "output.0 of rank 2",
            e_key: f"{e_key}: the stats-only record in rank 0's file of step 0 says it is {e_key} of rank 0, with values"}
        assert step_file.inventory_gaps == [f"{NAME} holds 4 tensors, its writer recorded 3"]


def test_an_unfinished_step_gives_what_stopped_it_and_its_findings(tmp_path):
    why = "OSError: [Errno 28] No space left\n   on device" + " padding" * 60
    _written(tmp_path, stop=why)
    step_file = open_step(tmp_path, 0, 0, complete=False, unfinished=True)
    assert step_file.stopped == "stopped on " + " ".join(why[:MAX_STOPPED_CHARS].split())
    assert [finding.message for finding in step_file.findings] == ["d output.0: not recorded (a test)"]
    assert step_file.metas == [] and step_file._handle is None  # nothing indexed, and closed


@pytest.mark.parametrize("damage", ["no file", "not hdf5", "blank word", "word not a string", "a soft link"])
def test_an_unfinished_steps_file_gives_up_each_part_on_damage(tmp_path, damage):
    """A file cut off mid-write is expected there: whatever is wrong, no error, and what still reads is read."""
    path = _written(tmp_path, stop="RuntimeError: a test")
    if damage == "no file":
        path.unlink()
    elif damage == "not hdf5":
        path.write_bytes(b"cut off" * 10)
    else:
        with h5py.File(path, "r+") as handle:
            if damage == "a soft link":
                handle["elsewhere"] = h5py.SoftLink("/" + FINDINGS)
            else:
                handle.attrs[STOPPED_ATTR] = "  \n " if damage == "blank word" else 3
    step_file = open_step(tmp_path, 0, 0, complete=False, unfinished=True)
    assert step_file.path == path
    if damage == "a soft link":  # the word still reads; the findings behind a link are given up
        assert (step_file.stopped, step_file.findings) == ("stopped on RuntimeError: a test", [])
    else:
        assert step_file.stopped == "left no word: killed, or its machine died"
        assert len(step_file.findings) == (0 if damage in ("no file", "not hdf5") else 1)
