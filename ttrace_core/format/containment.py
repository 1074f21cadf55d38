"""What a trace reader may touch: the files of its own run directory, and the data inside them.

Part of the trace format's reading side: step_file.py's wall checks every step file through it, and
reader.py its manifest. A shared trace must never make ttrace read elsewhere: a symlink out of the
run directory, an HDF5 soft or external link, a virtual dataset or external raw storage would each
lead a reader to another file (`/etc/...` or another run's data, which would then be judged as this
run's). ttrace writes none of them, so each is refused before
anything is read through it, with one line naming the file. `dataset_metas` lists a step file's
datasets and their metadata through HDF5's low-level API with those checks built in.

Only regular files are opened (regular_files.py): `contained` also refuses, before anything is
opened, a symlink loop, a dangling symlink, and a FIFO, socket, device or directory where a file belongs.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import h5py

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.datasets import STRING, damaged_file_errors, scalar_attribute
from ttrace_core.format.regular_files import kind_of


ONLY_REGULAR = "ttrace opens only regular files: copy the recorded file here again"


def _refuse_unopenable(path: Path, remedy: str) -> None:
    """Refuses a symlink loop, a dangling symlink and anything but a regular file; a plain missing
    file is left to the caller, which says what it meant to find."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise TraceFormatError(f"{path}: a symlink loop (it leads back to itself, never to a file); {remedy}") from None
        if error.errno == errno.ENOENT and os.path.islink(path):
            raise TraceFormatError(f"{path}: a symlink to {os.readlink(path)}, which does not exist; {remedy}") from None
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            return
        raise
    if (kind := kind_of(mode)) is not None:
        raise TraceFormatError(f"{path}: {kind}, not a regular file; {remedy}")


def contained(run_dir: str | os.PathLike, name: str, *, remedy: str = ONLY_REGULAR) -> Path:
    """run_dir / name, refused when it is a symlink that leads out of the run directory (a shared
    trace is read from its own directory only: a link to another run's file would be judged as this
    one's), a symlink loop, or not a regular file (a FIFO, socket, device or directory); `remedy` ends
    the refusal's line."""
    path = Path(run_dir) / name
    _refuse_unopenable(path, remedy)
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(Path(run_dir).resolve()):
            raise TraceFormatError(f"{path}: a symlink to {target}, outside the run directory; ttrace reads nothing "
                                   "outside a trace, copy the file into it instead")
    return path


def refuse_links(handle: h5py.File, where: str) -> None:
    """ttrace writes hard links only (format 4 links a tensor recorded twice in a step to its first
    dataset); a soft or external link (which HDF5 would follow into another file, `/etc/...` included)
    is refused before anything is read through it."""
    found: list[tuple[bytes, int]] = []

    def visit(name: bytes, info) -> bool | None:  # raising inside an HDF5 callback corrupts h5py's lock: stop, then raise
        if info.type != h5py.h5l.TYPE_HARD:
            found.append((name, info.type))
            return True
        return None

    handle.id.links.visit(visit, info=True)
    if found:
        raise link_refusal(where, *found[0])


def link_refusal(where: str, name: bytes, kind: int) -> TraceFormatError:
    """The one line that refuses a soft or external link `name` of kind `kind` (an h5l link type)."""
    kind_text = "an external" if kind == h5py.h5l.TYPE_EXTERNAL else "a soft"
    return TraceFormatError(f"{where}: {name.decode('utf-8', 'backslashreplace')} is {kind_text} link; ttrace "
                            "writes only hard links inside a step file and reads nothing outside the trace, "
                            "re-record this rank")


def _keeps_values_elsewhere(dataset_id) -> bool:
    plist = dataset_id.get_create_plist()
    return plist.get_layout() == h5py.h5d.VIRTUAL or plist.get_external_count() > 0


def refuse_external_storage(dataset_id, where: str) -> None:
    """Refuse what is not a dataset whose values live in this file: a group (or any other object) where a
    dataset belongs, a virtual dataset, external storage."""
    if not isinstance(dataset_id, h5py.h5d.DatasetID):
        raise TraceFormatError(f"{where}: is an HDF5 {type(dataset_id).__name__.removesuffix('ID').lower()} where "
                               "ttrace writes a dataset (written by another tool, or damaged); re-record this rank")
    if _keeps_values_elsewhere(dataset_id):
        raise TraceFormatError(f"{where}: keeps its values in another file (a virtual dataset or external storage); "
                               "ttrace reads nothing outside the trace directory, re-record this rank")


def dataset_metas(handle: h5py.File, where: str = "") -> dict[str, bytes | None]:
    """Every dataset of a step file and its raw `meta` attribute (None when it has none), through
    HDF5's low-level visit: 2.5x faster than `visititems`, which builds an object per node. Refuses
    links and datasets whose values live in another file."""
    refuse_links(handle, where)
    found: dict[str, bytes | None] = {}
    stopped: list[tuple[bytes, Exception | None]] = []  # raising inside HDF5's callback corrupts h5py's lock

    def visit(name: bytes, info) -> bool | None:
        if info.type != h5py.h5o.TYPE_DATASET:
            return None
        try:
            if _keeps_values_elsewhere(h5py.h5d.open(handle.id, name)):
                stopped.append((name, None))
                return True
            found[name.decode("utf-8", "backslashreplace")] = _meta_attribute(handle, name, where)
        except Exception as error:  # noqa: BLE001 - re-raised below, outside the callback
            stopped.append((name, error))
            return True
        return None

    h5py.h5o.visit(handle.id, visit, info=True)
    if stopped:
        name, error = stopped[0]
        if error is not None:
            with damaged_file_errors(f"{where}:{name.decode('utf-8', 'backslashreplace')}", "re-record this rank"):
                raise error
        refuse_external_storage(h5py.h5d.open(handle.id, name), f"{where}:{name.decode('utf-8', 'backslashreplace')}")
    return found


def _meta_attribute(handle: h5py.File, name: bytes, where: str) -> bytes | None:
    dataset = h5py.h5o.open(handle.id, name)
    return scalar_attribute(dataset, "meta", STRING, f"{where}:{name.decode('utf-8', 'backslashreplace')}",
                            "re-record this rank")
