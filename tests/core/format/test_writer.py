import json
import os

import h5py
import pytest
import torch

from tests.faults.meta_rows import write_meta
from ttrace_core.errors import TraceFormatError
from ttrace_core.format.fingerprint import installed_version
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.reader import RunReader, step_file_name
from ttrace_core.format.tensor_index import TENSOR_INDEX
from ttrace_core.format.writer import RunWriter, write_manifest



def _meta(rank: int, step: int, value: torch.Tensor, fqn: str = "lin") -> TensorMeta:
    key = TensorKey(step=step, micro_batch=0, phase="forward", fqn=fqn, slot="output.0")
    return TensorMeta(key=key, rank=rank, dtype=str(value.dtype).removeprefix("torch."), local_shape=tuple(value.shape),
                      layout=Layout.replicated(tuple(value.shape)), seq=0)


def _record(run_dir, values: dict[int, torch.Tensor], *, world_size: int = 1, steps=(0,)) -> None:
    write_manifest(run_dir, RunManifest(role="reference", world_size=world_size))
    for rank in range(world_size):
        writer = RunWriter(run_dir, rank)
        for step in steps:
            writer.begin_step(step)
            for index, value in values.items():
                writer.write(_meta(rank, step, value, fqn=f"m{index}"), value)
            writer.end_step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_values_round_trip_bit_exactly(tmp_path, dtype):
    value = (torch.randn(3, 5) * 4).to(dtype) if dtype != torch.int64 else torch.arange(15).view(3, 5)
    _record(tmp_path, {0: value})
    with RunReader(tmp_path) as reader:
        (key,) = reader.keys()
        read = reader.read(reader.index[key][0])
    assert read.dtype == dtype
    assert torch.equal(read.view(torch.uint8), value.contiguous().view(torch.uint8))


def test_packs_are_contiguous_and_uncompressed(tmp_path):
    value = torch.randn(4, 4)
    _record(tmp_path, {0: value})
    with h5py.File(tmp_path / step_file_name(0, 0)) as handle:
        (row,) = [json.loads(line) for line in bytes(handle[TENSOR_INDEX][()]).split(b"\n")]
        assert (row["dataset"], row["meta"]["key"]["fqn"], row["pack"], row["offset"]) == \
            ("forward/mb_0000/m0#output.0", "m0", 0, 0)
        pack = handle["packs/0"]  # format 5: the values are a span of a pack, the metadata the index's row
        assert pack.chunks is None and pack.compression is None and pack.dtype == "uint8" and not pack.attrs
        assert bytes(pack[:64]) == value.numpy().tobytes()


def test_interrupted_step_is_reported_and_completed_steps_stay_readable(tmp_path):
    _record(tmp_path, {0: torch.ones(2)}, steps=(0,))
    writer = RunWriter(tmp_path, 0)
    writer.begin_step(1)
    writer.write(_meta(0, 1, torch.ones(2)), torch.ones(2))
    writer.close()  # never end_step(): as after a crash
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0]
        assert "did not finish step 1" in reader.partial_steps[1]
        assert {key.step for key in reader.keys()} == {0}


def test_a_rank_that_died_is_named_missing_and_the_survivors_steps_stay_readable(tmp_path):
    _record(tmp_path, {0: torch.ones(2)}, world_size=2, steps=(0, 1))
    (tmp_path / step_file_name(1, 1)).unlink()  # rank 1 died after step 0; rank 0 went on to finish step 1
    writer = RunWriter(tmp_path, 0)
    writer.begin_step(2)
    writer.close()  # rank 0 was stopped in step 2
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0]
        assert reader.partial_steps[1] == ("ranks [1] have no file for step 1 (the rank died before the step began, "
                                           "or its file was not copied); ranks [0] finished it")
        assert reader.partial_steps[2].startswith("ranks [0] did not finish step 2 (rank 0 left no word: killed, or its "
                                                 "machine died); ranks [1] have no file")
        assert {key.step for key in reader.keys()} == {0}


