"""Format 5's packs (ttrace_core/format/packs.py): a step's values in a few contiguous byte datasets, each
tensor a span that its index row names. What is written reads back whole, by one pread per tensor after
the open (no HDF5 call), a region by its bytes alone; every lie about a span or a pack is refused when
the file is opened, in one line, before anything is allocated or read."""

from __future__ import annotations

import math
import os
import re

import h5py
import numpy as np
import pytest
import torch

from tests.faults.meta_rows import add_pack, index_rows, write_index_rows
from ttrace_core.errors import TraceFormatError
from ttrace_core.format import packs
from ttrace_core.format.reader import RunReader, step_file_name
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.step_file import open_step
from ttrace_core.format.writer import RunWriter, write_manifest

STEP_FILE = step_file_name(0, 0)
REMEDY = "re-record rank 0 (or copy its file again)"


def _key(fqn: str) -> TensorKey:
    return TensorKey(step=0, micro_batch=0, phase="forward", fqn=fqn, slot="output.0")


def _meta(fqn: str, value: torch.Tensor, seq: int) -> TensorMeta:
    return TensorMeta(key=_key(fqn), rank=0, dtype=str(value.dtype).removeprefix("torch."), local_shape=tuple(value.shape),
                      layout=Layout.replicated(tuple(value.shape)), seq=seq)


VALUES = {"small": torch.arange(6, dtype=torch.float32).view(2, 3), "bf16": torch.randn(3, 5).to(torch.bfloat16),
          "empty": torch.zeros(0, 4), "large": torch.randn(3, 512, 256), "ints": torch.arange(7)}
"""A gathered tensor, raw bits, no bytes at all, a pack of its own (1.5 MiB), and integers."""


def _written(run_dir, values: dict[str, torch.Tensor] = VALUES) -> None:
    write_manifest(run_dir, RunManifest(role="reference", world_size=1))
    writer = RunWriter(run_dir, 0)
    writer.begin_step(0)
    for seq, (fqn, value) in enumerate(values.items()):
        writer.write(_meta(fqn, value, seq), value)
    writer.end_step()


def _rows(run_dir) -> list[dict]:
    with h5py.File(run_dir / STEP_FILE) as handle:
        return index_rows(handle)


def _rewrite_rows(run_dir, edit) -> None:
    with h5py.File(run_dir / STEP_FILE, "r+") as handle:
        rows = index_rows(handle)
        edit(rows)
        write_index_rows(handle, rows)


def _refusal(run_dir) -> str:
    with pytest.raises(TraceFormatError) as raised:
        RunReader(run_dir).close()
    return str(raised.value)


def test_each_tensor_is_a_span_of_a_pack_and_reads_back_bit_exactly(tmp_path):
    _written(tmp_path)
    rows = {row["meta"]["key"]["fqn"]: row for row in _rows(tmp_path)}
    assert rows["large"]["offset"] == 0 and rows["large"]["pack"] != rows["small"]["pack"]  # a pack of its own
    assert rows["small"]["pack"] == rows["bf16"]["pack"] == rows["ints"]["pack"]  # gathered, each at a cache line
    assert [rows[name]["offset"] % packs.ALIGN for name in ("small", "bf16", "ints")] == [0, 0, 0]
    with RunReader(tmp_path) as reader:
        for fqn, value in VALUES.items():
            read = reader.read(reader.index[_key(fqn)][0])
            assert read.dtype == value.dtype and torch.equal(read.reshape(-1).view(torch.uint8),
                                                            value.reshape(-1).view(torch.uint8)), fqn
    with h5py.File(tmp_path / STEP_FILE) as handle:  # h5py alone reads a tensor from its row
        row = rows["bf16"]
        raw = handle[f"packs/{row['pack']}"][row["offset"]:row["offset"] + 30]
        assert torch.equal(torch.from_numpy(raw.view(np.int16).reshape(3, 5)).view(torch.bfloat16), VALUES["bf16"])


def test_small_tensors_fill_several_packs_when_one_is_full(tmp_path, monkeypatch):
    monkeypatch.setattr("ttrace_core.format.writer.PACK_BYTES", 256)
    values = {f"m{index}": torch.full((20,), float(index)) for index in range(9)}  # 80 bytes each: 2 per pack
    _written(tmp_path, values)
    assert [(row["pack"], row["offset"]) for row in _rows(tmp_path)] == \
        [(0, 0), (0, 128), (1, 0), (1, 128), (2, 0), (2, 128), (3, 0), (3, 128), (4, 0)]
    with RunReader(tmp_path) as reader:
        assert [float(reader.read(reader.index[_key(fqn)][0])[0]) for fqn in values] == [float(i) for i in range(9)]


