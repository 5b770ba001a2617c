"""ParallelGzipWriter: one gzip stream whose 1 MiB blocks are deflated side by side on a thread pool (as pigz does)."""

from __future__ import annotations

import collections
import struct
import zlib
from concurrent.futures import Executor, Future
from typing import BinaryIO

from isal import isal_zlib

# Uncompressed bytes per block. Blocks sit on a fixed grid of the stream, so the bytes written depend only on
# the records and the level, not on how the caller sliced its writes (the conversion's read_chunk_rows).
BLOCK_BYTES = 1 << 20
# The last 32 KiB of the previous block primes each block's compressor (deflate's whole window), so splitting
# the stream costs almost nothing in ratio.
_WINDOW_BYTES = 32 << 10
# The empty final deflate block (BFINAL=1, fixed Huffman, end-of-block) that closes a stream of sync-flushed ones.
_FINAL_BLOCK = b"\x03\x00"
# Level 1, the fastest and the default, is ISA-L's level 1: it deflates framed float records many times as fast as
# zlib's level 1 on one core, to about the same size. Every other level is zlib's own.
_ISAL_LEVEL = 1


def _header(level: int) -> bytes:
    # gzip.GzipFile's header with mtime 0 and no name, so reruns write identical bytes: magic, deflate, no flags,
    # mtime, extra flags (2: slowest level, 4: fastest), OS unknown.
    extra_flags = 2 if level == 9 else 4 if level == 1 else 0
    return b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + bytes([extra_flags, 255])


def _deflate(block: bytes, window: bytes | None, level: int) -> bytes:
    """A raw deflate of `block` ending on a byte boundary (sync flush), not final, so blocks can be concatenated.

    ISA-L and zlib release the GIL while they compress, so blocks on several threads compress on several cores.
    """
    library = isal_zlib if level == _ISAL_LEVEL else zlib
    options = {"zdict": window} if window else {}
    compressor = library.compressobj(level, library.DEFLATED, -library.MAX_WBITS, **options)
    return compressor.compress(block) + compressor.flush(library.Z_SYNC_FLUSH)


class ParallelGzipWriter:
    """Writes one gzip member to `fileobj`, compressing 1 MiB blocks on `executor` and writing them in order.

    Each block is raw deflate primed with the previous block's last 32 KiB and closed with a sync flush; the
    blocks, an empty final block and the CRC-32/length trailer form one ordinary gzip stream, which `gzip`,
    `zcat` and `tf.data.TFRecordDataset(..., compression_type="GZIP")` read. At most `max_in_flight` blocks wait
    for compression at once, which bounds memory. `write` and `close` must be called from one thread at a time.

    Args:
        fileobj: where the compressed bytes go (only `write` is called).
        level: 0-9, zlib's scale; 1 is deflated by ISA-L (`_ISAL_LEVEL`), the others by zlib.
        executor: compresses the blocks; a pool of one thread per core.
        max_in_flight: blocks queued or compressing at most before `write` waits for the oldest.
    """

    def __init__(self, fileobj: BinaryIO, level: int, executor: Executor, max_in_flight: int):
        if not 0 <= level <= 9:
            raise ValueError(f"gzip level {level} is outside 0-9")
        self._file, self._level, self._executor = fileobj, level, executor
        self._max_in_flight = max(1, max_in_flight)
        self._pending: collections.deque[Future] = collections.deque()
        self._buffer = bytearray()
        self._window: bytes | None = None
        self._crc = 0
        self._size = 0
        self._file.write(_header(level))

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._crc = isal_zlib.crc32(view, self._crc)
        self._size += len(view)
        taken = 0
        while taken < len(view):
            step = min(len(view) - taken, BLOCK_BYTES - len(self._buffer))
            self._buffer += view[taken:taken + step]
            taken += step
            if len(self._buffer) == BLOCK_BYTES:
                self._submit()
        self._drain(self._max_in_flight)
        return len(view)

    def _submit(self) -> None:
        block = bytes(self._buffer)
        self._buffer.clear()
        self._pending.append(self._executor.submit(_deflate, block, self._window, self._level))
        self._window = block[-_WINDOW_BYTES:]

    def _drain(self, keep: int) -> None:
        """Write finished blocks in order; wait for the oldest while more than `keep` are pending."""
        while self._pending and (len(self._pending) > keep or self._pending[0].done()):
            self._file.write(self._pending.popleft().result())

    def close(self) -> None:
        """Compress what is buffered, write every block, the final block and the trailer (not closing fileobj)."""
        if self._buffer:
            self._submit()
        self._drain(0)
        self._file.write(_FINAL_BLOCK + struct.pack("<II", self._crc & 0xFFFFFFFF, self._size & 0xFFFFFFFF))

    def abort(self) -> None:
        """Drop queued blocks without writing them (the caller removes the file)."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._buffer.clear()


class InlineExecutor(Executor):
    """Runs each call at once on the calling thread: a ParallelGzipWriter without a pool compresses serially."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001  (handed to whoever reads the future)
            future.set_exception(error)
        return future
