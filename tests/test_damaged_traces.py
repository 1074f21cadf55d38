"""Damaged traces from elsewhere, one per way a new user met a traceback or a hang: each is answered
by `ttrace inspect` or `ttrace compare` in a subprocess with a time limit (a hang fails the test, it
does not stall the suite) with the exact line or finding, and never a traceback.

The damage is applied to a copy of the robustness benchmark's base pair (conftest.robustness_base)
with the benchmark's own tools (tests/faults/byte_damage.py, size_lies.py, meta_rows.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import h5py
import pytest

from tests.conftest import run_ttrace
from tests.faults import byte_damage, size_lies
from tests.faults.meta_rows import index_rows, write_format4_copy, write_legacy_copy
from ttrace_core.format.tensor_index import TENSOR_INDEX


pytestmark = pytest.mark.slow  # every test damages a copy of the robustness base (a megatron-core pair, minutes)
TIME_LIMIT_S = 120
"""Seconds one command may take: a clean compare of this pair takes about 3 (imports included)."""
STEP_FILE = "rank_00000.step_000000.h5"
FLOAT32_DATASET = "param/all/decoder.final_layernorm.weight#value"
"""Float32, and whole (replicated) in both runs: a lie told by all its shards leaves their shapes agreeing."""


@pytest.fixture
def pair(robustness_base, tmp_path) -> tuple[Path, Path]:
    reference, candidate = tmp_path / "reference", tmp_path / "candidate"
    shutil.copytree(robustness_base[0], reference)
    shutil.copytree(robustness_base[1], candidate)
    return reference, candidate


def _answer(*args: str) -> subprocess.CompletedProcess:
    result = run_ttrace(*args, timeout=TIME_LIMIT_S)
    assert "Traceback" not in result.stderr and result.returncode != 3, result.stderr
    return result


def _error_line(*args: str) -> str:
    """The one line a refused input gives (exit 2)."""
    result = _answer(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
    return lines[0]


def _finding_row(reference: Path, candidate: Path, dataset: str) -> dict:
    """The comparison row of `dataset`'s tensor when compare answers with a finding (exit 1)."""
    result = _answer("compare", str(reference), str(candidate), "--json", "-")
    assert result.returncode == 1, result.stderr
    rows = [row for row in json.loads(result.stdout)["comparisons"] if row["status"] not in ("pass",)]
    fqn, slot = dataset.split("/")[-1].split("#")
    return next(row for row in rows if row["key"]["fqn"] == fqn and row["key"]["slot"] == slot)


def test_zeroed_bytes_on_the_global_heap_are_one_line(pair):
    reference, candidate = pair
    path = candidate / STEP_FILE
    with open(path, "r+b") as handle:
        for start, _ in byte_damage.structures_of(path).heaps:  # every collection: the first string read fails
            handle.seek(start)
            handle.write(bytes(16))
    expected = (f"ttrace: error: {path}: attribute blind_spots: cannot be read, the file is damaged (Can't "
                "synchronously read data (bad global heap collection signature)); re-record rank 0 (or copy its "
                "file again)")
    assert _error_line("inspect", str(candidate)) == expected
    assert _error_line("compare", str(reference), str(candidate)) == expected


def test_a_zeroed_heap_object_that_would_hang_hdf5_is_refused_first(pair):
    """Zeros past a collection's signature leave an object of size 0, on which HDF5's own reader loops forever."""
    reference, candidate = pair
    path = candidate / STEP_FILE
    start, _ = byte_damage.structures_of(path).heaps[0]
    with open(path, "r+b") as handle:
        handle.seek(start + 16)
        handle.write(bytes(16))
    expected = (f"ttrace: error: {path}: the global heap collection at byte {start} holds an object of size 0 at byte "
                f"{start + 16}; HDF5 would never finish reading it, so the file is refused: re-record rank 0 (or copy "
                "its file again)")
    assert _error_line("inspect", str(candidate)) == expected
    assert _error_line("compare", str(reference), str(candidate)) == expected


def _as_format_4(run: Path, tmp_path: Path) -> None:
    """`run`'s step files rewritten in place as format 4 wrote them (a dataset per tensor), which is still read."""
    write_format4_copy(run, tmp_path / "format4")
    for copy in (tmp_path / "format4").iterdir():
        shutil.copy(copy, run / copy.name)


def test_a_flipped_bit_in_a_datatype_message_is_one_line(pair, tmp_path):
    """Bit 2 of the exponent bias's second byte: HDF5 still reads a float of 32 bits, which no numpy
    type matches but its 128-bit longdouble (torch cannot take it). Format 5 keeps values in uint8 packs
    (a flip there is refused when the file is opened, tests/core/format/test_packs.py): the candidate is rewritten
    as format 4 wrote it, a dataset per tensor."""
    reference, candidate = pair
    _as_format_4(candidate, tmp_path)
    path = candidate / STEP_FILE
    start, _ = byte_damage.message_of(path, FLOAT32_DATASET, "datatype")
    byte_damage.flip_bit(path, start + 17, 2)
    assert _error_line("compare", str(reference), str(candidate)) == (
        f"ttrace: error: {path}:{FLOAT32_DATASET}: its stored datatype reads as <f16 (float128) but its metadata says "
        "<f4 (float32): the datatype message is damaged; re-record rank 0 (or copy its file again)")
    assert _answer("inspect", str(candidate)).returncode == 0  # inspect reads metadata only