def test_after_the_open_a_read_is_one_pread_and_no_hdf5_call(tmp_path, monkeypatch):
    _written(tmp_path)
    with open_step(tmp_path, 0, 0) as step_file:
        assert step_file._handle is None  # HDF5 is done with the file once it is checked
        for name in ("open", "create"):
            monkeypatch.setattr(h5py.h5d, name, lambda *args, **kwargs: pytest.fail("an HDF5 dataset was opened"))
        reads = []
        real_preadv = os.preadv
        monkeypatch.setattr(os, "preadv", lambda *args: reads.append(args) or real_preadv(*args))
        (meta,) = [m for m in step_file.metas if m.key.fqn == "large"]
        assert torch.equal(step_file.read(meta), VALUES["large"]) and len(reads) == 1


def test_many_small_tensors_read_together_cost_one_pread_and_equal_reading_each(tmp_path, monkeypatch):
    values = {f"m{index}": torch.randn(3, 7 + index).to(torch.bfloat16 if index % 3 == 0 else torch.float32)
              for index in range(40)}
    values["large"] = VALUES["large"]  # a pack of its own, next to the gathered one in the file
    _written(tmp_path, values)
    reads = []
    real_preadv = os.preadv
    with RunReader(tmp_path) as reader:
        metas = [reader.index[_key(fqn)][0] for fqn in reversed(values)]  # the order asked for, not the file's
        alone = [reader.read(meta) for meta in metas]
        monkeypatch.setattr(os, "preadv", lambda *args: reads.append(args) or real_preadv(*args))
        buffer, offsets = reader.read_raw(metas)
    assert len(reads) == 1  # the 40 gathered tensors and the pack after them: one run of 1.6 MB
    for meta, one, offset in zip(metas, alone, offsets):
        raw = one.reshape(-1).view(torch.uint8).numpy()
        assert offset % 8 == 0 and bytes(buffer[offset:offset + raw.size]) == raw.tobytes(), meta.key.fqn


def _read_spans(descriptor: int, spans: list) -> list:
    """Each span's bytes, read a run at a time as RunReader.read_raw reads them; None for a run not read whole."""
    found = [None] * len(spans)
    for first, nbytes, indices in packs.coalesced_runs(spans):
        run = np.empty(nbytes, dtype=np.uint8)
        if packs.read_run(descriptor, run, first):
            for index in indices:
                found[index] = run[spans[index][0] - first:spans[index][0] - first + spans[index][1]]
    return found


def test_spans_far_apart_or_past_the_run_size_are_read_apart(monkeypatch, tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 1024)
    spans = [(0, 64), (64, 64), (64 + 64 + packs.RUN_GAP + 8, 8), (200_000, 100), (200_104, 100)]
    monkeypatch.setattr(packs, "RUN_BYTES", 128)  # the last two: together past the run size
    descriptor = os.open(path, os.O_RDONLY)
    reads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *args: reads.append(args) or real_preadv(*args))
    try:
        found = _read_spans(descriptor, spans)
    finally:
        os.close(descriptor)
    data = path.read_bytes()
    assert [bytes(view) for view in found] == [data[start:start + size] for start, size in spans]
    assert len(reads) == 4  # (0 and 64 together), the one past the gap, and the last two apart


def test_spans_past_the_end_of_the_file_read_as_none(tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(100))
    descriptor = os.open(path, os.O_RDONLY)
    try:
        assert _read_spans(descriptor, [(0, 32), (64, 64)]) == [None, None]  # one run, not whole
    finally:
        os.close(descriptor)


def test_shards_a_truncated_file_cannot_give_are_not_read_and_the_others_are(tmp_path, monkeypatch):
    _written(tmp_path)
    monkeypatch.setattr(packs, "RUN_BYTES", 2**20)  # the large pack (1.5 MiB) a run of its own
    with RunReader(tmp_path) as reader:
        metas = [reader.index[_key(fqn)][0] for fqn in ("small", "large")]
        spans = reader._files[(0, 0)].spans_of(metas)
        later = max(range(2), key=lambda index: spans[index][0])
        os.truncate(tmp_path / STEP_FILE, spans[later][0] + 8)  # inside the later one's bytes
        buffer, offsets = reader.read_raw(metas)
        earlier = 1 - later
        raw = reader.read(metas[earlier]).reshape(-1).view(torch.uint8).numpy()
        assert offsets[later] is None and bytes(buffer[offsets[earlier]:offsets[earlier] + raw.size]) == raw.tobytes()
        with pytest.raises(TraceFormatError, match="was truncated after it was opened"):
            reader.read(metas[later])  # (read alone, it is worded)