def test_truncated_file_names_the_file(tmp_path):
    _record(tmp_path, {0: torch.randn(64, 64)})
    path = tmp_path / step_file_name(0, 0)
    os.truncate(path, 4096)
    with pytest.raises(TraceFormatError, match=r"rank_00000\.step_000000\.h5: not a readable HDF5 file.*re-record rank 0"):
        RunReader(tmp_path)


def test_garbage_file_names_the_file(tmp_path):
    _record(tmp_path, {0: torch.randn(4)})
    (tmp_path / step_file_name(0, 0)).write_bytes(b"\x80\x04not hdf5 at all" * 100)
    with pytest.raises(TraceFormatError, match="not a readable HDF5 file"):
        RunReader(tmp_path)


def test_missing_rank_file(tmp_path):
    _record(tmp_path, {0: torch.randn(4)}, world_size=2)
    (tmp_path / step_file_name(1, 0)).unlink()
    with pytest.raises(TraceFormatError, match="world_size 2 but there is no file of rank 1"):
        RunReader(tmp_path)


@pytest.mark.parametrize("content, message", [(None, "manifest.json: missing"), ("{not json", "not a valid manifest"),
                                              ('{"role": "reference", "world_size": 1, "format_version": 99}', "format version 99")],
                         ids=["missing", "malformed", "newer-version"])
def test_bad_manifest(tmp_path, content, message):
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        RunReader(tmp_path)


def test_a_manifest_from_another_ttrace_names_both_versions(tmp_path):
    """A field this ttrace does not know, or a newer trace format, in a manifest whose fingerprint names another
    ttrace: the line says which version recorded it and to read it with that one, not only to re-record."""
    _record(tmp_path, {0: torch.randn(4)})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    ours = installed_version("ttrace")
    manifest["environment"] = {"packages": {"ttrace": "9.1.0"}}
    manifest["pipeline_schedule"] = "zero-bubble"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError) as raised:
        RunReader(tmp_path)
    line = str(raised.value)
    assert "unknown field `pipeline_schedule`" in line and "recorded by ttrace '9.1.0'" in line, line
    assert f"this is ttrace {ours}" in line and "pip install -U ttrace-dist" in line and "\n" not in line, line
    manifest["format_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match=r"format version 99, .*recorded by ttrace '9.1.0'"):
        RunReader(tmp_path)
    # the same damage under this ttrace's own version is damage: re-record
    manifest["environment"]["packages"]["ttrace"], manifest["format_version"] = ours, 5
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match=r"unknown field `pipeline_schedule`\); re-record the run$"):
        RunReader(tmp_path)
    del manifest["environment"]
    manifest["format_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match=r"format version 99, .*; upgrade ttrace to read it$"):
        RunReader(tmp_path)


def test_reading_never_unpickles(tmp_path):
    """The metadata is JSON and values are numeric HDF5 arrays; a pickled attribute is refused as data."""
    _record(tmp_path, {0: torch.randn(4)})
    with h5py.File(tmp_path / step_file_name(0, 0), "a") as handle:
        write_meta(handle, "forward/mb_0000/m0#output.0", "\x80\x04\x95")  # pickle protocol header
    with pytest.raises(TraceFormatError, match="tensor_index line 1: tensor metadata is malformed"):
        RunReader(tmp_path)


def test_recording_into_an_existing_trace_is_refused(tmp_path):
    from ttrace_core.format.writer import refuse_existing_trace

    refuse_existing_trace(tmp_path)  # an empty directory is fine
    _record(tmp_path, {0: torch.ones(2)})
    with pytest.raises(TraceFormatError, match="already holds a trace"):
        refuse_existing_trace(tmp_path)


def test_a_subtree_reader_indexes_only_that_module_and_its_descendants(tmp_path):
    _record(tmp_path, {0: torch.ones(2), 1: torch.ones(3)})  # modules m0 and m1
    write_manifest(tmp_path, RunManifest(role="reference", world_size=1))
    with RunReader(tmp_path, subtree="m1") as reader:
        assert [key.fqn for key in reader.index] == ["m1"]
    with RunReader(tmp_path, subtree="m") as reader:  # whole name components only: "m" holds neither
        assert list(reader.index) == []
