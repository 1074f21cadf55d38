"""Byte-level damage of step files, for the robustness cases: ranges zeroed or overwritten at
random offsets, and bit flips aimed inside the HDF5 structures a reader walks.

`corruptions.bit_flips` and `truncations` hit random bytes and structural boundaries; most bytes of a
step file are tensor values, so a flip at a random offset rarely lands in the file's structure.
These classes aim at it: the object headers of groups and datasets (and, inside a dataset's, its
datatype, dataspace, layout and attribute messages), the global heap collections that hold the
variable-length `meta` strings, and the group B-trees, local heaps, symbol-table nodes and the
superblock. Where each structure lies is read from the file itself (`Structures`): the object
headers are found through h5py and parsed as version-1 headers, which is what h5py writes by default.

Used by damage_runner.py (its byte-level classes), tests/test_damaged_traces.py (`structures_of`,
`message_of`, `flip_bit` aimed at one structure) and, through damage_runner.py, benchmarks/robustness.py.
"""

from __future__ import annotations

import random
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import h5py

from tests.faults.corruptions import Corruption, step_files

MESSAGE_TYPES = {"dataspace": 0x0001, "datatype": 0x0003, "layout": 0x0008, "attribute": 0x000C}
CONTINUATION = 0x0010
SUPERBLOCK_BYTES = 96
"""A version-0 superblock with its root group's symbol-table entry."""
SIGNED_EXTENTS = {b"TREE": 544, b"SNOD": 328, b"HEAP": 32}
"""Bytes from a signature to the end of its structure (group B-tree node with K=16, symbol-table
node with K=4 and its 8 entries, local heap header); a flip beyond that still lands in the file."""

Span = tuple[int, int]
"""(start, length) of bytes in a file."""


@dataclass
class Structures:
    """Where a step file keeps each kind of HDF5 structure, as byte spans."""

    headers: list[Span] = field(default_factory=list)
    messages: dict[str, list[Span]] = field(default_factory=lambda: {kind: [] for kind in MESSAGE_TYPES})
    heaps: list[Span] = field(default_factory=list)
    """Global heap collections (GCOL), where the variable-length `meta` strings live."""
    groups: list[Span] = field(default_factory=list)
    """Superblock, group B-tree nodes, symbol-table nodes, local heaps and their data segments."""


def _header_messages(data: bytes, address: int) -> tuple[list[Span], list[tuple[int, Span]]]:
    """(chunks, [(message type, span of its body)]) of the version-1 object header at `address`."""
    version, _, num_messages, _, size = struct.unpack_from("<BBHII", data, address)
    if version != 1:
        return [], []
    chunks, messages, pending = [], [], [(address + 16, size)]
    while pending and len(messages) < num_messages:
        start, length = pending.pop(0)
        chunks.append((start, length))
        position = start
        while position + 8 <= start + length and len(messages) < num_messages:
            kind, body = struct.unpack_from("<HH", data, position)
            messages.append((kind, (position + 8, body)))
            if kind == CONTINUATION:
                pending.append(struct.unpack_from("<QQ", data, position + 8))
            position += 8 + body
    chunks[0] = (address, chunks[0][1] + 16)  # the prefix (version, counts, size) is part of the header
    return chunks, messages


def _object_addresses(path: Path) -> list[int]:
    with h5py.File(path, "r") as handle:
        addresses = [h5py.h5o.get_info(handle.id).addr]
        handle.visititems(lambda name, node: addresses.append(h5py.h5o.get_info(node.id).addr))
    return addresses


def structures_of(path: Path) -> Structures:
    data = path.read_bytes()
    found = Structures(groups=[(0, SUPERBLOCK_BYTES)])
    for address in _object_addresses(path):
        chunks, messages = _header_messages(data, address)
        found.headers += chunks
        for kind, span in messages:
            for name, code in MESSAGE_TYPES.items():
                if kind == code:
                    found.messages[name].append(span)
    for match in re.finditer(b"GCOL", data):
        (size,) = struct.unpack_from("<Q", data, match.start() + 8)
        found.heaps.append((match.start(), min(size, len(data) - match.start())))
    for signature, extent in SIGNED_EXTENTS.items():
        for match in re.finditer(signature, data):
            found.groups.append((match.start(), min(extent, len(data) - match.start())))
            if signature == b"HEAP":
                segment_size, _, segment = struct.unpack_from("<QQQ", data, match.start() + 8)
                if 0 < segment < len(data):
                    found.groups.append((segment, min(segment_size, len(data) - segment)))
    return found


@dataclass(frozen=True)
class StepFile:
    role: str
    """"reference" or "candidate"."""
    name: str
    size: int
    structures: Structures


