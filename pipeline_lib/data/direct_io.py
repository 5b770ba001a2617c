"""DirectFile: a new local file written with O_DIRECT from an aligned buffer, falling back to plain writes."""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Executor, Future

# O_DIRECT writes: the alignment of buffer, file offset and length that every Linux block device accepts, and
# the size of one write (a bigger one gains nothing measurable: `make bench`).
_DIRECT_ALIGN = 4096
_DIRECT_BLOCK = 4 << 20
# Full blocks of one file handed to the `device` executor and not yet written, at most: the next block is
# filled while they go out.
_BLOCKS_IN_FLIGHT = 2
# Aligned block buffers of closed files, kept for the next one: mapping fresh pages for each file (page faults,
# zeroing, unmapping) cost more than all its copies. Conversion has at most four files open at once, each with
# its blocks in flight.
_FREE_BUFFERS: list[mmap.mmap] = []
_FREE_BUFFERS_LOCK = threading.Lock()
_MAX_FREE_BUFFERS = 4 * (1 + _BLOCKS_IN_FLIGHT)


def _take_buffer() -> mmap.mmap:
    with _FREE_BUFFERS_LOCK:
        if _FREE_BUFFERS:
            return _FREE_BUFFERS.pop()
    return mmap.mmap(-1, _DIRECT_BLOCK)  # anonymous memory: page-aligned


def _give_back(buffer: mmap.mmap) -> None:
    with _FREE_BUFFERS_LOCK:
        if len(_FREE_BUFFERS) < _MAX_FREE_BUFFERS:
            _FREE_BUFFERS.append(buffer)
            return
    buffer.close()


class DirectFile:
    """A new local file written with O_DIRECT: whole 4 MiB blocks go from an aligned buffer to the device.

    A buffered write copies every byte into the page cache, and the kernel's handling of those pages (allocating,
    writing back, reclaiming) costs more than the copy and varies from run to run, in wall and CPU time, where a
    direct write costs little and steadily (bench/bench_conversion.py's O_DIRECT case). Data is copied into the aligned buffer (O_DIRECT needs aligned memory, offsets and
    lengths) and written a block at a time. `close()` writes the last block padded to the alignment, truncates
    the file to its true length and fsyncs it: O_DIRECT bypasses the page cache, not the device's write cache
    or the file's metadata. Where a file system refuses O_DIRECT, at open or at the first write (tmpfs before
    Linux 6.6, some FUSE and network mounts), the same file carries on with plain writes.

    With a `device` executor (one thread), each full block is written there while the next one is copied into
    another buffer, so the device is never idle for a copy; a write's error is raised by a later `write` or by
    `close()`.
    """

    def __init__(self, path: str, device: Executor | None = None):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o666)
            self.direct = True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o666)
            self.direct = False
        self._device = device
        self._in_flight: collections.deque[tuple[Future, mmap.mmap, memoryview]] = collections.deque()
        self._buffer = _take_buffer()
        self._view = memoryview(self._buffer)
        self._fill = 0
        self._offset = 0  # where in the file the buffer's first byte goes
        self.size = 0  # bytes in the file so far, the buffered ones included

    def write(self, data) -> int:
        source = memoryview(data).cast("B")
        taken = 0
        while taken < len(source):
            step = min(len(source) - taken, _DIRECT_BLOCK - self._fill)
            self._view[self._fill:self._fill + step] = source[taken:taken + step]
            self._fill += step
            taken += step
            if self._fill == _DIRECT_BLOCK:
                self._block_full()
        self.size += taken
        return taken

    def _block_full(self) -> None:
        if self._device is None:
            self._write_out(self._view, _DIRECT_BLOCK, self._offset)
        else:
            while len(self._in_flight) >= _BLOCKS_IN_FLIGHT:
                self._retire()
            written = self._device.submit(self._write_out, self._view, _DIRECT_BLOCK, self._offset)
            self._in_flight.append((written, self._buffer, self._view))
            self._buffer = _take_buffer()
            self._view = memoryview(self._buffer)
        self._offset += _DIRECT_BLOCK
        self._fill = 0

    def _retire(self) -> None:
        """Wait for the oldest block in flight and take its buffer back (raising its write's error, if any)."""
        written, buffer, view = self._in_flight.popleft()
        try:
            written.result()
        finally:
            view.release()
            _give_back(buffer)

    def flush(self) -> None:
        """Nothing to do: bytes short of a whole block stay in the buffer until close()."""

    def _write_out(self, view: memoryview, length: int, offset: int) -> None:
        done = 0
        while done < length:
            try:
                done += os.pwrite(self._fd, view[done:length], offset + done)
            except OSError as error:
                if error.errno != errno.EINVAL or not self.direct:
                    raise
                # The file system took O_DIRECT at open but refuses its writes (or a short write left the rest
                # unaligned): the rest of the file is written through the page cache.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def close(self) -> None:
        """Write what the buffer holds, truncate to the bytes written, fsync and close."""
        try:
            while self._in_flight:
                self._retire()
            tail = self._fill
            if tail:
                length = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN if self.direct else tail
                self._view[tail:length] = bytes(length - tail)
                self._write_out(self._view, length, self._offset)
                if length != tail:
                    os.ftruncate(self._fd, self.size)  # the zeros after the last byte
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without writing the buffered tail (the file is left short: the caller removes it)."""
        while self._in_flight:  # the blocks already handed to the device go out before the file closes
            with contextlib.suppress(BaseException):
                self._retire()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
            self._view.release()
            _give_back(self._buffer)

