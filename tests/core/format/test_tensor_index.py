"""The tensor index (ttrace_core/format/tensor_index.py) and each recorded byte written once
(ttrace_core/format/same_storage.py): what is written reads back whole, in format 5 and in its format-4
and format-3 copies; a format-4 index lying about its datasets is named; a tensor recorded twice in a
step is one span behind two rows (format 5), one dataset behind two names (format 4). Format 5's packs
have their own tests (tests/core/format/test_packs.py)."""

from __future__ import annotations

import gc

import h5py
import msgspec
import pytest
import torch

from tests.faults.meta_rows import (drop_meta, index_rows, read_meta, write_format4_copy, write_index_rows, write_legacy_copy,
                                   write_meta)
from ttrace_core.errors import TraceFormatError
from ttrace_core.format.reader import RunReader, step_file_name
from ttrace_core.format.shard_reads import read_shards
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta, TensorStats
from ttrace_core.format.tensor_index import LINKS_ATTR, TENSOR_INDEX
from ttrace_core.format.writer import RunWriter, write_manifest


STEP_FILE = step_file_name(0, 0)
FIRST = "forward/mb_0000/m0#output.0"


def _meta(fqn: str, slot: str, value: torch.Tensor | None, seq: int, *, shape=(2, 3), stats_only=False) -> TensorMeta:
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn=fqn, slot=slot)
    dtype = "float32" if value is None else str(value.dtype).removeprefix("torch.")
    stats = TensorStats(numel=6, sum=1.5, sumsq=2.25, min=-1.0, max=2.0, num_nan=0, num_inf=0)
    return TensorMeta(key=key, rank=0, dtype=dtype, local_shape=tuple(shape if value is None else value.shape),
                      layout=Layout.replicated(tuple(shape if value is None else value.shape)), seq=seq, stats=stats,
                      stats_only=stats_only)


def _written_run(run_dir) -> dict[TensorKey, tuple[TensorMeta, torch.Tensor | None]]:
    """A step with every kind of row: dtypes stored natively and as raw bits, a stats-only tensor,
    one tensor recorded twice (a link), and one changed in place in between (written again)."""
    write_manifest(run_dir, RunManifest(role="reference", world_size=1))
    output = torch.arange(6, dtype=torch.float32).view(2, 3)
    values = {("m0", "output.0"): output, ("m1", "input.0"): output,  # the next module's input: the same bytes
              ("m2", "output.0"): torch.randn(4).to(torch.bfloat16), ("m3", "output.0"): torch.arange(5),
              ("m4", "output.0"): torch.randn(3).to(torch.float8_e4m3fn)}
    writer, written = RunWriter(run_dir, 0), {}
    writer.begin_step(0)
    for seq, ((fqn, slot), value) in enumerate(values.items()):
        meta = _meta(fqn, slot, value, seq)
        writer.write(meta, value)
        written[meta.key] = (meta, value.clone())
    output.add_(1.0)  # in place: its next record holds other values
    meta = _meta("m1", "output.0", output, 5)
    writer.write(meta, output)
    written[meta.key] = (meta, output.clone())
    meta = _meta("m5", "output.0", None, 6, stats_only=True)
    writer.write(meta, None)
    written[meta.key] = (meta, None)
    writer.end_step()
    assert (writer.num_links_written, writer.num_link_bytes) == (1, 24)
    return written


def _format4_run(tmp_path, written: dict | None = None):
    """`_written_run`'s step as format 4 wrote it (a dataset per tensor, a hard link for the same bytes);
    `written` takes what was written."""
    (written if written is not None else {}).update(_written_run(tmp_path / "written"))
    write_format4_copy(tmp_path / "written", tmp_path / "format4")
    return tmp_path / "format4"


def _read_back(run_dir) -> dict[TensorKey, tuple[TensorMeta, torch.Tensor | None]]:
    with RunReader(run_dir) as reader:
        assert not reader.misplaced and not reader.inventory_gaps
        return {key: (meta, None if meta.stats_only else reader.read(meta)) for key, (meta,) in reader.index.items()}


