"""TFRecordFileWriter: framed records appended to one local file, gzip optional, counted and digested."""

from __future__ import annotations

import os
from concurrent.futures import Executor
from typing import BinaryIO

from pipeline_lib.core import native
from pipeline_lib.core.digests import DigestAlgorithm, new_digest
from pipeline_lib.data.direct_io import DirectFile
from pipeline_lib.data.encoding import EncodedBatch
from pipeline_lib.data.parallel_gzip import InlineExecutor, ParallelGzipWriter

# Writes at least this large are hashed on the `hasher` thread while the calling thread writes them, and (in
# durable files) handed to the device right away.
_LARGE_WRITE_BYTES = 1 << 20
# The digest of every shard conversion writes (the manifest names it): BLAKE3 hashes these bytes faster than
# sha256 with SHA-NI on one core (see core/digests.py).
SHARD_DIGEST = DigestAlgorithm.BLAKE3


class _HashingWriter:
    """A write-only file wrapper that counts and digests what reaches the underlying file.

    With a `hasher` executor, a large write is hashed there while this thread copies it to the file (hashlib,
    BLAKE3 and file writes all release the GIL), and `write` returns once both are done: the digest stays in order.
    """

    def __init__(self, raw: BinaryIO, algorithm: DigestAlgorithm, hasher: Executor | None = None,
                 writeback: bool = False):
        self._raw = raw
        self._hasher = hasher
        # Durable files: each large write is handed to the device at once, so the fsync at close waits for
        # the last blocks only instead of the whole file (a hint; without the C extension it is skipped).
        self._writeback = writeback and native.module is not None
        self.digest = new_digest(algorithm)
        self.num_bytes = 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if self._hasher is not None and size >= _LARGE_WRITE_BYTES:
            hashed = self._hasher.submit(self.digest.update, data)
            try:
                self._raw.write(data)
            finally:
                hashed.result()
        else:
            self._raw.write(data)
            self.digest.update(data)
        if self._writeback and size >= _LARGE_WRITE_BYTES:
            self._raw.flush()
            native.module.start_writeback(self._raw.fileno(), self.num_bytes, size)
        self.num_bytes += size
        return size

    def flush(self) -> None:
        self._raw.flush()


class TFRecordFileWriter:
    """Appends framed records (an `EncodedBatch` from `framing.encode_tfrecords`) to one local TFRecord file.

    With `compression="gzip"` the file is one gzip stream at `compression_level` (mtime 0, so reruns write
    identical bytes), which `tf.data.TFRecordDataset(..., compression_type="GZIP")` reads; its 1 MiB blocks are
    deflated on the `compressor` executor (one thread per core), at most `max_blocks_in_flight` at once, or on the
    writing thread without one. Tracks records, file bytes and the file's digest (`digest`, SHARD_DIGEST unless
    told otherwise).
    With `durable=True`, `close()` returns only once the bytes are on the storage device (fsync): a manifest
    written after it can never name a shard that a crash left short. A durable file is written with O_DIRECT
    (`DirectFile`) unless `direct=False`: conversion never reads a shard back, so caching its pages only costs
    CPU (training's first epoch then reads from the device, cold, far faster than it consumes). With
    a `hasher` executor, large writes are hashed on it beside the file write; with a `device` executor, a direct
    file's full blocks are written there while the next is filled (`DirectFile`).
    """

    def __init__(self, path: str, compression: str = "none", durable: bool = False, hasher: Executor | None = None,
                 direct: bool = True, compression_level: int = 1, compressor: Executor | None = None,
                 max_blocks_in_flight: int = 4, digest: DigestAlgorithm = SHARD_DIGEST,
                 device: Executor | None = None):
        if compression not in ("none", "gzip"):
            raise ValueError(f"compression {compression!r} is not supported; use 'none' or 'gzip'")
        self.path = path
        self.durable = durable
        self._direct = durable and direct and hasattr(os, "O_DIRECT")
        self._file: BinaryIO | DirectFile
        if self._direct:
            self._file = DirectFile(path, device)
        else:
            self._file = open(path, "wb")  # noqa: SIM115  (closed by close() or abort(); the writer outlives a with-block)
        self._hashing = _HashingWriter(self._file, digest, hasher, writeback=durable and not self._direct)
        self._gzip = None
        if compression == "gzip":
            self._gzip = ParallelGzipWriter(self._hashing, compression_level, compressor or InlineExecutor(),
                                            max_blocks_in_flight)
        self.num_records = 0
        self.num_uncompressed_bytes = 0

    def write(self, batch: EncodedBatch, start: int = 0, stop: int | None = None) -> None:
        stop = len(batch) if stop is None else stop
        if stop <= start:
            return
        view = batch.view(start, stop)
        (self._gzip or self._hashing).write(view)
        self.num_records += stop - start
        self.num_uncompressed_bytes += view.nbytes

    def close(self) -> tuple[int, int, str]:
        """Close the file; returns (records, bytes on disk, hex digest of the file)."""
        if self._gzip is not None:
            self._gzip.close()
        if self.durable and not self._direct:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()  # a DirectFile writes its last block and fsyncs here
        return self.num_records, self._hashing.num_bytes, self._hashing.digest.hexdigest()

    def abort(self) -> None:
        try:
            if self._gzip is not None:
                self._gzip.abort()
        finally:
            (self._file.abort if self._direct else self._file.close)()
