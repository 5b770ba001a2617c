"""DirectFile: exactly the bytes written, for any length, with O_DIRECT or the plain-write fallback."""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import os

import numpy as np
import pytest

from pipeline_lib.data import direct_io
from tests.pipeline_lib.data.encoding_support import needs_o_direct

_BLOCK, _ALIGN = direct_io._DIRECT_BLOCK, direct_io._DIRECT_ALIGN


def _write_in_pieces(target, payload: bytes, seed: int) -> None:
    """Write `payload` in random-sized pieces (some bigger than a block, some a few bytes)."""
    rng = np.random.default_rng(seed)
    view, start = memoryview(payload), 0
    while start < len(payload):
        step = int(rng.choice([1, 7, _ALIGN - 1, _ALIGN + 3, _BLOCK // 3, _BLOCK + 11]))
        target.write(view[start:start + step])
        start += step


@pytest.fixture(params=["same thread", "device thread"])
def device(request):
    """None (every block written by the caller), or the one-thread executor conversion writes full blocks on."""
    if request.param == "same thread":
        yield None
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-device") as pool:
        yield pool


@needs_o_direct
@pytest.mark.parametrize("size", [0, 1, _ALIGN - 1, _ALIGN, _ALIGN + 1, _BLOCK - 1, _BLOCK, 2 * _BLOCK + 4099,
                                  5 * _BLOCK + 1])
def test_direct_file_holds_exactly_the_bytes_written_for_any_length(tmp_path, size, device):
    """Blocks go out whole and aligned, in order (several in flight on the device thread); the padded tail is cut
    off again, so the file is the bytes, no more."""
    payload = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8).tobytes()
    path = tmp_path / "direct.bin"
    target = direct_io.DirectFile(str(path), device)
    assert target.direct, "this file system takes O_DIRECT, so the direct path is the one under test"
    _write_in_pieces(target, payload, seed=size)
    assert target.size == size
    target.close()
    assert path.read_bytes() == payload


@needs_o_direct
def test_a_reused_block_buffer_leaves_nothing_of_the_previous_file(tmp_path):
    """Buffers go back to a pool on close: a short file written after a long one must not carry its bytes."""
    long_payload = b"\xff" * (_BLOCK + 3 * _ALIGN + 17)
    first = direct_io.DirectFile(str(tmp_path / "long.bin"))
    first.write(long_payload)
    first.close()
    short = direct_io.DirectFile(str(tmp_path / "short.bin"))
    short.write(b"abc")
    short.close()
    assert (tmp_path / "short.bin").read_bytes() == b"abc"
    assert (tmp_path / "long.bin").read_bytes() == long_payload


@needs_o_direct
def test_direct_file_falls_back_to_plain_writes_where_open_refuses_o_direct(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    payload = bytes(range(256)) * (_BLOCK // 256 + 37)
    target = direct_io.DirectFile(str(tmp_path / "plain.bin"))
    assert not target.direct
    _write_in_pieces(target, payload, seed=1)
    target.close()
    assert (tmp_path / "plain.bin").read_bytes() == payload


@needs_o_direct
def test_direct_file_carries_on_with_plain_writes_where_a_direct_write_is_refused(tmp_path, monkeypatch, device):
    """Some file systems accept O_DIRECT at open and refuse the write: the file continues through the page cache."""
    real_write, refused = os.pwrite, []

    def refusing_write(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refusing_write)
    payload = bytes(range(251)) * (3 * _BLOCK // 251)
    target = direct_io.DirectFile(str(tmp_path / "refused.bin"), device)
    assert target.direct
    _write_in_pieces(target, payload, seed=2)
    target.close()
    assert not target.direct and refused == [_BLOCK]
    assert (tmp_path / "refused.bin").read_bytes() == payload


@needs_o_direct
def test_direct_file_raises_other_open_errors_and_aborts_without_writing_the_tail(tmp_path):
    with pytest.raises(FileNotFoundError):
        direct_io.DirectFile(str(tmp_path / "missing-dir" / "x.bin"))
    target = direct_io.DirectFile(str(tmp_path / "aborted.bin"))
    target.write(b"x" * (_BLOCK + 10))
    target.abort()
    target.abort()  # a second abort is a no-op
    assert (tmp_path / "aborted.bin").stat().st_size == _BLOCK  # the whole block went out, the tail did not


@needs_o_direct
def test_a_failed_block_write_on_the_device_thread_is_raised_and_the_file_still_closes(tmp_path, monkeypatch):
    """A block written on the device thread fails (a full disk): the error reaches the writer, by a later write
    or by close(), and the buffers and the descriptor are given back all the same."""
    real_write, calls = os.pwrite, []

    def full_disk_on_second_block(fd, data, offset):
        calls.append(offset)
        if offset == _BLOCK:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", full_disk_on_second_block)
    free_before = len(direct_io._FREE_BUFFERS)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        target = direct_io.DirectFile(str(tmp_path / "full.bin"), pool)
        with pytest.raises(OSError, match="No space left") as raised:
            target.write(b"x" * (4 * _BLOCK + 5))  # the third full block waits for the first two
            target.close()
        assert raised.value.errno == errno.ENOSPC
        target.abort()  # what the caller does next (TFRecordFileWriter.abort): a no-op once closed
    assert target._fd == -1 and not target._in_flight
    assert _BLOCK in calls and len(direct_io._FREE_BUFFERS) >= free_before