def _same(read: dict, written: dict) -> None:
    assert read.keys() == written.keys()
    for key, (meta, value) in written.items():
        assert read[key][0] == meta
        assert (value is None and read[key][1] is None) or torch.equal(read[key][1].view(torch.uint8),
                                                                        value.contiguous().view(torch.uint8)), key


NAMES = [FIRST, "forward/mb_0000/m1#input.0", "forward/mb_0000/m2#output.0", "forward/mb_0000/m3#output.0",
         "forward/mb_0000/m4#output.0", "forward/mb_0000/m1#output.0", None]


def test_every_key_meta_and_value_reads_back_as_written(tmp_path):
    written = _written_run(tmp_path)
    _same(_read_back(tmp_path), written)
    with h5py.File(tmp_path / STEP_FILE) as handle:
        assert handle.attrs["format_version"] == 5 and handle.attrs[LINKS_ATTR] == 1
        rows = index_rows(handle)
        assert [row["dataset"] for row in rows] == NAMES
        # the recorded-twice tensor is one span behind two rows; the one changed in place is its own
        first, again, changed = ((row["pack"], row["offset"]) for row in (rows[0], rows[1], rows[5]))
        assert first == again != changed
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn="m1", slot="input.0")
    ((meta, value),) = read_shards(tmp_path, key, 1)  # the tensor page's single-tensor read
    assert meta == written[key][0] and torch.equal(value, written[key][1])


def test_an_opened_index_leaves_the_cyclic_collector_nothing_to_walk(tmp_path):
    """The records of an index (a 48-layer step holds 15k rows) are Structs the collector does not track: a
    full collection after opening a run walked them all again (opening the 100-layer tiny pair took twice
    as long with them tracked, benchmarks/index_open.py)."""
    _written_run(tmp_path)
    with RunReader(tmp_path) as reader:
        metas = [meta for found in reader.index.values() for meta in found]
        assert metas and not any(gc.is_tracked(record) for meta in metas
                                 for record in (meta, meta.key, meta.layout, meta.stats) if record is not None)


def test_a_format_4_copy_reads_the_same(tmp_path):
    """The same step written the way format 4 wrote it: a dataset per tensor, the same bytes twice one dataset."""
    written = {}
    run = _format4_run(tmp_path, written)
    with h5py.File(run / STEP_FILE) as handle:
        assert handle.attrs["format_version"] == 4 and handle.attrs[LINKS_ATTR] == 1
        assert [row["dataset"] for row in index_rows(handle)] == NAMES and "packs" not in handle
        first, again, changed = (h5py.h5o.get_info(handle[name].id).addr for name in (NAMES[0], NAMES[1], NAMES[5]))
        assert first == again != changed
    _same(_read_back(run), written)
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn="m1", slot="input.0")
    ((meta, value),) = read_shards(run, key, 1)
    assert meta == written[key][0] and torch.equal(value, written[key][1])


def test_a_format_3_copy_reads_the_same(tmp_path):
    """The same step written the way format 3 wrote it (an attribute per dataset) is read by the old path."""
    written = _written_run(tmp_path / "new")
    write_legacy_copy(tmp_path / "new", tmp_path / "old")
    with h5py.File(tmp_path / "old" / STEP_FILE) as handle:
        assert TENSOR_INDEX not in handle and "meta" in handle[FIRST].attrs
    _same(_read_back(tmp_path / "old"), written)


def _edit_row(run_dir, dataset: str, **changes) -> None:
    with h5py.File(run_dir / STEP_FILE, "r+") as handle:
        meta = read_meta(handle, dataset)
        for name, value in changes.items():
            target = next(part for part in (meta["key"], meta) if name in part)
            target[name] = value
        write_meta(handle, dataset, meta)


def _rename_row(run_dir, dataset: str, to: str) -> None:
    with h5py.File(run_dir / STEP_FILE, "r+") as handle:
        write_index_rows(handle, [{**row, "dataset": to if row["dataset"] == dataset else row["dataset"]}
                                  for row in index_rows(handle)])