def test_a_flipped_bit_that_makes_meta_a_sequence_is_one_line_not_a_segfault(pair, tmp_path):
    """Bit 0 of the vlen type in the `meta` attribute's datatype: a string becomes a sequence of its
    base type, whose conversion crashed h5py (SIGSEGV, no traceback: found by the benchmark). Format 4
    has no such attribute: the candidate is rewritten as format 3 wrote it, which is still read."""
    reference, candidate = pair
    write_legacy_copy(candidate, tmp_path / "format3")
    for legacy in (tmp_path / "format3").iterdir():
        shutil.copy(legacy, candidate / legacy.name)
    path = candidate / STEP_FILE
    start, _ = byte_damage.message_of(path, FLOAT32_DATASET, "attribute")
    byte_damage.flip_bit(path, start + 17, 0)  # after the message's 8 bytes and the name "meta" padded to 8: class, then type
    expected = (f"ttrace: error: {path}:{FLOAT32_DATASET}: attribute meta is a variable-length sequence, not the one "
                "string ttrace writes: its header is damaged; re-record this rank")
    assert _error_line("inspect", str(candidate)) == expected
    assert _error_line("compare", str(reference), str(candidate)) == expected


def test_a_flipped_bit_in_the_tensor_index_datatype_is_one_line(pair):
    """The signed bit of the index's uint8 datatype: it reads as int8, refused before it is decoded."""
    reference, candidate = pair
    path = candidate / STEP_FILE
    start, _ = byte_damage.message_of(path, TENSOR_INDEX, "datatype")
    byte_damage.flip_bit(path, start + 1, 3)  # the class bit field's first byte: bit 3 is "signed"
    expected = (f"ttrace: error: {path}:{TENSOR_INDEX}: its stored datatype reads as |i1 (int8) but its metadata says "
                "|u1 (uint8): the datatype message is damaged; re-record this rank")
    assert _error_line("inspect", str(candidate)) == expected
    assert _error_line("compare", str(reference), str(candidate)) == expected


ENORMOUS = {
    "2**40-element dataset over unallocated storage": size_lies.UNALLOCATED["2**40 elements, contiguous, never written"],
    "flat range in a block of 10**12 elements": size_lies.HUGE_METADATA["flat range in a block of 10**12"],
    "Partial tensor over a mesh of 10**9 ranks": size_lies.HUGE_METADATA["Partial over 10**9 ranks"],
}
ENORMOUS_ANSWERS = {
    # format 5: the tensor's row names a pack of 2**42 bytes, refused when the file is opened (the reference first)
    "2**40-element dataset over unallocated storage": (
        "ttrace: error: {reference}/" + STEP_FILE + ":packs/{pack}: declares shape (4398046511104,) of "
        "|u1 (4398046511104 bytes) but the file holds 0 bytes of storage for it (a damaged header, or values never "
        "written); re-record rank 0 (or copy its file again)"),
    "flat range in a block of 10**12 elements": (
        "step 0 / param / decoder.final_layernorm.weight / value: no rank holds flat element 32 of block "
        "((0, 1000000000000),); ranks present: [0, 1]. Re-record with every rank (if every rank is there, its "
        "metadata is damaged)"),
    "Partial tensor over a mesh of 10**9 ranks": (
        "step 0 / param / decoder.final_layernorm.weight / value: no rank holds mesh coordinate (2,) (non-replicated "
        "axes) of mesh (1000000000,) with placements ('P(sum)',); ranks present: [0, 1]. Re-record with every rank, "
        "or check that no rank file is missing"),
}


@pytest.mark.parametrize("lie", list(ENORMOUS), ids=list(ENORMOUS))
def test_metadata_claiming_enormous_sizes_is_refused_before_allocation(pair, lie):
    """Told by every shard of the tensor in both runs: exit 2 for its storage (a pack's is checked when its
    file is opened), a finding on the tensor's row for a layout (the rest of the run is judged)."""
    reference, candidate = pair
    size_lies.apply_everywhere(reference, candidate, FLOAT32_DATASET, ENORMOUS[lie])
    with h5py.File(reference / STEP_FILE) as handle:
        pack = next(row["pack"] for row in index_rows(handle) if row["dataset"] == FLOAT32_DATASET)
    expected = ENORMOUS_ANSWERS[lie].format(reference=reference, pack=pack)
    if expected.startswith("ttrace: error: "):
        assert _error_line("compare", str(reference), str(candidate)) == expected
    else:
        row = _finding_row(reference, candidate, FLOAT32_DATASET)
        assert (row["status"], row["message"]) == ("layout", expected)


