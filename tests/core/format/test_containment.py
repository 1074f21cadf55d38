"""Nothing outside a trace directory is ever read (ttrace_core/format/containment.py).

Each case plants, in a copy of a recorded sample candidate, a way out of the directory that leads to
an exact copy of the data it replaces, so following it would pass (tests/faults/corruptions.py,
the robustness benchmark's own plants). The copy lives on tmpfs (/dev/shm, relatime) with its access
time set before its modification time: any read would move it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import h5py
import pytest

from tests.cli_support import run_main
from tests.faults import corruptions
from tests.faults.meta_rows import is_packed, storage_of
from ttrace_core.format.reader import step_file_name
from tests.support.paths import SAMPLES_DIR


SAMPLES = SAMPLES_DIR / "fp32"
DATASET = "forward/mb_0000/decoder.layers.0.self_attention.linear_qkv#output.0"
VALUE_PLANTS = (corruptions.virtual_dataset, corruptions.external_storage)
"""Ways out planted in one tensor's storage: format 5 refuses them when it opens the file (its packs are
checked then), format 4 when it reads the tensor's values (compare; `inspect` reads none)."""


@pytest.mark.parametrize("plant", list(corruptions.PLANTS.values()), ids=list(corruptions.PLANTS))
def test_a_way_out_of_the_trace_is_refused_and_never_followed(tmp_path, capsys, plant):
    reference, candidate = tmp_path / "reference", tmp_path / "candidate"
    shutil.copytree(SAMPLES / "reference", reference)
    shutil.copytree(SAMPLES / "tp2_sp_clean", candidate)
    outside = corruptions.outside_of(candidate)
    outside.mkdir(parents=True, exist_ok=True)
    try:
        with h5py.File(candidate / step_file_name(0, 0), "r") as handle:
            packed, storage = is_packed(handle), storage_of(handle, DATASET)  # format 5: the pack holding its bytes
        target, message = plant(outside, candidate / step_file_name(0, 0), storage)
        if target is not None:
            corruptions.untouched(target)
        for argv in (["compare", str(reference), str(candidate)], ["inspect", str(candidate)]):
            code, _, err = run_main(argv, capsys)
            if argv[0] == "inspect" and plant in VALUE_PLANTS and not packed:
                assert code == 0 and err == "", err  # it reads the tensor index (format 4), no tensor's values
                continue
            (line,) = err.strip().splitlines()
            assert code == 2 and message in line and str(candidate) in line, (argv[0], line)
        if target is not None:
            assert not corruptions.was_read(target), f"{target} was read"
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_a_symlink_inside_the_run_directory_is_still_read(tmp_path):
    """Containment refuses ways *out*; a link between files of the same run is the run's own data."""
    from ttrace_core.format.reader import read_manifest

    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "tp2_sp_clean", run)
    (run / "manifest.json").rename(run / "manifest.kept.json")
    (run / "manifest.json").symlink_to(run / "manifest.kept.json")
    assert read_manifest(run).world_size == json.loads((run / "manifest.kept.json").read_text())["world_size"] == 2


SPECIAL_FILES = {
    "FIFO": (os.mkfifo, "a FIFO (named pipe), not a regular file"),
    "directory": (Path.mkdir, "a directory, not a regular file"),
    "link to /dev/null, inside the run": (lambda path: path.symlink_to("null"), "a character device, not a regular file"),
    "symlink to itself": (lambda path: path.symlink_to(path.name), "a symlink loop (it leads back to itself"),
    "dangling symlink": (lambda path: path.symlink_to("gone.json"), "a symlink to gone.json, which does not exist"),
}


@pytest.mark.parametrize("make, message", list(SPECIAL_FILES.values()), ids=list(SPECIAL_FILES))
def test_only_regular_files_are_opened(tmp_path, make, message):
    """`contained` looks (os.stat) before anything opens the file: a FIFO would block its reader, a
    device read without end, a loop never resolve."""
    from ttrace_core.errors import TraceFormatError
    from ttrace_core.format.containment import contained

    (tmp_path / "null").symlink_to("/dev/null")
    make(tmp_path / "manifest.json")
    with pytest.raises(TraceFormatError, match=f"manifest.json: {re.escape(message)}.*copy the recorded file here again"):
        contained(tmp_path, "manifest.json")


@pytest.mark.parametrize("name", ["tensor_index", "findings"])
@pytest.mark.parametrize("partial", [False, True], ids=["complete", "partial"])
def test_a_group_where_a_step_files_dataset_belongs_is_one_line(tmp_path, capsys, name, partial):
    """An HDF5 group where ttrace writes the tensor index or the findings (another tool's file): one line
    naming the file and the object, exit 2, never h5py's AttributeError ('PropGCID' has no get_layout);
    in a `.partial` step file the reader absorbs it like the file's other errors (issue 42, defect 7)."""
    from tests.faults.misplaced_objects import group_in_place_of, left_partial
    from tests.synthetic_runs import write_pair

    reference, candidate = write_pair(tmp_path)
    step_file = candidate / step_file_name(1, 0)
    group_in_place_of(step_file, name)
    if partial:
        left_partial(step_file)
    code, _, err = run_main(["inspect", str(candidate)], capsys)
    if partial:
        assert code == 0 and err == "", err
        return
    assert (code, err.strip()) == (2, f"ttrace: error: {step_file}:{name}: is an HDF5 group where ttrace writes a "
                                      "dataset (written by another tool, or damaged); re-record this rank")