def _duplicate_row(run_dir, dataset: str) -> None:
    with h5py.File(run_dir / STEP_FILE, "r+") as handle:
        rows = index_rows(handle)
        write_index_rows(handle, rows + [row for row in rows if row["dataset"] == dataset])


def _drop_row(run_dir, dataset: str) -> None:
    with h5py.File(run_dir / STEP_FILE, "r+") as handle:
        drop_meta(handle, dataset)


def _plant_unnamed_dataset(run_dir) -> None:
    """A dataset (and its row) at a name ttrace never writes: no '#slot'."""
    with h5py.File(run_dir / STEP_FILE, "r+") as handle:
        handle["forward/mb_0000/elsewhere"] = handle[FIRST][()]
        rows = index_rows(handle)
        write_index_rows(handle, rows + [{**rows[0], "dataset": "forward/mb_0000/elsewhere"}])


WHERE = f"{STEP_FILE}"
LIES_REFUSED_ON_OPEN = [
    (lambda run: _drop_row(run, "forward/mb_0000/m2#output.0"),
     f"{WHERE}: dataset forward/mb_0000/m2#output.0 has no row in the tensor index; the file was not written by "
     "ttrace or its index is damaged, re-record this rank"),
    (lambda run: _duplicate_row(run, FIRST),
     f"{WHERE}: the tensor index lists dataset {FIRST} twice; its index is damaged, re-record this rank"),
    (lambda run: _edit_row(run, FIRST, local_shape="2x3"),
     f"{WHERE}:{TENSOR_INDEX} line 1: tensor metadata is malformed (field $.meta.local_shape: Expected `array`, got "
     "`str`); re-record this rank"),
    (lambda run: _rename_row(run, FIRST, "forward/mb_0000/m9#output.0"),
     f"{WHERE}: dataset {FIRST} has no row in the tensor index; the file was not written by ttrace or its index is "
     "damaged, re-record this rank"),
    (_plant_unnamed_dataset,
     f"{WHERE}: dataset forward/mb_0000/elsewhere is not where ttrace writes tensors; the file was not written by ttrace"),
]


@pytest.mark.parametrize("lie, line", LIES_REFUSED_ON_OPEN, ids=["dataset-without-row", "two-rows-for-one-dataset",
                                                                  "malformed-row", "row-renamed",
                                                                  "dataset-outside-ttraces-names"])
def test_an_index_that_lies_about_the_files_datasets_is_refused_in_one_line(tmp_path, lie, line):
    run = _format4_run(tmp_path)
    lie(run)
    with pytest.raises(TraceFormatError) as raised:
        RunReader(run)
    assert str(raised.value) == f"{run}/{line}"


def test_a_row_naming_another_tensor_is_misplaced_and_a_row_without_its_dataset_is_a_gap(tmp_path):
    run = _format4_run(tmp_path)
    _edit_row(run, FIRST, micro_batch=1, rank=3)
    with h5py.File(run / STEP_FILE, "r+") as handle:
        del handle["forward/mb_0000/m3#output.0"]  # its values are lost, its row is still there
    with RunReader(run) as reader:
        placed = TensorKey(step=0, micro_batch=0, phase="forward", fqn="m0", slot="output.0")
        assert reader.misplaced == {placed: f"{placed}: the index row of the dataset in rank 0's file says it is "
                                            "step 0 / mb 1 / forward / m0 / output.0 of rank 3"}
        assert reader.index[placed][0].rank == 0
        assert reader.inventory_gaps == [f"{STEP_FILE}: its tensor index lists forward/mb_0000/m3#output.0, which "
                                         "the file does not hold"]
        assert not any(key.fqn == "m3" for key in reader.index)


@pytest.mark.parametrize("change, line", [
    ({"local_shape": [3, 2]}, "stored shape (2, 3) differs from its metadata (3, 2)"),
    ({"dtype": "int32"}, "its stored datatype reads as <f4 (float32) but its metadata says <i4 (int32): the datatype "
                         "message is damaged"),
], ids=["shape", "dtype"])
def test_a_row_lying_about_shape_or_dtype_is_refused_before_its_values_are_read(tmp_path, change, line):
    run = _format4_run(tmp_path)
    _edit_row(run, FIRST, **change)
    with RunReader(run) as reader:
        (meta,) = reader.index[TensorKey(step=0, micro_batch=0, phase="forward", fqn="m0", slot="output.0")]
        with pytest.raises(TraceFormatError) as raised:
            reader.read(meta)
    assert str(raised.value) == f"{run}/{STEP_FILE}:{FIRST}: {line}; re-record rank 0 (or copy its file again)"


