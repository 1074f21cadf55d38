"""format/datasets.py: one HDF5 object of a step file read, what it declares checked before anything is
allocated, and whatever HDF5, numpy or torch raise on damage made one line naming the file and the object.

Each check on small hand-made HDF5 files; the damage a real trace takes (flipped bits, zeroed heaps,
packs and index rows that lie) is in tests/core/format/test_packs.py, test_tensor_index.py and
tests/test_damaged_traces.py, which reach these checks through the reader."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from ttrace_core.errors import LayoutError, TraceFormatError
from ttrace_core.format.datasets import (
    INTEGER, STRING, check_storage, damaged_file_errors, read_bytes_dataset, read_values, read_whole_values,
    scalar_attribute, stored_dtype, tensor_from_array,
)

WHERE = "run/rank_00000.step_000000.h5:forward/mb_0000/lin#output.0"
REMEDY = "re-record rank 0 (or copy its file again)"


def _raised(error: BaseException) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as raised:
        with damaged_file_errors(WHERE, REMEDY):
            raise error
    assert raised.value.__cause__ is error
    return raised.value


@pytest.mark.parametrize("error, text", [
    (OSError("Can't read data (bad global heap collection signature)"), "Can't read data (bad global heap collection signature)"),
    (KeyError("no such object"), "'no such object'"),
    (ValueError("Invalid\n   dataspace\tselection"), "Invalid dataspace selection"),
    (TypeError(""), "TypeError"),
    (RuntimeError("x" * 300), "x" * 240),
    (OverflowError("too large"), "too large"),
    (IndexError("index 9 is out of bounds"), "index 9 is out of bounds"),
], ids=["oserror", "keyerror", "whitespace-collapsed", "empty-message", "cut-at-240", "overflow", "index"])
def test_a_read_error_below_ttrace_becomes_one_line(error, text):
    assert str(_raised(error)) == f"{WHERE}: cannot be read, the file is damaged ({text}); {REMEDY}"


def test_memory_beyond_the_machine_is_said_as_damage():
    assert str(_raised(MemoryError("Unable to allocate 8.00 TiB"))) == (
        f"{WHERE}: reading it would take more memory than this machine has, more than the file holds: it is "
        f"damaged; {REMEDY}")


@pytest.mark.parametrize("error", [TraceFormatError("already one line"), LayoutError("a layout"),
                                   ZeroDivisionError("a ttrace bug"), KeyboardInterrupt()],
                         ids=["trace-format", "layout", "other", "interrupt"])
def test_ttraces_own_errors_and_bugs_pass_through_unchanged(error):
    with pytest.raises(type(error)) as raised:
        with damaged_file_errors(WHERE, REMEDY):
            raise error
    assert raised.value is error


@pytest.mark.parametrize("name, stored", [
    ("bfloat16", "int16"), ("float8_e4m3fn", "uint8"), ("float8_e5m2", "uint8"), ("float8_e4m3fnuz", "uint8"),
    ("float8_e5m2fnuz", "uint8"), ("float32", "float32"), ("float16", "float16"), ("int64", "int64"), ("bool", "bool"),
])
def test_bf16_and_fp8_are_stored_as_raw_bits_of_the_same_width(name, stored):
    assert stored_dtype(name) == np.dtype(stored)
    if name in ("bfloat16", "float8_e4m3fn"):
        assert stored_dtype(name).itemsize == torch.empty(0, dtype=getattr(torch, name)).element_size()


@pytest.fixture
def step_file(tmp_path):
    """A file with a float32 [2, 3] dataset, copies of it compressed losslessly (gzip with shuffle and checksums, lzf),
    an int32 one through the scale-offset filter, a compressed one whose chunks were never written, one of 2**40
    floats never written, a
    group, a row of bytes (JSON lines), a 2-D uint8 dataset, an empty one and a row of floats."""
    with h5py.File(tmp_path / "step.h5", "w") as handle:
        handle["values"] = np.arange(6, dtype=np.float32).reshape(2, 3)
        handle.create_dataset("compressed", data=np.arange(6, dtype=np.float32).reshape(2, 3), compression="gzip", shuffle=True,
                              fletcher32=True)
        handle.create_dataset("lzf", data=np.arange(6, dtype=np.float32).reshape(2, 3), compression="lzf")
        handle.create_dataset("scaled", data=np.arange(6, dtype=np.int32).reshape(2, 3), scaleoffset=0)
        handle.create_dataset("chunks_never_written", shape=(2**20,), dtype=np.float32, chunks=(2**10,), compression="gzip")
        handle.create_dataset("never_written", shape=(2**40,), dtype=np.float32)
        handle.create_group("group")
        handle["rows"] = np.frombuffer(b'{"a": 1}\n{"b": 2}', dtype=np.uint8)
        handle["square"] = np.zeros((2, 2), dtype=np.uint8)
        handle["empty"] = np.zeros((0, 4), dtype=np.float32)
        handle["floats"] = np.zeros(3, dtype=np.float32)
    with h5py.File(tmp_path / "step.h5", "r") as handle:
        yield handle


F32 = np.dtype("float32")


@pytest.mark.parametrize("name, dtype, shape, line", [
    ("values", np.dtype("int32"), (2, 3), "its stored datatype reads as <f4 (float32) but its metadata says <i4 (int32): "
                                          "the datatype message is damaged"),
    ("values", F32, (3, 2), "stored shape (2, 3) differs from its metadata (3, 2)"),
    ("scaled", np.dtype("int32"), (2, 3), "stored through HDF5 filter 6 (scaleoffset), not one of the lossless filters "
     "built into HDF5 and h5py (gzip, shuffle, fletcher32, szip, lzf): ttrace loads no filter plugin and reads no lossy "
     "filter (rewrite the file without it: h5repack -f NONE)"),
    ("chunks_never_written", F32, (2**20,), "declares shape (1048576,) of <f4 in 1024 chunks but the file holds 0 of "
                                            "them (a damaged header, or values never written)"),
    ("never_written", F32, (2**40,), "declares shape (1099511627776,) of <f4 (4398046511104 bytes) but the file holds "
                                     "0 bytes of storage for it (a damaged header, or values never written)"),
], ids=["dtype", "shape", "lossy-filter", "chunks-never-written", "storage-never-written"])
def test_a_dataset_unlike_its_metadata_is_refused_from_its_header(step_file, name, dtype, shape, line):
    for dataset in (step_file[name], step_file[name].id):  # the high-level dataset or its low-level id
        with pytest.raises(TraceFormatError) as raised:
            check_storage(dataset, dtype, shape, WHERE, REMEDY)
        assert str(raised.value) == f"{WHERE}: {line}; {REMEDY}"


def test_values_are_read_whole_or_by_region_after_the_check(step_file):
    whole = np.arange(6, dtype=np.float32).reshape(2, 3)
    check_storage(step_file["values"], F32, (2, 3), WHERE, REMEDY)
    assert np.array_equal(read_values(step_file["values"], F32, (2, 3), WHERE, REMEDY), whole)
    assert np.array_equal(read_values(step_file["values"], F32, (2, 3), WHERE, REMEDY, (slice(1, 2),)), whole[1:2])
    assert np.array_equal(read_whole_values(step_file, "values", F32, (2, 3), WHERE, REMEDY), whole)
    assert read_whole_values(step_file, "empty", F32, (0, 4), WHERE, REMEDY).shape == (0, 4)
    with pytest.raises(TraceFormatError, match=r"stored shape \(2, 3\) differs from its metadata \(6,\)"):
        read_values(step_file["values"], F32, (6,), WHERE, REMEDY)  # checked before the read


@pytest.mark.parametrize("name", ["compressed", "lzf"])
def test_a_dataset_another_tool_compressed_losslessly_reads_as_written(step_file, name):
    """An archived trace rewritten through gzip (with shuffle and checksums) or lzf: every bit as written."""
    whole = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(read_values(step_file[name], F32, (2, 3), WHERE, REMEDY), whole)
    assert np.array_equal(read_values(step_file[name], F32, (2, 3), WHERE, REMEDY, (slice(1, 2),)), whole[1:2])
    assert np.array_equal(read_whole_values(step_file, name, F32, (2, 3), WHERE, REMEDY), whole)


@pytest.mark.parametrize("path", ["absent", "group", "group/deeper"])
def test_a_whole_read_of_no_dataset_says_so(step_file, path):
    with pytest.raises(TraceFormatError) as raised:
        read_whole_values(step_file, path, F32, (2, 3), WHERE, REMEDY)
    assert str(raised.value) == f"{WHERE}: the file holds no such dataset; {REMEDY}"


def test_a_whole_read_runs_the_callers_check_on_the_opened_dataset_first(step_file):
    seen = []

    def refuse(dataset):
        seen.append(dataset)
        raise TraceFormatError(f"{WHERE}: refused by the caller")

    with pytest.raises(TraceFormatError, match="refused by the caller"):
        read_whole_values(step_file, "values", np.dtype("int8"), (9,), WHERE, REMEDY, check=refuse)  # before the dtype check
    assert [type(dataset) for dataset in seen] == [h5py.h5d.DatasetID]


def test_a_row_of_bytes_is_read_as_bytes_and_anything_else_refused(step_file):
    assert read_bytes_dataset(step_file["rows"], WHERE, REMEDY) == b'{"a": 1}\n{"b": 2}'
    with pytest.raises(TraceFormatError) as raised:
        read_bytes_dataset(step_file["square"], WHERE, REMEDY)
    assert str(raised.value) == f"{WHERE}: stored shape (2, 2), ttrace writes one row of bytes here; {REMEDY}"
    with pytest.raises(TraceFormatError, match=r"reads as <f4 \(float32\) but its metadata says \|u1 \(uint8\)"):
        read_bytes_dataset(step_file["floats"], WHERE, REMEDY)  # one row, of floats


@pytest.fixture
def attributes(tmp_path):
    with h5py.File(tmp_path / "attributes.h5", "w") as handle:
        handle.attrs["format_version"] = 5
        handle.attrs["blind_spots"] = '{"layers.0": "compiled"}'
        handle.attrs["fixed"] = np.bytes_(b"fixed width")
        handle.attrs["as_float"] = 5.0
        handle.attrs["as_array"] = [5, 5]
        handle["values"] = np.zeros(2)
        handle["values"].attrs["meta"] = "{}"
    with h5py.File(tmp_path / "attributes.h5", "r") as handle:
        yield handle


def test_a_scalar_attribute_of_the_kind_asked_for_is_read(attributes):
    assert scalar_attribute(attributes, "format_version", INTEGER, WHERE, REMEDY) == 5
    assert scalar_attribute(attributes, "blind_spots", STRING, WHERE, REMEDY) == b'{"layers.0": "compiled"}'
    assert scalar_attribute(attributes, "fixed", STRING, WHERE, REMEDY) == b"fixed width"
    assert scalar_attribute(attributes, "format_version", STRING + INTEGER, WHERE, REMEDY) == 5
    assert scalar_attribute(attributes["values"], "meta", STRING, WHERE, REMEDY) == b"{}"  # a dataset's
    assert scalar_attribute(attributes["values"].id, "meta", STRING, WHERE, REMEDY) == b"{}"  # its low-level id
    assert scalar_attribute(attributes, "absent", STRING, WHERE, REMEDY) is None


@pytest.mark.parametrize("name, kinds, what", [
    ("format_version", STRING, "an integer, not the one string"),
    ("blind_spots", INTEGER, "a string, not the one integer"),
    ("as_float", INTEGER, "a float, not the one integer"),
    ("as_array", INTEGER, "an integer of shape (2,), not the one integer"),
    ("as_float", STRING + INTEGER, "a float, not the one string or integer"),
], ids=["integer-for-string", "string-for-integer", "float", "array", "either"])
def test_an_attribute_of_another_kind_or_shape_is_refused_before_it_is_converted(attributes, name, kinds, what):
    with pytest.raises(TraceFormatError) as raised:
        scalar_attribute(attributes, name, kinds, WHERE, REMEDY)
    assert str(raised.value) == f"{WHERE}: attribute {name} is {what} ttrace writes: its header is damaged; {REMEDY}"


@pytest.mark.parametrize("name, array, expected", [
    ("bfloat16", np.array([0x3F80, -0x4000], dtype=np.int16), torch.tensor([1.0, -2.0], dtype=torch.bfloat16)),
    ("float8_e4m3fn", np.array([0x38, 0xC0], dtype=np.uint8), torch.tensor([1.0, -2.0], dtype=torch.float8_e4m3fn)),
    ("float32", np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32, order="F"), torch.tensor([[1.0, 2.0], [3.0, 4.0]])),
    ("bool", np.array([True, False]), torch.tensor([True, False])),
], ids=["bf16-bits", "fp8-bits", "fortran-order", "bool"])
def test_a_stored_array_becomes_the_tensor_of_its_recorded_dtype(name, array, expected):
    tensor = tensor_from_array(array, name, WHERE)
    assert tensor.dtype == expected.dtype and tensor.is_contiguous()
    assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))


def test_an_unknown_dtype_names_the_trace_as_another_versions():
    with pytest.raises(TraceFormatError) as raised:
        tensor_from_array(np.zeros(2, dtype=np.complex64), "complex64", WHERE)
    assert str(raised.value) == f"{WHERE}: unknown dtype 'complex64' in the trace; it was written by another ttrace version"
