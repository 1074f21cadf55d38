"""Objects of the wrong kind where a step file's own objects belong, for the robustness cases: an HDF5
group in place of the `tensor_index` or `findings` dataset (or of a tensor's dataset, a pack in format 5),
and a dataset in place of a phase's group, as another tool writing HDF5 by name would leave them (issue 42,
defect 7).

h5py opens a group by the name ttrace gives a dataset without complaint, and a reader that goes on to
ask for the dataset's storage layout fails with an AttributeError from h5py's property lists. Each is
material (the step file's evidence is gone); on a `.partial` step file, which the reader absorbs,
ttrace must still answer with one line or a finding, never a traceback.

Used by damage_runner.py (the class "group or dataset out of place"), tests/core/format/test_containment.py and,
through damage_runner.py, benchmarks/robustness.py.
"""

from __future__ import annotations

from pathlib import Path

import h5py

from tests.faults.corruptions import Corruption, datasets_of, step_files
from tests.faults.meta_rows import storage_of
from ttrace_core.format.findings import FINDINGS
from ttrace_core.format.tensor_index import TENSOR_INDEX

KIND = "group or dataset out of place"


def group_in_place_of(step_file: Path, name: str) -> None:
    """An empty HDF5 group named `name` in `step_file`, replacing the dataset of that name if there is one."""
    with h5py.File(step_file, "r+") as handle:
        if name in handle:
            del handle[name]
        handle.create_group(name)


def dataset_in_place_of(step_file: Path, name: str) -> None:
    """A small float dataset named `name` in `step_file`, replacing the group (and all it holds) of that name."""
    with h5py.File(step_file, "r+") as handle:
        if name in handle:
            del handle[name]
        handle[name] = [1.0, 2.0]


def left_partial(step_file: Path) -> Path:
    """`step_file` renamed as a rank's unfinished step (`.partial`), whose errors the reader absorbs."""
    return step_file.rename(step_file.with_name(step_file.name + ".partial"))


def misplaced_objects(pair: tuple[Path, Path]) -> list[Corruption]:
    """For each step file of the candidate and the reference's first: a group in place of its tensor index, its
    findings and its first tensor's dataset, each in a complete and in a `.partial` step file; and a dataset in
    place of its `forward` group."""
    cases = []
    files = [("candidate", path) for path in step_files(pair[1])] + [("reference", step_files(pair[0])[0])]
    for role, path in files:
        with h5py.File(path, "r") as handle:
            first_tensor = storage_of(handle, datasets_of(path)[0])  # format 5: the pack holding its bytes
        for name, damage in ((TENSOR_INDEX, group_in_place_of), (FINDINGS, group_in_place_of),
                             (first_tensor, group_in_place_of), ("forward", dataset_in_place_of)):
            what = "group" if damage is group_in_place_of else "dataset"
            for partial in (False, True):
                def apply(reference: Path, candidate: Path, role=role, file=path.name, name=name, damage=damage,
                          partial=partial) -> None:
                    step_file = (reference if role == "reference" else candidate) / file
                    damage(step_file, name)
                    if partial:
                        left_partial(step_file)
                cases.append(Corruption(KIND, f"{what} in place of {name}: {role}/{path.name}"
                                              f"{' left partial' if partial else ''}", apply, True))
    return cases
