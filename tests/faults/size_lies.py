"""Sizes that lie, for the robustness cases: datasets whose declared shape the file holds no
storage for, and tensor metadata claiming enormous sizes, told the same way by every shard of a
tensor in both runs, so that nothing short of the size itself gives the lie away.

- lying shape over unallocated storage: a dataset of 2**31 to 2**40 elements whose values were never
  written (HDF5 would read it as fill values: gigabytes to terabytes), its metadata agreeing;
- huge sizes in metadata: a flat range of 10**12 elements, a Partial or sharded tensor over a mesh of
  10**9 ranks, a split or block factor of 10**12, all over the recorded values.

Reading either must be refused before anything of that size is allocated or enumerated.

Used by damage_runner.py (two classes of cases), tests/test_damaged_traces.py (`apply_everywhere` of
one named lie) and, through damage_runner.py, benchmarks/robustness.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from tests.faults.corruptions import Corruption, datasets_of, step_files
from tests.faults.meta_rows import (add_pack, index_rows, is_packed, read_meta, stored_dtype, tensor_names, tensor_values,
                                   write_index_rows, write_meta)

BIG = 10**12
HUGE_MESH = 10**9

Rewrite = Callable[[h5py.File, str, dict], None]
"""rewrite(step file, dataset, its metadata): applied to every shard of the tensor in both runs."""


def _write(handle: h5py.File, dataset: str, meta: dict, values: np.ndarray | None = None, **create) -> None:
    """Replace `dataset` by `values` (or by an unallocated dataset made with `create`) under `meta`; in format 5,
    the tensor's row names a new pack holding them (made with `create` in bytes: the same lie told to a pack)."""
    if is_packed(handle):
        if values is None:
            itemsize = np.dtype(create.pop("dtype")).itemsize
            create["shape"] = (int(np.prod(create["shape"])) * itemsize,)
            if create.get("chunks") not in (None, True):
                create["chunks"] = (int(np.prod(create["chunks"])) * itemsize,)
            number, _ = add_pack(handle, dtype=np.uint8, **create)
        else:
            number, _ = add_pack(handle, values)
        write_index_rows(handle, [{**row, "pack": number, "offset": 0, "meta": meta} if row["dataset"] == dataset else row
                                  for row in index_rows(handle)])
        return
    del handle[dataset]
    if values is not None:
        handle[dataset] = values
    else:
        handle.create_dataset(dataset, **create)
    write_meta(handle, dataset, meta)


def _replicated(meta: dict, shape: list[int], **layout) -> dict:
    """`meta` with local and global shape `shape`, replicated over its mesh unless `layout` says otherwise."""
    mesh = meta["layout"]["mesh_shape"]
    meta["local_shape"] = list(shape)
    meta["layout"].update(global_shape=list(shape), placements=["R"] * len(mesh), flat_range=None)
    meta["layout"].update(layout)
    return meta


def _unallocated(shape: tuple[int, ...], chunks: tuple[int, ...] | None = None) -> Rewrite:
    def rewrite(handle: h5py.File, dataset: str, meta: dict) -> None:
        dtype = stored_dtype(meta["dtype"])
        _write(handle, dataset, _replicated(meta, list(shape)), shape=shape, dtype=dtype, chunks=chunks)
    return rewrite


def _resized_past_its_chunks(numel: int) -> Rewrite:
    """The recorded values in chunks, then the dataspace grown to `numel` elements: storage stays that of the values."""
    def rewrite(handle: h5py.File, dataset: str, meta: dict) -> None:
        values = tensor_values(handle, dataset).reshape(-1)
        if is_packed(handle):  # a chunked pack of the values' bytes, grown to the claimed size
            number, name = add_pack(handle, shape=(values.nbytes,), dtype=np.uint8, chunks=True, maxshape=(None,))
            handle[name][...] = values.view(np.uint8)
            handle[name].resize((numel * values.itemsize,))
            write_index_rows(handle, [{**row, "pack": number, "offset": 0, "meta": _replicated(meta, [numel])}
                                      if row["dataset"] == dataset else row for row in index_rows(handle)])
            return
        _write(handle, dataset, _replicated(meta, [numel]), shape=values.shape, dtype=values.dtype, chunks=True,
               maxshape=(None,))
        handle[dataset][...] = values
        handle[dataset].resize((numel,))
    return rewrite


