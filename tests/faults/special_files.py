"""Special files where a run has a file, for the robustness cases: a FIFO, a socket, a device, a
directory or a broken symlink (a loop, or a link to nothing) in place of every file of the pair:
manifests, step files, losses.json, the replay job's files and the tolerance estimate.

Opening a FIFO blocks until someone writes to it, a device reads without end (/dev/zero, /dev/urandom),
a symlink loop never resolves: ttrace must refuse each with one line, never hang or crash. Replacing
a manifest, a step file or the estimate is material (the evidence is gone); losses.json and the job's
files are not evidence, so ttrace may pass, and must not hang on them either.

Used by damage_runner.py (the special-file and unreadable-estimate classes) and, through it,
benchmarks/robustness.py.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from tests.faults.corruptions import Corruption, job_dir_of
from ttrace_core.compare.estimate_file import ESTIMATE_FILE


def _make_fifo(path: Path) -> None:
    os.mkfifo(path)


def _make_socket(path: Path) -> None:
    """A bound (and closed) Unix socket; bound from its folder, as a socket path holds at most 107 bytes."""
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path.name)
    finally:
        os.chdir(here)


def _make_device(major: int, minor: int) -> Callable[[Path], None]:
    """A character device node (1, 5) is /dev/zero, (1, 3) /dev/null; where mknod is not allowed
    (no CAP_MKNOD), a symlink to the same device."""
    def make(path: Path) -> None:
        try:
            os.mknod(path, 0o644 | 0o020000, os.makedev(major, minor))
        except PermissionError:
            path.symlink_to({(1, 5): "/dev/zero", (1, 3): "/dev/null"}[(major, minor)])
    return make


def _make_link_to(target: str) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


def _make_loop_of_two(path: Path) -> None:
    partner = path.with_name(path.name + ".loop")
    partner.symlink_to(path.name)
    path.symlink_to(partner.name)


VARIANTS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "FIFO": ("FIFO in place of a file", _make_fifo),
    "socket": ("socket in place of a file", _make_socket),
    "/dev/zero node": ("device in place of a file", _make_device(1, 5)),
    "/dev/null node": ("device in place of a file", _make_device(1, 3)),
    "symlink to /dev/zero": ("device in place of a file", _make_link_to("/dev/zero")),
    "symlink to /dev/urandom": ("device in place of a file", _make_link_to("/dev/urandom")),
    "directory": ("directory in place of a file", lambda path: path.mkdir()),
    "symlink to itself": ("broken symlink", lambda path: path.symlink_to(path.name)),
    "symlink loop of two": ("broken symlink", _make_loop_of_two),
    "dangling symlink": ("broken symlink", _make_link_to("nowhere.h5")),
}

JOB_FILES = ("spec.json", "status.json", "result.json", "log.txt", "lock")
"""The files a replay job's directory holds (the lock only while it runs)."""


def places(pair: tuple[Path, Path]) -> list[tuple[str, str, bool]]:
    """(role, path inside the run, material) of every file of the pair but the estimate."""
    found = []
    for role, run in zip(("reference", "candidate"), pair):
        for path in sorted(run.iterdir()):
            if path.is_file() and path.name != ESTIMATE_FILE:
                found.append((role, path.name, path.suffix in (".h5", ".json") and path.name != "losses.json"))
    job = job_dir_of(pair[1]).relative_to(pair[1])
    found += [("candidate", str(job / name), False) for name in JOB_FILES]
    return found


def _replace(run: Path, relative: str, make: Callable[[Path], None]) -> None:
    path = run / relative
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    make(path)


def special_files(pair: tuple[Path, Path]) -> list[Corruption]:
    cases = []
    for role, relative, material in places(pair):
        for variant, (kind, make) in VARIANTS.items():
            def damage(reference: Path, candidate: Path, role=role, relative=relative, make=make) -> None:
                _replace(reference if role == "reference" else candidate, relative, make)
            cases.append(Corruption(kind, f"{variant} as {role}/{relative}", damage, material))
    return cases


def unreadable_estimates(reference_has_estimate: bool) -> list[Corruption]:
    """An estimate that is present but cannot be read is an error, never a quiet fall back to the dtype
    table (material); one for another precision, which an fp32 candidate never reads, is not."""
    if not reference_has_estimate:
        return []
    cases = [Corruption("unreadable estimate", f"{ESTIMATE_FILE} {variant}",
                        lambda r, c, make=make: _replace(r, ESTIMATE_FILE, make), True)
             for variant, (_, make) in VARIANTS.items()]
    contents = {"empty": lambda text: "", "cut in half": lambda text: text[:len(text) // 2],
                "binary": lambda text: "\x00\xff\xfe" * 100}
    for name, edit in contents.items():
        def rewrite(reference: Path, candidate: Path, edit=edit) -> None:
            path = reference / ESTIMATE_FILE
            path.write_text(edit(path.read_text()))
        cases.append(Corruption("unreadable estimate", f"{ESTIMATE_FILE} {name}", rewrite, True))
    crossed = ESTIMATE_FILE.replace(".json", ".fp8.json")
    cases.append(Corruption("unreadable estimate", f"{crossed} (not this candidate's precision) a FIFO",
                            lambda r, c: _make_fifo(r / crossed), False))
    return cases
