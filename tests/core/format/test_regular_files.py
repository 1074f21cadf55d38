"""format/regular_files.py: only regular files are opened, and what is not one is refused before a byte of it
is read, without blocking. (`containment.contained` checks a path's kind with os.stat first:
tests/core/format/test_containment.py; here the reader that checks what it has opened.)"""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat

import pytest

from ttrace_core.format.regular_files import kind_of, regular_file_bytes


@pytest.mark.parametrize("mode, kind", [
    (stat.S_IFREG | 0o644, None),
    (stat.S_IFDIR | 0o755, "a directory"),
    (stat.S_IFIFO | 0o600, "a FIFO (named pipe)"),
    (stat.S_IFSOCK | 0o777, "a socket"),
    (stat.S_IFCHR | 0o666, "a character device"),
    (stat.S_IFBLK | 0o660, "a block device"),
    (stat.S_IFLNK | 0o777, "a special file"),  # (a kind os.fstat never gives: whatever else, named so)
], ids=["regular", "directory", "fifo", "socket", "character-device", "block-device", "other"])
def test_kind_of_names_every_kind_but_a_regular_file(mode, kind):
    assert kind_of(mode) == kind


@pytest.fixture
def no_hang():
    """Fails a test that blocks for 5 s (a FIFO opened without O_NONBLOCK waits for a writer for ever)."""
    def hung(*_):
        raise AssertionError("blocked: opening the file waited")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_regular_file_is_read_whole_through_a_symlink_too(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b'{"role": "reference"}\n')
    (tmp_path / "link.json").symlink_to("manifest.json")
    before = _open_descriptors()
    assert regular_file_bytes(tmp_path / "manifest.json") == b'{"role": "reference"}\n'
    assert regular_file_bytes(str(tmp_path / "link.json")) == b'{"role": "reference"}\n'
    (tmp_path / "empty.json").touch()
    assert regular_file_bytes(tmp_path / "empty.json") == b""
    assert _open_descriptors() == before


def _refusal(path) -> OSError:
    before = _open_descriptors()
    with pytest.raises(OSError) as raised:
        regular_file_bytes(path)
    assert _open_descriptors() == before  # the descriptor is closed on refusal too
    return raised.value


def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path, no_hang):
    os.mkfifo(tmp_path / "manifest.json")
    error = _refusal(tmp_path / "manifest.json")
    assert (error.errno, error.strerror, error.filename) == (errno.EINVAL, "a FIFO (named pipe), not a regular file",
                                                             str(tmp_path / "manifest.json"))
    assert str(error) == f"[Errno 22] a FIFO (named pipe), not a regular file: '{tmp_path / 'manifest.json'}'"


def test_a_fifo_holding_data_is_refused_before_a_byte_is_read(tmp_path, no_hang):
    """What a writer put in the FIFO is still there after the refusal: nothing of it was consumed."""
    path = tmp_path / "manifest.json"
    os.mkfifo(path)
    writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # (Linux: O_RDWR opens a FIFO without waiting for a reader)
    try:
        os.write(writer, b'{"role": "reference"}')
        assert _refusal(path).errno == errno.EINVAL
        assert os.read(writer, 100) == b'{"role": "reference"}'
    finally:
        os.close(writer)


@pytest.mark.parametrize("make, message", [
    (lambda path: path.mkdir(), "a directory, not a regular file"),
    (lambda path: path.symlink_to("/dev/null"), "a character device, not a regular file"),
], ids=["directory", "device"])
def test_a_directory_or_a_device_is_refused_naming_the_path(tmp_path, make, message):
    make(tmp_path / "manifest.json")
    error = _refusal(tmp_path / "manifest.json")
    assert (error.errno, error.strerror, error.filename) == (errno.EINVAL, message, str(tmp_path / "manifest.json"))


def test_a_socket_or_a_missing_file_is_an_oserror_naming_the_path(tmp_path):
    """A socket cannot be opened at all (ENXIO), a missing file is FileNotFoundError: both OSErrors naming it."""
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(tmp_path / "manifest.json"))
        error = _refusal(tmp_path / "manifest.json")
        assert (error.errno, error.filename) == (errno.ENXIO, str(tmp_path / "manifest.json"))
    finally:
        server.close()
    missing = _refusal(tmp_path / "gone.json")
    assert isinstance(missing, FileNotFoundError) and missing.filename == str(tmp_path / "gone.json")