def _step_files_of(pair: tuple[Path, Path]) -> list[StepFile]:
    return [StepFile(role, path.name, path.stat().st_size, structures_of(path))
            for role, run in zip(("reference", "candidate"), pair) for path in step_files(run)]


def _path(reference: Path, candidate: Path, target: StepFile) -> Path:
    return (reference if target.role == "reference" else candidate) / target.name


def flip_bit(path: Path, offset: int, bit: int) -> None:
    """Flip bit `bit` (0 the lowest) of the byte at `offset` of `path`, in place."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))


def _flip(target: StepFile, offset: int, bit: int, kind: str, what: str) -> Corruption:
    def damage(reference: Path, candidate: Path) -> None:
        flip_bit(_path(reference, candidate, target), offset, bit)
    return Corruption(kind, f"{target.role}/{target.name} {what} byte {offset} bit {bit}", damage, None)


def _overwrite(target: StepFile, offset: int, payload: bytes, kind: str, what: str) -> Corruption:
    def damage(reference: Path, candidate: Path) -> None:
        with open(_path(reference, candidate, target), "r+b") as handle:
            handle.seek(offset)
            handle.write(payload)
    return Corruption(kind, f"{target.role}/{target.name} {what} {len(payload)} bytes at {offset}", damage, None)


def _range_length(rng: random.Random) -> int:
    """1 byte to 4 KiB, log-uniform: a torn sector, a zeroed page, a stray write."""
    return max(1, int(2 ** rng.uniform(0, 12)))


def byte_ranges(pair: tuple[Path, Path], rng: random.Random, count: int, *, zeroed: bool) -> list[Corruption]:
    """`count` ranges at uniformly random offsets of random step files, zeroed or overwritten with random bytes."""
    targets, cases = _step_files_of(pair), []
    kind, what = ("zeroed range", "zeroed") if zeroed else ("random bytes", "random")
    for _ in range(count):
        target = rng.choice(targets)
        offset = rng.randrange(target.size)
        length = min(_range_length(rng), target.size - offset)
        payload = bytes(length) if zeroed else rng.randbytes(length)
        cases.append(_overwrite(target, offset, payload, kind, what))
    return cases


def heap_damage(pair: tuple[Path, Path], rng: random.Random, count: int) -> list[Corruption]:
    """Ranges zeroed or overwritten inside the global heap collections, where each dataset's `meta` lives."""
    targets, cases = [t for t in _step_files_of(pair) if t.structures.heaps], []
    for index in range(count):
        target = rng.choice(targets)
        start, length = rng.choice(target.structures.heaps)
        offset = start + rng.randrange(length)
        size = min(_range_length(rng) if index % 3 else rng.randint(1, 16), target.size - offset)
        zeroed = index % 2 == 0
        payload = bytes(size) if zeroed else rng.randbytes(size)
        cases.append(_overwrite(target, offset, payload, "global heap damage", "heap " + ("zeroed" if zeroed else "random")))
    return cases


def _flips_in(pair: tuple[Path, Path], rng: random.Random, count: int, kind: str, spans_of) -> list[Corruption]:
    targets, cases = [t for t in _step_files_of(pair) if spans_of(t.structures)], []
    for _ in range(count):
        target = rng.choice(targets)
        start, length = rng.choice(spans_of(target.structures))
        offset = start + rng.randrange(max(1, length))
        cases.append(_flip(target, offset, rng.randrange(8), kind, kind.removesuffix(" bit flip")))
    return cases


def header_flips(pair: tuple[Path, Path], rng: random.Random, count: int) -> list[Corruption]:
    return _flips_in(pair, rng, count, "object header bit flip", lambda s: s.headers)


def message_flips(pair: tuple[Path, Path], rng: random.Random, count: int, message: str) -> list[Corruption]:
    """Flips inside one kind of object-header message (datatype: a float32 turned into a wider float,
    another byte order or class; dataspace: a shape that lies; layout: storage elsewhere or smaller)."""
    return _flips_in(pair, rng, count, f"{message} message bit flip", lambda s: s.messages[message])


def group_structure_flips(pair: tuple[Path, Path], rng: random.Random, count: int) -> list[Corruption]:
    return _flips_in(pair, rng, count, "group structure bit flip", lambda s: s.groups)


def message_of(path: Path, dataset: str, message: str) -> Span:
    """The body of one dataset's `message` ("datatype", ...) in its object header."""
    with h5py.File(path, "r") as handle:
        address = h5py.h5o.get_info(handle[dataset].id).addr
    _, messages = _header_messages(path.read_bytes(), address)
    return next(span for kind, span in messages if kind == MESSAGE_TYPES[message])