@pytest.mark.parametrize("link, kind", [(lambda: h5py.SoftLink("/forward"), "a soft"),
                                        (lambda: h5py.ExternalLink("/etc/hostname", "x"), "an external")],
                         ids=["soft", "external"])
def test_a_soft_or_external_link_in_an_indexed_file_is_refused_in_one_line(tmp_path, link, kind):
    run = _format4_run(tmp_path)
    with h5py.File(run / STEP_FILE, "r+") as handle:
        del handle[FIRST]
        handle[FIRST] = link()
    with pytest.raises(TraceFormatError) as raised:
        RunReader(run)
    assert str(raised.value) == (f"{run}/{STEP_FILE}: {FIRST} is {kind} link; ttrace writes only hard links "
                                 "inside a step file and reads nothing outside the trace, re-record this rank")


def test_only_the_same_view_of_unchanged_bytes_is_linked(tmp_path):
    write_manifest(tmp_path, RunManifest(role="reference", world_size=1))
    base = torch.randn(4, 4)
    writer = RunWriter(tmp_path, 0)
    writer.begin_step(0)
    for seq, (fqn, value) in enumerate([("a", base), ("b", base.t()), ("c", base[1:]), ("d", base.view(4, 4)),
                                        ("e", base.clone())]):
        writer.write(_meta(fqn, "output.0", value, seq), value)
    writer.end_step()
    assert writer.num_links_written == 1  # only "d": the same storage, offset, shape, strides and version as "a"
    with RunReader(tmp_path) as reader:
        for fqn, expected in [("b", base.t()), ("c", base[1:]), ("d", base)]:
            (meta,) = reader.index[_meta(fqn, "output.0", base, 0).key]
            assert torch.equal(reader.read(meta), expected)


def test_a_step_closed_before_its_end_keeps_an_index_of_what_it_holds(tmp_path):
    """A stopped step's file (RunWriter.close) is self-describing; a killed one has no index, and the
    reader never reads tensors of an unfinished step either way."""
    write_manifest(tmp_path, RunManifest(role="reference", world_size=1))
    writer = RunWriter(tmp_path, 0)
    writer.begin_step(0)
    writer.write(_meta("m0", "output.0", torch.ones(2, 3), 0), torch.ones(2, 3))
    writer.close("OSError: disk full")
    with h5py.File(tmp_path / (STEP_FILE + ".partial")) as handle:
        assert [row["dataset"] for row in index_rows(handle)] == [FIRST]
    with RunReader(tmp_path) as reader:
        assert not reader.index and "stopped on OSError: disk full" in reader.partial_steps[0]


def test_a_complete_step_of_no_tensors_reads_back_as_empty(tmp_path):
    """A pipeline rank that holds none of the module `ttrace localize --module` replays completes its step
    with nothing recorded: an empty index, read as a step of no tensors (not as a damaged file)."""
    write_manifest(tmp_path, RunManifest(role="candidate", world_size=1))
    writer = RunWriter(tmp_path, 0)
    writer.begin_step(0)
    writer.end_step()
    with h5py.File(tmp_path / STEP_FILE) as handle:
        assert handle[TENSOR_INDEX].shape == (0,)
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0] and not reader.index and not reader.partial_steps