@pytest.mark.parametrize("region", [(slice(1, 3),), (slice(0, 2), slice(100, 300)), (slice(2, 3), slice(511, 512)),
                                    (slice(1, 1),), (slice(1, 3), slice(7, 300), slice(5, 9))],
                         ids=["dim 0", "dims 0 and 1", "last row", "empty", "dims 0, 1 and 2"])
def test_a_region_reads_only_its_bytes_and_equals_the_slice(tmp_path, region):
    _written(tmp_path)
    with RunReader(tmp_path) as reader:
        assert torch.equal(reader.read(reader.index[_key("large")][0], region), VALUES["large"][region])


@pytest.mark.parametrize("width, columns, together", [(2048, slice(0, 1024), True), (2048, slice(512, 513), True),
                                                       (9000, slice(0, 4000), False)],
                         ids=["half the columns", "one column", "runs over RUN_GAP apart, read each alone"])
def test_a_slab_of_columns_costs_a_preadv_per_hundreds_of_rows(tmp_path, monkeypatch, width, columns, together):
    """A slab cut along an inner dim (bounded.py, a row-sharded weight) is a run of bytes per row; the runs a
    few KiB apart are read together, a few MiB at a time, the bytes between them dropped."""
    wide = torch.randn(1200, width)
    _written(tmp_path, {"wide": wide})
    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *args: calls.append(args) or real_preadv(*args))
    with RunReader(tmp_path) as reader:
        calls.clear()  # (opening reads too)
        for rows in (slice(None), slice(7, 1100)):
            assert torch.equal(reader.read(reader.index[_key("wide")][0], (rows, columns)), wide[rows, columns])
    per_call = packs.RUN_BYTES // (width * 4) if together else 1  # rows a pread reads, with the bytes between them
    assert len(calls) == sum(math.ceil(rows / per_call) for rows in (1200, 1093)), len(calls)


