"""The corruptions of the robustness benchmark: ways a shared trace gets damaged, each a function that
damages a copy of a real (reference, candidate) pair in place.

A `Corruption` knows its class, its name, and whether it is *material*: whether it changes recorded
values beyond their tolerance or makes the evidence incomplete or inconsistent. A material
corruption that still yields a pass is a silent pass. Corruptions whose effect is not known in
advance (a random bit flip in a file, a truncation) leave `material` as None; the benchmark then
decides it by diffing the damaged files against the pristine ones (`Pristine.material_change`).

Also the ways out of a trace (`PLANTS`: links, virtual datasets, external storage, symlinks to an
exact copy outside) with their read detector (`outside_of`, `untouched`, `was_read`), and damaged
replay-job files (`job_file_damage`).

Used by damage_runner.py (every case), tests/test_robustness.py, tests/core/format/test_containment.py (the
ways out) and, through damage_runner.py, benchmarks/robustness.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from tests.faults.meta_rows import (drop_meta, index_rows, is_packed, read_meta, span_of, storage_of, tensor_names,
                                   tensor_values, write_index_rows, write_meta, write_tensor_values)
from ttrace_core.format.reader import INVENTORY_ATTR, MANIFEST_NAME
from ttrace_core.format.tensor_index import TENSOR_INDEX


@dataclass(frozen=True)
class Corruption:
    kind: str
    """The class it is counted under in the results."""
    name: str
    damage: Callable[[Path, Path], None]
    """damage(reference_dir, candidate_dir), in place."""
    material: bool | None
    """True: a pass would be silent; False: a pass is right; None: decided by diffing the files."""


def datasets_of(path: Path) -> list[str]:
    """The places of a step file's tensors with values (their datasets up to format 4, their index rows' names in
    format 5): what the damage families aim at, one tensor each. The index is damaged through its tensors' rows."""
    with h5py.File(path, "r") as handle:
        if is_packed(handle):
            return tensor_names(handle)
        found: list[str] = []
        handle.visititems(lambda name, node: found.append(name) if isinstance(node, h5py.Dataset) else None)
    return [name for name in found if name != TENSOR_INDEX]


def step_files(run: Path) -> list[Path]:
    return sorted(run.glob("rank_*.step_*.h5"))


def _edit_meta(path: Path, dataset: str, edit: Callable[[dict], None]) -> None:
    with h5py.File(path, "r+") as handle:
        meta = read_meta(handle, dataset)
        edit(meta)
        write_meta(handle, dataset, meta)


def _set(*path: str, value) -> Callable[[dict], None]:
    def edit(meta: dict) -> None:
        target = meta
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
    return edit


