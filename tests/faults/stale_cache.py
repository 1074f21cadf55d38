"""A comparison cached before the data it judged changed, for the robustness cases (issue 42, defect 8).

`ttrace compare` keeps each pair's table under the candidate (`.ttrace/comparisons`) and reuses it while
its inputs are unchanged. Each case first compares the pristine pair (or a run the candidate is then
copied from), so that a table is cached, and then:

- rewrites a step file's values in place (x2, material) and sets its mtime back: its name, size and
  mtime are as before, only its ctime tells;
- replaces a step file by a rewritten copy moved over it (a new inode), with size and mtime kept;
- makes the candidate a copy (`cp -a`: mtimes kept, the cache copied along) of a run compared earlier,
  then rewrites a value as above (material), or leaves it as it is (not material: the verdict is right,
  but a table reused from the run it was copied from names directories the user did not pass, which
  damage_runner.py counts as an unclear error).

Used by damage_runner.py (the class "stale comparison cache") and, through it, benchmarks/robustness.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py

from tests.faults.corruptions import Corruption, datasets_of, step_files
from tests.faults.meta_rows import read_meta, tensor_values, write_tensor_values

KIND = "stale comparison cache"


def cache_comparison(reference: Path, candidate: Path) -> None:
    """The pair's comparison computed and cached under the candidate, as a first `ttrace compare` leaves it."""
    from ttrace_core import api

    api.comparison_table(reference, candidate)


def float_dataset(step_file: Path) -> str:
    """A float32 tensor's dataset of more than one element (doubling it is beyond any tolerance)."""
    with h5py.File(step_file, "r") as handle:
        return next(name for name in datasets_of(step_file)
                    if read_meta(handle, name).get("dtype") == "float32" and tensor_values(handle, name).size > 1
                    and float(abs(tensor_values(handle, name)).max()) > 0)


def doubled_in_place(step_file: Path) -> None:
    """One tensor's values doubled where they lie, the file's size and mtime set back as they were."""
    before = step_file.stat()
    dataset = float_dataset(step_file)
    with h5py.File(step_file, "r+") as handle:
        write_tensor_values(handle, dataset, tensor_values(handle, dataset) * 2)
    os.utime(step_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = step_file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns), "the rewrite changed the size"


def doubled_and_moved_over(step_file: Path) -> None:
    """A rewritten copy of `step_file` (one tensor doubled) moved over it: a new inode, the size and mtime kept."""
    before = step_file.stat()
    copy = step_file.with_name(step_file.name + ".new")
    shutil.copyfile(step_file, copy)
    doubled_in_place(copy)
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(copy, step_file)


def copied_after_comparing(reference: Path, candidate: Path) -> None:
    """`candidate` made a copy (mtimes kept, its `.ttrace` cache with it) of a run compared with `reference`
    at another path."""
    source = candidate.with_name(candidate.name + "-source")
    os.rename(candidate, source)
    cache_comparison(reference, source)
    shutil.copytree(source, candidate, copy_function=shutil.copy2, symlinks=True)


def stale_caches(pair: tuple[Path, Path]) -> list[Corruption]:
    cases = []
    for role, run in (("candidate", pair[1]), ("reference", pair[0])):
        name = step_files(run)[0].name

        def in_place(reference: Path, candidate: Path, role=role, name=name) -> None:
            cache_comparison(reference, candidate)
            doubled_in_place((reference if role == "reference" else candidate) / name)

        def moved_over(reference: Path, candidate: Path, role=role, name=name) -> None:
            cache_comparison(reference, candidate)
            doubled_and_moved_over((reference if role == "reference" else candidate) / name)
        cases += [Corruption(KIND, f"{role}/{name}: values x2 in place, size and mtime kept", in_place, True),
                  Corruption(KIND, f"{role}/{name}: values x2 in a copy moved over it, size and mtime kept",
                             moved_over, True)]
    name = step_files(pair[1])[0].name

    def copied_and_changed(reference: Path, candidate: Path) -> None:
        copied_after_comparing(reference, candidate)
        doubled_in_place(candidate / name)
    cases += [Corruption(KIND, "candidate copied from a compared run", copied_after_comparing, False),
              Corruption(KIND, f"candidate copied from a compared run, then candidate/{name}: values x2 in place, "
                               "size and mtime kept", copied_and_changed, True)]
    return cases