def test_a_slab_of_columns_of_a_file_truncated_after_it_was_opened_is_one_line(tmp_path):
    _written(tmp_path, {"wide": torch.randn(1200, 2048)})
    with RunReader(tmp_path) as reader:
        meta = reader.index[_key("wide")][0]
        span = reader._files[(0, 0)].spans_of([meta])[0]
        os.truncate(tmp_path / STEP_FILE, span[0] + span[1] // 2)
        with pytest.raises(TraceFormatError, match="was truncated after it was opened; " + re.escape(REMEDY)):
            reader.read(meta, (slice(None), slice(100, 200)))


def test_a_file_truncated_after_it_was_opened_is_one_line(tmp_path):
    _written(tmp_path)
    with RunReader(tmp_path) as reader:
        os.truncate(tmp_path / STEP_FILE, 4096)
        with pytest.raises(TraceFormatError) as raised:
            reader.read(reader.index[_key("large")][0])
    assert "was truncated after it was opened; " + REMEDY in str(raised.value)
    assert str(raised.value).startswith(f"{tmp_path}/{STEP_FILE}:forward/mb_0000/large#output.0: the file ends ")


def _set_row(fqn: str, **fields):
    def edit(rows: list[dict]) -> None:
        row = next(row for row in rows if row["meta"]["key"]["fqn"] == fqn)
        for name, value in fields.items():
            (row["meta"] if name == "local_shape" else row)[name] = value
    return edit


def test_a_row_lying_about_its_size_is_refused_on_open(tmp_path):
    _written(tmp_path)
    (pack,) = {row["pack"] for row in _rows(tmp_path) if row["meta"]["key"]["fqn"] == "ints"}
    _rewrite_rows(tmp_path, _set_row("ints", local_shape=[2**20, 2**20]))
    with h5py.File(tmp_path / STEP_FILE) as handle:
        size = handle[f"packs/{pack}"].shape[0]
    offset = next(row["offset"] for row in _rows(tmp_path) if row["meta"]["key"]["fqn"] == "ints")
    assert _refusal(tmp_path) == (
        f"{tmp_path}/{STEP_FILE}:forward/mb_0000/ints#output.0: its index row places 8796093022208 bytes (shape "
        f"(1048576, 1048576) of int64) at byte {offset} of packs/{pack}, which holds {size}: the index or the pack is "
        f"damaged; {REMEDY}")


@pytest.mark.parametrize("edit, line", [
    (_set_row("bf16", offset=8), "two rows of its tensor index name overlapping bytes of packs/{pack} (at 8, before 24): "
                                 "the index is damaged; " + REMEDY),
    (_set_row("bf16", pack=None), "the index row of forward/mb_0000/bf16#output.0 names no pack and offset, which every "
                                  "tensor with values has in format 5: the index is damaged; " + REMEDY),
    (lambda rows: rows.append(dict(rows[0])), "the tensor index lists forward/mb_0000/small#output.0 twice; its index "
                                              "is damaged, re-record this rank"),
], ids=["overlapping", "no pack", "listed twice"])
def test_an_index_lying_about_its_spans_is_refused_on_open(tmp_path, edit, line):
    _written(tmp_path)
    pack = _rows(tmp_path)[0]["pack"]
    _rewrite_rows(tmp_path, edit)
    assert _refusal(tmp_path) == f"{tmp_path}/{STEP_FILE}: " + line.format(pack=pack)


def test_lost_rows_and_lost_packs_are_inventory_gaps(tmp_path):
    _written(tmp_path)
    rows = _rows(tmp_path)
    large = next(row for row in rows if row["meta"]["key"]["fqn"] == "large")
    _rewrite_rows(tmp_path, lambda rows: rows.remove(next(row for row in rows if row["meta"]["key"]["fqn"] == "bf16")))
    with h5py.File(tmp_path / STEP_FILE, "r+") as handle:
        del handle[f"packs/{large['pack']}"]
    with RunReader(tmp_path) as reader:
        assert sorted(key.fqn for key in reader.index) == ["empty", "ints", "small"]
        assert reader.inventory_gaps == [
            f"{STEP_FILE}: its tensor index lists forward/mb_0000/large#output.0, whose pack the file does not hold",
            # bf16's 30 bytes and the padding before them (the empty tensor sits where bf16 ended)
            f"{STEP_FILE}: packs/{rows[0]['pack']} holds 70 bytes no index row names (tensors whose index rows were lost)",
            f"{STEP_FILE} holds 4 tensors, its writer recorded 5"]


def _replace_pack(run_dir, make) -> str:
    """Pack of "small" replaced by make(handle, name); its name."""
    with h5py.File(run_dir / STEP_FILE, "r+") as handle:
        name = f"packs/{index_rows(handle)[0]['pack']}"
        values = handle[name][()]
        del handle[name]
        make(handle, name, values)
    return name


PACK_DAMAGE = [
    (lambda h, n, v: h.create_dataset(n, shape=v.shape, dtype=np.uint8, chunks=(64,), compression="gzip"), "{name}: "
     "declares shape {shape} of |u1 in {chunks} chunks but the file holds 0 of them (a damaged header, or values never "
     "written); " + REMEDY),
    (lambda h, n, v: h.create_dataset(n, data=v, scaleoffset=0), "{name}: stored through HDF5 filter 6 (scaleoffset), "
     "not one of the lossless filters built into HDF5 and h5py (gzip, shuffle, fletcher32, szip, lzf): ttrace loads no "
     "filter plugin and reads no lossy filter (rewrite the file without it: h5repack -f NONE); " + REMEDY),
    (lambda h, n, v: h.create_dataset(n, data=v.astype(np.int8)), "{name}: its stored datatype reads as |i1 (int8) but "
     "its metadata says |u1 (uint8): the datatype message is damaged; " + REMEDY),
    (lambda h, n, v: h.create_dataset(n, data=np.resize(v, (2, v.size))), "{name}: stored shape {shape2}, ttrace writes "
     "a pack as one row of bytes; " + REMEDY),
    (lambda h, n, v: h.create_dataset(n, shape=(2**40,), dtype=np.uint8), "{name}: declares shape (1099511627776,) of "
     "|u1 (1099511627776 bytes) but the file holds 0 bytes of storage for it (a damaged header, or values never "
     "written); " + REMEDY),
    (lambda h, n, v: h.create_group(n), "{name}: is an HDF5 group where ttrace writes a dataset (written by another "
     "tool, or damaged); re-record this rank"),
]


@pytest.mark.parametrize("make, line", PACK_DAMAGE, ids=["compressed, chunks never written", "lossy filter", "int8",
                                                           "two-dimensional", "2**40 bytes never written", "a group"])
def test_a_pack_ttrace_would_not_write_is_refused_on_open(tmp_path, make, line):
    _written(tmp_path)
    name = _replace_pack(tmp_path, make)
    with h5py.File(tmp_path / STEP_FILE) as handle:
        shape2 = handle[name].shape if isinstance(handle[name], h5py.Dataset) else None
        chunks = -(-shape2[0] // 64) if shape2 else None
    assert _refusal(tmp_path) == f"{tmp_path}/{STEP_FILE}:" + line.format(name=name, shape2=shape2, shape=shape2,
                                                                           chunks=chunks)


REWRITES = {"chunked": {"chunks": (64,)}, "gzip, shuffle, checksums": {"compression": "gzip", "shuffle": True,
                                                                         "fletcher32": True},
            "lzf": {"compression": "lzf"}}


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("storage", REWRITES.values(), ids=REWRITES.keys())
def test_packs_another_tool_rewrote_chunked_or_compressed_read_as_written(tmp_path, storage):
    """An archived trace whose packs another tool rewrote (h5repack -f GZIP=6, -l CHUNK=...) has no bytes in place to
    pread: its packs are copied out once, into an unnamed temporary file closed with the reader, and every tensor, a
    run of them and a region read bit for bit as ttrace wrote them."""
    _written(tmp_path)
    with RunReader(tmp_path) as reader:
        written = {fqn: reader.read(reader.index[_key(fqn)][0]) for fqn in VALUES}
    with h5py.File(tmp_path / STEP_FILE, "r+") as handle:
        for name in list(handle["packs"]):
            values = handle[f"packs/{name}"][()]
            del handle[f"packs/{name}"]
            handle.create_dataset(f"packs/{name}", data=values, **storage)
    before = _open_descriptors()
    with RunReader(tmp_path) as reader:
        for fqn, value in written.items():
            read = reader.read(reader.index[_key(fqn)][0])
            assert read.dtype == value.dtype and torch.equal(read.reshape(-1).view(torch.uint8),
                                                            value.reshape(-1).view(torch.uint8)), fqn
        metas = [reader.index[_key(fqn)][0] for fqn in VALUES]
        buffer, offsets = reader.read_raw(metas)
        for fqn, offset in zip(VALUES, offsets):
            raw = written[fqn].reshape(-1).view(torch.uint8).numpy()
            assert offset is not None and bytes(buffer[offset:offset + raw.size]) == raw.tobytes(), fqn
        region = reader.read(reader.index[_key("large")][0], (slice(1, 2),))
        assert torch.equal(region, written["large"][1:2])
        assert len(_open_descriptors() - before) == 1  # the copy of the packs, and nothing of it has a name
    assert _open_descriptors() == before


@pytest.mark.parametrize("link, kind", [(lambda: h5py.SoftLink("/tensor_index"), "a soft"),
                                        (lambda: h5py.ExternalLink("/etc/hostname", "x"), "an external")],
                         ids=["soft", "external"])
def test_a_link_in_place_of_a_pack_is_refused_on_open(tmp_path, link, kind):
    _written(tmp_path)
    name = _replace_pack(tmp_path, lambda handle, name, values: handle.__setitem__(name, link()))
    assert _refusal(tmp_path) == (f"{tmp_path}/{STEP_FILE}: {name} is {kind} link; ttrace writes only hard links inside "
                                  "a step file and reads nothing outside the trace, re-record this rank")


def test_an_object_a_format_5_file_never_holds_is_refused_on_open(tmp_path):
    """A dataset per tensor, as format 4 kept them, beside the packs: not what this file's format writes."""
    _written(tmp_path)
    with h5py.File(tmp_path / STEP_FILE, "r+") as handle:
        handle["forward/mb_0000/small#output.0"] = VALUES["small"].numpy()
    assert _refusal(tmp_path) == (f"{tmp_path}/{STEP_FILE}: forward is not an object a format-5 step file holds (its "
                                  "tensors live in packs); the file was not written by ttrace or is damaged, re-record "
                                  "this rank")


def test_a_pack_added_beside_the_others_is_named_when_no_row_names_it(tmp_path):
    _written(tmp_path)
    with h5py.File(tmp_path / STEP_FILE, "r+") as handle:
        number, _ = add_pack(handle, np.ones(100, dtype=np.uint8))
    with RunReader(tmp_path) as reader:
        assert reader.inventory_gaps == [f"{STEP_FILE}: packs/{number} holds 100 bytes no index row names (tensors "
                                         "whose index rows were lost)"]