def test_a_step_file_that_is_a_symlink_to_itself_is_one_line(pair):
    _, candidate = pair
    path = candidate / "rank_00001.step_000000.h5"
    path.unlink()
    path.symlink_to(path.name)
    assert _error_line("inspect", str(candidate)) == (
        f"ttrace: error: {path}: a symlink loop (it leads back to itself, never to a file); ttrace opens only regular "
        "files: copy the recorded file here again")


def test_a_fifo_in_place_of_a_step_file_is_refused_without_blocking(pair):
    _, candidate = pair
    path = candidate / "rank_00001.step_000000.h5"
    path.unlink()
    os.mkfifo(path)
    assert _error_line("inspect", str(candidate)) == (
        f"ttrace: error: {path}: a FIFO (named pipe), not a regular file; ttrace opens only regular files: copy the "
        "recorded file here again")


@pytest.mark.parametrize("kind, make", [("a directory", Path.mkdir), ("a FIFO (named pipe)", os.mkfifo)],
                         ids=["directory", "FIFO"])
def test_an_estimate_that_cannot_be_read_is_an_error_not_a_fallback(pair, kind, make):
    reference, candidate = pair
    path = reference / "tolerance_estimate.json"
    path.unlink()
    make(path)
    assert _error_line("compare", str(reference), str(candidate)) == (
        f"ttrace: error: {path}: {kind}, not a regular file; the tolerance estimate cannot be read, and an unreadable "
        f"estimate is never replaced by the dtype table in silence: delete it and run `ttrace estimate {reference}` again")


def test_the_dtype_table_judges_only_when_there_is_no_estimate_and_says_so(pair):
    reference, candidate = pair
    (reference / "tolerance_estimate.json").unlink()
    result = _answer("compare", str(reference), str(candidate), "--json", "-")
    sources = {row["tolerance"]["source"].split(" (")[0] for row in json.loads(result.stdout)["comparisons"]
               if row.get("tolerance") and row["key"]["phase"] != "step" and not row["key"]["slot"].startswith("scalar")}
    assert result.returncode == 0 and sources == {"dtype default"}, sources


@pytest.mark.parametrize("dataset", [TENSOR_INDEX, "findings"], ids=["tensor_index", "findings"])
@pytest.mark.parametrize("partial", [False, True], ids=["complete", "partial"])
def test_a_group_where_a_step_files_dataset_belongs_is_one_line(pair, dataset, partial):
    """Another tool's file with an HDF5 group in place of the tensor index or the findings: one line naming
    the file and the object (exit 2), never an AttributeError from h5py (exit 3); a partial step file's
    damage is absorbed like its other errors."""
    reference, candidate = pair
    path = candidate / STEP_FILE
    with h5py.File(path, "a") as handle:
        if dataset in handle:
            del handle[dataset]
        handle.create_group(dataset)
    if partial:
        path = path.rename(path.with_name(path.name + ".partial"))
        result = _answer("inspect", str(candidate))
        assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr
        return
    line = _error_line("inspect", str(candidate))
    assert line == (f"ttrace: error: {path}:{dataset}: is an HDF5 group where ttrace writes a dataset (written by "
                    "another tool, or damaged); re-record this rank")
    assert _error_line("compare", str(reference), str(candidate)) == line


RENAMED_KEYS = {
    # file, the key as written, its byte to flip and the bit: one flipped bit renames the key in place
    "index row's layout key": (STEP_FILE, b'"mesh_axis_names"', 13, 4),  # "mesh_axis_na}es": found by the benchmark
    "manifest key": ("manifest.json", b'"blind_spots"', 11, 2),  # "blind_spotw"
}


@pytest.mark.parametrize("damage", list(RENAMED_KEYS), ids=list(RENAMED_KEYS))
def test_a_key_renamed_by_a_flipped_bit_is_refused_not_dropped(pair, damage):
    """msgspec leaves out a key a dataclass record does not have: a layout whose "mesh_axis_names" was renamed
    read as a layout with no axis names, and compare passed every tensor. Every record refuses a key it does
    not have, so the damaged file is one line naming it and the key, never a silent pass."""
    reference, candidate = pair
    name, key, byte, bit = RENAMED_KEYS[damage]
    path = candidate / name
    at = path.read_bytes().find(key)
    assert at >= 0, f"{key!r} is not stored as plain bytes in {path}"
    byte_damage.flip_bit(path, at + byte, bit)
    renamed = bytes([key[byte] ^ (1 << bit)]).decode()
    line = _error_line("compare", str(reference), str(candidate))
    assert line.startswith(f"ttrace: error: {path}"), line
    assert f"Object contains unknown field `{(key[1:byte] + renamed.encode() + key[byte + 1:-1]).decode()}`" in line, line