def _rewrite_values(path: Path, dataset: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    with h5py.File(path, "r+") as handle:
        values = tensor_values(handle, dataset)
        meta = read_meta(handle, dataset)
        if meta["dtype"] != "float32" or values.size == 0:
            return
        write_tensor_values(handle, dataset, change(values.astype(np.float32)))


# -- file bytes ------------------------------------------------------------------------------------

def bit_flips(pair: tuple[Path, Path], count: int, rng: random.Random) -> list[Corruption]:
    files = [(role, p.name, p.stat().st_size) for role, run in zip(("reference", "candidate"), pair) for p in step_files(run)]
    cases = []
    for index in range(count):
        role, name, size = rng.choice(files)
        offset, bit = rng.randrange(size), rng.randrange(8)

        def damage(reference: Path, candidate: Path, role=role, name=name, offset=offset, bit=bit) -> None:
            path = (reference if role == "reference" else candidate) / name
            with open(path, "r+b") as handle:
                handle.seek(offset)
                byte = handle.read(1)[0]
                handle.seek(offset)
                handle.write(bytes([byte ^ (1 << bit)]))
        cases.append(Corruption("bit flip", f"{role}/{name} byte {offset} bit {bit}", damage, None))
    return cases


def truncations(pair: tuple[Path, Path], rng: random.Random, count: int) -> list[Corruption]:
    """At every structural boundary of one candidate file: the start and end of each dataset's data
    (HDF5 stores contiguous data at a known offset), the header, and random points."""
    path = step_files(pair[1])[0]
    size = path.stat().st_size
    boundaries = {0, 8, 48, 96, 512, 1024, size // 2, size - 1}
    with h5py.File(path, "r") as handle:
        for name in datasets_of(path):
            if is_packed(handle):  # the tensor's bytes within its pack
                pack, start, nbytes, _, _ = span_of(handle, name)
                offset, size = handle[pack].id.get_offset(), nbytes
                offset = None if offset is None else offset + start
            else:
                offset, size = handle[name].id.get_offset(), handle[name].id.get_storage_size()
            if offset is not None:
                boundaries |= {offset, offset + max(size // 2, 1)}
    points = sorted(b for b in boundaries if 0 <= b < size)
    points = rng.sample(points, min(count, len(points)))
    cases = []
    for point in sorted(points):
        def damage(reference: Path, candidate: Path, point=point) -> None:
            os.truncate(candidate / path.name, point)
        cases.append(Corruption("truncation", f"{path.name} at byte {point} of {size}", damage, True))
    return cases


# -- metadata --------------------------------------------------------------------------------------


def _doubled(shape: list[int]) -> list[int]:
    """The first dim doubled; a 0-d tensor's (a step scalar's) shape () becomes (2,). The benchmark's format-5 run
    met two scalars here: the damage itself raised, and the harness counted it as a crash of the answer."""
    return [2 * shape[0], *shape[1:]] if shape else [2]

# (name, edit of the metadata JSON); every one of them makes the shard's metadata lie.
LIES = [
    ("dtype says float64", _set("dtype", value="float64")),
    ("dtype says bfloat16", _set("dtype", value="bfloat16")),
    ("dtype unknown", _set("dtype", value="complex64")),
    ("local shape transposed", lambda m: m.__setitem__("local_shape", list(reversed(m["local_shape"])))),
    ("local shape doubled", lambda m: m.__setitem__("local_shape", _doubled(m["local_shape"]))),
    ("global shape doubled", lambda m: m["layout"].__setitem__("global_shape", _doubled(m["layout"]["global_shape"]))),
    ("global shape negative", lambda m: m["layout"].__setitem__("global_shape", [-1, *m["layout"]["global_shape"][1:]])),
    ("global shape absurd", lambda m: m["layout"].__setitem__("global_shape", [2**62, *m["layout"]["global_shape"][1:]])),
    ("placements replicated", lambda m: m["layout"].__setitem__("placements", ["R"] * len(m["layout"]["placements"]))),
    ("placements partial", lambda m: m["layout"].__setitem__("placements", ["P(sum)"] * len(m["layout"]["placements"]))),
    ("placement unknown", lambda m: m["layout"].__setitem__("placements", ["X(9)"] * len(m["layout"]["placements"]))),
    ("coordinate flipped", lambda m: m["layout"].__setitem__("coordinate", [1 - c if n == 2 else c for c, n in zip(m["layout"]["coordinate"], m["layout"]["mesh_shape"])])),
    ("coordinate outside mesh", lambda m: m["layout"].__setitem__("coordinate", [n for n in m["layout"]["mesh_shape"]])),
    ("mesh 4 wide", lambda m: m["layout"].__setitem__("mesh_shape", [4] * len(m["layout"]["mesh_shape"]))),
    ("mesh zero", lambda m: m["layout"].__setitem__("mesh_shape", [0] * len(m["layout"]["mesh_shape"]))),
    ("mesh axis renamed", lambda m: m["layout"].__setitem__("mesh_axis_names", ["dp"] * len(m["layout"]["mesh_axis_names"]))),
    ("scale halved", lambda m: m.__setitem__("scale", m["scale"] / 2)),
    ("scale zero", _set("scale", value=0.0)),
    ("scale negative", _set("scale", value=-1.0)),
    ("scale a string", _set("scale", value="1.0")),
    ("stats only", _set("stats_only", value=True)),
    ("flat range", lambda m: m["layout"].__setitem__("flat_range", [0, 1])),
    ("step", lambda m: m["key"].__setitem__("step", m["key"]["step"] + 1)),
    ("micro-batch", lambda m: m["key"].__setitem__("micro_batch", m["key"]["micro_batch"] + 1)),
    ("phase unknown", _set("key", "phase", value="sideways")),
    ("phase swapped", lambda m: m["key"].__setitem__("phase", "backward" if m["key"]["phase"] == "forward" else "forward")),
    ("fqn", lambda m: m["key"].__setitem__("fqn", m["key"]["fqn"] + ".other")),
    ("slot", lambda m: m["key"].__setitem__("slot", m["key"]["slot"] + "9")),
    ("call", _set("key", "call", value=1)),
    ("rank", lambda m: m.__setitem__("rank", 1 - m["rank"] if m["rank"] < 2 else 0)),
    ("rank negative", _set("rank", value=-1)),
    ("key missing", lambda m: m.pop("key")),
    ("layout missing", lambda m: m.pop("layout")),
    ("world of fields a list", lambda m: m["layout"].__setitem__("global_shape", "16x2")),
]


def _random_dataset_cases(pair: tuple[Path, Path], rng: random.Random, kind: str, changes: list, per_change: int,
                          apply: Callable[[Path, str, Callable], None]) -> list[Corruption]:
    """`per_change` cases of each (name, change): a random dataset of a random candidate file, damaged by
    apply(file, dataset, change). Whether it matters is decided by the diff (material None): a lie that
    happens to tell the truth (transposing a square shape) is no lie."""
    files = step_files(pair[1])
    cases = []
    for change_name, change in changes:
        for _ in range(per_change):
            path = rng.choice(files)
            dataset = rng.choice(datasets_of(path))

            def damage(reference: Path, candidate: Path, name=path.name, dataset=dataset, change=change) -> None:
                apply(candidate / name, dataset, change)
            cases.append(Corruption(kind, f"{change_name}: {path.name}:{dataset}", damage, None))
    return cases


def metadata_lies(pair: tuple[Path, Path], rng: random.Random, per_lie: int) -> list[Corruption]:
    return _random_dataset_cases(pair, rng, "lying metadata", LIES, per_lie, _edit_meta)


def attribute_damage(pair: tuple[Path, Path], rng: random.Random, count: int) -> list[Corruption]:
    files = step_files(pair[1])
    variants = [
        ("meta deleted", drop_meta),
        ("meta not JSON", lambda h, d: write_meta(h, d, "{not json")),
        ("meta a number", lambda h, d: write_meta(h, d, "7") if TENSOR_INDEX in h else h[d].attrs.__setitem__("meta", 7)),
        ("meta deeply nested", lambda h, d: write_meta(h, d, "[" * 5000 + "]" * 5000)),
        ("meta empty object", lambda h, d: write_meta(h, d, "{}")),
    ]
    cases = []
    for index in range(count):
        path, (variant, edit) = rng.choice(files), variants[index % len(variants)]
        dataset = rng.choice(datasets_of(path))

        def damage(reference: Path, candidate: Path, name=path.name, dataset=dataset, edit=edit) -> None:
            with h5py.File(candidate / name, "r+") as handle:
                edit(handle, dataset)
        cases.append(Corruption("attributes", f"{variant}: {path.name}:{dataset}", damage, True))
    for path in files:
        for attr, value, material in (("complete", None, False), ("blind_spots", "{not json", True),
                                      ("blind_spots", '{"a": 1}', True), (INVENTORY_ATTR, None, False),
                                      (INVENTORY_ATTR, 10**6, True), (INVENTORY_ATTR, "many", True)):
            def damage(reference: Path, candidate: Path, name=path.name, attr=attr, value=value) -> None:
                with h5py.File(candidate / name, "r+") as handle:
                    if value is None:
                        handle.attrs.pop(attr, None)
                    else:
                        handle.attrs[attr] = value
            cases.append(Corruption("attributes", f"file attribute {attr} {'deleted' if value is None else repr(value)}: "
                                                  f"{path.name}", damage, material))
    return cases


# -- values ----------------------------------------------------------------------------------------

VALUE_CHANGES = [
    ("one NaN", lambda v: _at_first(v, math.nan)),
    ("one +Inf", lambda v: _at_first(v, math.inf)),
    ("all zero", lambda v: np.zeros_like(v)),
    ("scaled by 1.5", lambda v: v * 1.5),
    ("sign flipped", lambda v: -v),
    ("one element x1000", lambda v: _at_first(v, float(v.reshape(-1)[0]) * 1000 + 1.0)),
]


def _at_first(values: np.ndarray, value: float) -> np.ndarray:
    changed = values.copy()
    changed.reshape(-1)[0] = value
    return changed


def value_damage(pair: tuple[Path, Path], rng: random.Random, per_change: int) -> list[Corruption]:
    return _random_dataset_cases(pair, rng, "values", VALUE_CHANGES, per_change, _rewrite_values)


def duplicated_tensors(pair: tuple[Path, Path], rng: random.Random, count: int) -> list[Corruption]:
    """A dataset copied to a second place in its file, its metadata unchanged (it names the first place)."""
    files = step_files(pair[1])
    cases = []
    for _ in range(count):
        path = rng.choice(files)
        source, target = rng.sample(datasets_of(path), 2)

        def damage(reference: Path, candidate: Path, name=path.name, source=source, target=target) -> None:
            with h5py.File(candidate / name, "r+") as handle:
                if is_packed(handle):  # the target's row names the source's bytes, with the source's metadata
                    rows = index_rows(handle)
                    first = next(row for row in rows if row["dataset"] == source)
                    write_index_rows(handle, [{**first, "dataset": target} if row["dataset"] == target else row
                                              for row in rows])
                    return
                meta = read_meta(handle, source)
                del handle[target]
                handle[target] = handle[source][()]
                write_meta(handle, target, meta)
        cases.append(Corruption("duplicated tensor", f"{path.name}: {source} copied over {target}", damage, True))
    return cases


# -- files and the manifest ------------------------------------------------------------------------

def missing_files(pair: tuple[Path, Path]) -> list[Corruption]:
    cases = []
    for role_index, role in enumerate(("reference", "candidate")):
        for path in step_files(pair[role_index]):
            def delete(reference: Path, candidate: Path, role=role, name=path.name) -> None:
                ((reference if role == "reference" else candidate) / name).unlink()

            def mark_partial(reference: Path, candidate: Path, role=role, name=path.name) -> None:
                run = reference if role == "reference" else candidate
                (run / name).rename(run / (name + ".partial"))

            def empty(reference: Path, candidate: Path, role=role, name=path.name) -> None:
                ((reference if role == "reference" else candidate) / name).write_bytes(b"")
            cases += [Corruption("missing rank or step", f"{role}/{path.name} deleted", delete, True),
                      Corruption("missing rank or step", f"{role}/{path.name} left partial", mark_partial, True),
                      Corruption("missing rank or step", f"{role}/{path.name} emptied", empty, True)]
        cases.append(Corruption("missing rank or step", f"{role}/manifest.json deleted",
                                lambda r, c, role=role: ((r if role == "reference" else c) / MANIFEST_NAME).unlink(), True))
    return cases


def _manifest_edit(edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def damage(reference: Path, candidate: Path) -> None:
        path = candidate / MANIFEST_NAME
        data = json.loads(path.read_text())
        replaced = edit(data)
        path.write_text(replaced if isinstance(replaced, str) else json.dumps(data))
    return damage


HOSTILE_VALUES = [0, -1, True, None, "2", 2.5, 10**30, [], {}, "x" * 100_000, 1e308]


def hostile_manifests() -> list[Corruption]:
    cases = []
    for field in ("world_size", "format_version", "role", "degrees", "mesh_shape", "mesh_axis_names",
                  "rank_coordinates", "precision", "model", "tracer", "blind_spots"):
        for value in HOSTILE_VALUES:
            cases.append(Corruption("hostile manifest", f"{field} = {str(value)[:20]}",
                                    _manifest_edit(lambda d, f=field, v=value: d.__setitem__(f, v)), None))
        cases.append(Corruption("hostile manifest", f"{field} missing", _manifest_edit(lambda d, f=field: d.pop(f, None)), None))
    texts = {
        "deep nesting": lambda d: '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "not JSON": lambda d: "{",
        "empty": lambda d: "",
        "a list": lambda d: "[1, 2]",
        "binary": lambda d: "\x00\xff\xfe garbage",
        "duplicated world_size": lambda d: json.dumps(d)[:-1] + ', "world_size": 7}',
        "huge number": lambda d: json.dumps(d)[:-1] + ', "seed": ' + "9" * 5000 + "}",
        "NaN world size": lambda d: json.dumps(d).replace('"world_size": 2', '"world_size": NaN'),
    }
    for name, text in texts.items():
        cases.append(Corruption("hostile manifest", name, _manifest_edit(text), True))
    return cases


def estimate_damage(reference_has_estimate: bool) -> list[Corruption]:
    if not reference_has_estimate:
        return []
    edits = {
        "deviation inf": lambda d: d["tensors"][0].__setitem__("deviation", math.inf),
        "deviation NaN": lambda d: d["tensors"][0].__setitem__("deviation", math.nan),
        "deviation negative": lambda d: d["tensors"][0].__setitem__("deviation", -1.0),
        "deviation a string": lambda d: d["tensors"][0].__setitem__("deviation", "big"),
        "relative zero": lambda d: d.__setitem__("relative", 0.0),
        "samples zero": lambda d: d.__setitem__("num_samples", 0),
        "format unknown": lambda d: d.__setitem__("format", "other/9"),
        "tensors a dict": lambda d: d.__setitem__("tensors", {}),
        "key missing": lambda d: d["tensors"][0].pop("key"),
        "phase unknown": lambda d: d["tensors"][0]["key"].__setitem__("phase", "sideways"),
    }
    cases = []
    for name, edit in edits.items():
        def damage(reference: Path, candidate: Path, edit=edit) -> None:
            path = reference / "tolerance_estimate.json"
            data = json.loads(path.read_text())
            edit(data)
            path.write_text(json.dumps(data))
        cases.append(Corruption("tolerance estimate", name, damage, True))
    return cases


# -- ways out of the trace directory -------------------------------------------------------------
# Each plants, in the candidate, a way out of its directory that leads to an exact copy of the data
# it replaces (following it would pass), and returns (the file outside, the refusal's words).

OUTSIDE_ROOT = Path("/dev/shm/ttrace-robustness")
"""tmpfs, mounted relatime: a file whose access time is set before its modification time gets a new
one at its next read, so a read outside the trace is seen (`untouched`, `was_read`)."""


def outside_of(candidate: Path) -> Path:
    return OUTSIDE_ROOT / f"{os.getpid()}-{candidate.parent.name}"


def untouched(path: Path) -> None:
    os.utime(path, (1, path.stat().st_mtime))


def was_read(path: Path) -> bool:
    return path.stat().st_atime != 1


def _values_file(outside: Path, step_file: Path, dataset: str) -> Path:
    target = outside / "values.h5"
    with h5py.File(step_file, "r") as source, h5py.File(target, "w") as copy:
        copy["x"] = source[dataset][()]
    return target


def _replace_dataset(step_file: Path, dataset: str, make: Callable[[h5py.File], None]) -> None:
    """`dataset` (a tensor's, or a format-5 pack) replaced by what `make` plants under its name."""
    with h5py.File(step_file, "r+") as handle:
        meta = None if dataset.startswith("packs/") else read_meta(handle, dataset)
        del handle[dataset]
        make(handle)
        if meta is not None and isinstance(handle.get(dataset, getlink=True), h5py.HardLink):
            write_meta(handle, dataset, meta)  # format 4: its index row stays as it was


def external_link(outside: Path, step_file: Path, dataset: str) -> tuple[Path | None, str]:
    target = _values_file(outside, step_file, dataset)
    _replace_dataset(step_file, dataset, lambda h: h.__setitem__(dataset, h5py.ExternalLink(str(target), "x")))
    return target, "is an external link"


def soft_link(outside: Path, step_file: Path, dataset: str) -> tuple[Path | None, str]:
    _replace_dataset(step_file, dataset, lambda h: h.__setitem__(dataset, h5py.SoftLink("/forward")))
    return None, "is a soft link"


def virtual_dataset(outside: Path, step_file: Path, dataset: str) -> tuple[Path | None, str]:
    target = _values_file(outside, step_file, dataset)
    with h5py.File(target, "r") as source:
        shape, dtype = source["x"].shape, source["x"].dtype

    def make(handle: h5py.File) -> None:
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        layout[...] = h5py.VirtualSource(str(target), "x", shape=shape)
        handle.create_virtual_dataset(dataset, layout)
    _replace_dataset(step_file, dataset, make)
    return target, "keeps its values in another file"


def external_storage(outside: Path, step_file: Path, dataset: str) -> tuple[Path | None, str]:
    with h5py.File(step_file, "r") as source:
        values = source[dataset][()]
    target = outside / "values.bin"
    target.write_bytes(np.ascontiguousarray(values).tobytes())
    _replace_dataset(step_file, dataset, lambda h: h.create_dataset(dataset, shape=values.shape, dtype=values.dtype,
                                                                    external=[(str(target), 0, values.nbytes)]))
    return target, "keeps its values in another file"


def symlinked_step_file(outside: Path, step_file: Path, dataset: str) -> tuple[Path | None, str]:
    target = outside / step_file.name
    shutil.move(step_file, target)
    step_file.symlink_to(target)
    return target, "outside the run directory"


def symlinked_manifest(outside: Path, step_file: Path, dataset: str) -> tuple[Path | None, str]:
    manifest = step_file.parent / MANIFEST_NAME
    target = outside / MANIFEST_NAME
    shutil.move(manifest, target)
    manifest.symlink_to(target)
    return target, "outside the run directory"


PLANTS = {"external link": external_link, "soft link": soft_link, "virtual dataset": virtual_dataset,
          "external raw storage": external_storage, "step file symlinked outside": symlinked_step_file,
          "manifest symlinked outside": symlinked_manifest}


def ways_out(pair: tuple[Path, Path]) -> list[Corruption]:
    """One case per plant and per candidate step file's first forward output. Not material (the data
    outside is an exact copy): what counts is the refusal, and that the file outside stays unread."""
    cases = []
    for path in step_files(pair[1]):
        tensor = next(name for name in datasets_of(path) if name.startswith("forward/") and "#output" in name)
        with h5py.File(path, "r") as handle:
            dataset = storage_of(handle, tensor)  # format 5: the pack holding its bytes
        for name, plant in PLANTS.items():
            def damage(reference: Path, candidate: Path, plant=plant, dataset=dataset, file=path.name) -> None:
                outside = outside_of(candidate)
                outside.mkdir(parents=True, exist_ok=True)
                plant(outside, candidate / file, dataset)
            cases.append(Corruption("way out of the trace", f"{name}: {path.name}:{dataset}", damage, False))
    return cases


# -- the replay job a shared candidate carries (.ttrace/jobs/localize-*) -------------------------
# The dashboard reads it as a cache: status.json, spec.json, result.json and the lock. None of it
# changes the recorded evidence (not material); what counts is that nothing crashes, that no
# process is signalled or read from outside on its word, and that errors are one named line.

def job_dir_of(candidate: Path) -> Path:
    return next((candidate / ".ttrace" / "jobs").glob("localize-*"))


def _job_file_edit(name: str, edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def damage(reference: Path, candidate: Path) -> None:
        path = job_dir_of(candidate) / name
        data = json.loads(path.read_text())
        replaced = edit(data)
        path.write_text(replaced if isinstance(replaced, str) else json.dumps(data))
    return damage


def _result_outside(reference: Path, candidate: Path) -> None:
    """spec.json's result_file names an exact copy of the result outside the trace (absolute, then relative)."""
    outside = outside_of(candidate)
    outside.mkdir(parents=True, exist_ok=True)
    job = job_dir_of(candidate)
    shutil.copy(job / "result.json", outside / "result.json")
    _job_file_edit("spec.json", lambda d: d.__setitem__("result_file", str(outside / "result.json")))(reference, candidate)


def _running_as(pid_of: Callable[[], int]) -> Callable[[dict], None]:
    """status.json says the job is running under a process of this machine (this very process, or init)."""
    def edit(data: dict) -> None:
        ref = {"pid": pid_of(), "start": 0, "boot": "copied-from-elsewhere"}
        data.update(state="running", supervisor=ref, command=ref)
    return edit


def job_file_damage() -> list[Corruption]:
    cases = []
    fields = {"status.json": ("state", "supervisor", "command", "exit_code", "started", "message"),
              "spec.json": ("command", "env", "timeout_s", "success_codes", "result_file"),
              "result.json": ("culprits", "modules", "diverged", "reproduction")}
    for name, keys in fields.items():
        for key in keys:
            for value in HOSTILE_VALUES:
                cases.append(Corruption("replay job files", f"{name} {key} = {str(value)[:20]}",
                                        _job_file_edit(name, lambda d, k=key, v=value: d.__setitem__(k, v)), False))
        for text_name, text in {"deep nesting": "[" * 100_000 + "]" * 100_000, "not JSON": "{", "empty": "",
                                "a list": "[1, 2]", "binary": "\x00\xff garbage", "NaN": "NaN"}.items():
            cases.append(Corruption("replay job files", f"{name} {text_name}", _job_file_edit(name, lambda d, t=text: t), False))
    cases += [
        Corruption("replay job files", "status.json running as this process", _job_file_edit("status.json", _running_as(os.getpid)), False),
        Corruption("replay job files", "status.json running as init", _job_file_edit("status.json", _running_as(lambda: 1)), False),
        Corruption("replay job files", "spec.json result_file outside the trace", _result_outside, False),
        Corruption("replay job files", "spec.json result_file ../../manifest.json",
                   _job_file_edit("spec.json", lambda d: d.__setitem__("result_file", "../../../manifest.json")), False),
        Corruption("replay job files", "lock garbage",
                   lambda r, c: (job_dir_of(c) / "lock").write_text("not a pid"), False),
        Corruption("replay job files", "lock names this process",
                   lambda r, c: (job_dir_of(c) / "lock").write_text(f"{os.getpid()} 0 copied-from-elsewhere"), False),
        Corruption("replay job files", "status.json deleted", lambda r, c: (job_dir_of(c) / "status.json").unlink(), False),
        Corruption("replay job files", "result.json deleted", lambda r, c: (job_dir_of(c) / "result.json").unlink(), False),
        Corruption("replay job files", "log.txt a directory",
                   lambda r, c: ((job_dir_of(c) / "log.txt").unlink(), (job_dir_of(c) / "log.txt").mkdir()), False),
    ]
    return cases