def test_the_writer_thread_links_the_same_bytes_without_copying_them_again(tmp_path):
    from ttrace_core.record.background_writer import BackgroundWriter

    write_manifest(tmp_path, RunManifest(role="reference", world_size=1))
    writer = RunWriter(tmp_path, 0)
    background = BackgroundWriter(writer, max_pending_bytes=2**20)
    output = torch.arange(6, dtype=torch.float32).view(2, 3)
    background.begin_step(0)
    background.write(_meta("m0", "output.0", output, 0), output)
    background.write(_meta("m1", "input.0", output, 1), output)  # the same bytes: a link, no copy queued
    output.mul_(10)  # in place after both were queued: the values recorded are those before
    background.write(_meta("m1", "output.0", output, 2), output)  # a new version: written again
    background.end_step()
    background.stop()
    assert writer.num_links_written == 1 and writer.num_bytes_written == 2 * 24
    read = _read_back(tmp_path)
    before = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert [read[_meta(f, s, output, 0).key][1].tolist() for f, s in (("m0", "output.0"), ("m1", "input.0"),
                                                                       ("m1", "output.0"))] == \
        [before.tolist(), before.tolist(), (before * 10).tolist()]


def _traced_run(run_dir, role: str) -> tuple[int, int]:
    """Two steps of a small model through the Tracer: a Linear's output is the GELU's input, and so on.
    Returns the bytes written and the bytes recorded (duplicates counted again)."""
    from ttrace_core.record.tracer import Tracer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(run_dir, model, role=role, optimizer=optimizer)
    for step in range(2):
        with tracer.step(step):
            optimizer.zero_grad()
            for micro_batch in range(2):
                inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(micro_batch), requires_grad=True)
                model(inputs).square().mean().backward()
            optimizer.step()
    tracer.close()
    return tracer.num_bytes_written, tracer.num_bytes_recorded


def test_a_deduplicated_trace_compares_exactly_as_a_full_one(tmp_path, monkeypatch):
    import json

    from ttrace_core.compare.engine import compare_runs
    from ttrace_core.compare.tolerances import DtypeTolerances
    from ttrace_core.format.same_storage import WrittenStorages

    _traced_run(tmp_path / "reference", "reference")
    written, recorded = _traced_run(tmp_path / "deduplicated", "candidate")
    with monkeypatch.context() as patch:  # every tensor written as its own dataset, as format 3 did
        patch.setattr(WrittenStorages, "first_dataset", lambda self, value, stats: (None, None))
        full_written, full_recorded = _traced_run(tmp_path / "full", "candidate")
    assert written < full_written == full_recorded == recorded  # the same tensors recorded, fewer bytes written
    links = []
    for run in ("deduplicated", "full"):
        with h5py.File(tmp_path / run / STEP_FILE) as handle:
            links.append(int(handle.attrs[LINKS_ATTR]))
    assert links[0] > 0 and links[1] == 0
    assert sum(p.stat().st_size for p in (tmp_path / "deduplicated").glob("*.h5")) < \
        sum(p.stat().st_size for p in (tmp_path / "full").glob("*.h5"))
    tables = []
    for run in ("deduplicated", "full"):
        with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / run) as candidate:
            result = compare_runs(reference, candidate, DtypeTolerances())
            tables.append([json.dumps(row.to_dict(), sort_keys=True) for row in result.comparisons])
            assert result.passed
    assert len(tables[0]) > 20 and tables[0] == tables[1]


def test_a_write_around_autograd_is_caught_by_the_statistics(tmp_path):
    """`.data` changes the bytes without the version counter (so do collectives into FSDP2's buffers)."""
    write_manifest(tmp_path, RunManifest(role="reference", world_size=1))
    value = torch.ones(2, 3)
    writer = RunWriter(tmp_path, 0)
    writer.begin_step(0)
    writer.write(msgspec.structs.replace(_meta("a", "output.0", value, 0), stats=_stats(value)), value)
    version = value._version
    value.data.mul_(3.0)
    assert value._version == version
    writer.write(msgspec.structs.replace(_meta("b", "output.0", value, 1), stats=_stats(value)), value)
    writer.end_step()
    assert writer.num_links_written == 0
    read = _read_back(tmp_path)
    assert [read[_meta(fqn, "output.0", value, 0).key][1].sum().item() for fqn in "ab"] == [6.0, 18.0]


def _stats(value: torch.Tensor) -> TensorStats:
    from ttrace_core.format.writer import stats_from_tensor

    return stats_from_tensor(value)