def _flat_range_over(numel: int, *, claims_all: bool) -> Rewrite:
    """A flat range in a block of `numel` elements: the recorded values (flattened), or all `numel` of them."""
    def rewrite(handle: h5py.File, dataset: str, meta: dict) -> None:
        values = tensor_values(handle, dataset).reshape(-1)
        held = numel if claims_all else values.size
        _write(handle, dataset, _replicated(meta, [held], global_shape=[numel], flat_range=[0, held]), values)
    return rewrite


def _on_mesh(placement: str, mesh_size: int, *, sharded_dim: int | None = None) -> Rewrite:
    """The recorded values under `placement` on a one-axis mesh of `mesh_size` ranks, each rank at its own coordinate."""
    def rewrite(handle: h5py.File, dataset: str, meta: dict) -> None:
        shape = list(tensor_values(handle, dataset).shape)
        global_shape = list(shape)
        if sharded_dim is not None:
            global_shape[sharded_dim] *= mesh_size
        meta["local_shape"] = shape
        meta["layout"].update(global_shape=global_shape, mesh_shape=[mesh_size], coordinate=[meta["rank"]],
                              placements=[placement], mesh_axis_names=["tp"], flat_range=None)
        write_meta(handle, dataset, meta)
    return rewrite


UNALLOCATED = {
    "2**40 elements, contiguous, never written": _unallocated((2**20, 2**20)),
    "2**40 elements, chunked, never written": _unallocated((2**40,), chunks=(2**20,)),
    "2**31 elements (8 GiB), never written": _unallocated((2**31,)),
    "4 x 2**38 elements, never written": _unallocated((4, 2**38)),
    "resized to 2**40 elements past its chunks": _resized_past_its_chunks(2**40),
}
HUGE_METADATA = {
    "flat range in a block of 10**12": _flat_range_over(BIG, claims_all=False),
    "flat range of 10**12 elements": _flat_range_over(BIG, claims_all=True),
    "Partial over 10**9 ranks": _on_mesh("P(sum)", HUGE_MESH),
    "Partial over 2**20 ranks": _on_mesh("P(sum)", 2**20),
    "sharded over 10**9 ranks": _on_mesh("S(0)", HUGE_MESH, sharded_dim=0),
    "replicated over 10**9 ranks": _on_mesh("R", HUGE_MESH),
    "split factor 10**12": _on_mesh(f"SS(0,{BIG})", 2),
    "block count 10**12": _on_mesh(f"SB(0,{BIG})", 2),
}


def apply_everywhere(reference: Path, candidate: Path, dataset: str, rewrite: Rewrite) -> None:
    for run in (reference, candidate):
        for path in step_files(run):
            with h5py.File(path, "r+") as handle:
                if dataset in tensor_names(handle):
                    rewrite(handle, dataset, read_meta(handle, dataset))


def _tensors(pair: tuple[Path, Path]) -> list[str]:
    """Tensors both runs hold whole (replicated in the candidate), with at least one dim: a lie told on
    all their shards leaves the two runs agreeing on the tensor's shape, so only its size gives it away."""
    common = set(datasets_of(step_files(pair[0])[0])) & set(datasets_of(step_files(pair[1])[0]))
    with h5py.File(step_files(pair[0])[0], "r") as reference, h5py.File(step_files(pair[1])[0], "r") as candidate:
        shapes = [(read_meta(candidate, name)["local_shape"], read_meta(reference, name)["local_shape"]) for name in sorted(common)
                  if "#" in name]
        return sorted(name for name, (mine, theirs) in zip(sorted(n for n in common if "#" in n), shapes)
                      if len(mine) >= 1 and mine == theirs)


def _cases(pair: tuple[Path, Path], rng: random.Random, kind: str, lies: dict[str, Rewrite], per_lie: int) -> list[Corruption]:
    tensors, cases = _tensors(pair), []
    for name, rewrite in lies.items():
        for dataset in rng.sample(tensors, min(per_lie, len(tensors))):
            def damage(reference: Path, candidate: Path, dataset=dataset, rewrite=rewrite) -> None:
                apply_everywhere(reference, candidate, dataset, rewrite)
            cases.append(Corruption(kind, f"{name}: {dataset}", damage, True))
    return cases


def unallocated_shapes(pair: tuple[Path, Path], rng: random.Random, per_lie: int) -> list[Corruption]:
    return _cases(pair, rng, "lying shape over unallocated storage", UNALLOCATED, per_lie)


def huge_metadata(pair: tuple[Path, Path], rng: random.Random, per_lie: int) -> list[Corruption]:
    return _cases(pair, rng, "huge sizes in metadata", HUGE_METADATA, per_lie)
