"""Shard writing: each split's records rolled over into local shards of a target size, written on background threads."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
from dataclasses import dataclass

import numpy as np

from pipeline_lib.config import Compression, DataConfig
from pipeline_lib.data.encoding import RECORD_BUFFERS, WRITES_IN_FLIGHT, EncodedBatch
from pipeline_lib.data.tfrecord_writer import TFRecordFileWriter

SPLITS = ("train", "eval")
# A chunk's records are framed and queued for the writer in parts of about this size: a part is still in cache
# when it is copied to the file and digested, its buffer comes back for the next part, and the writer starts on a
# chunk's first part while the rest are framed (faster in wall and CPU time than queueing whole chunks; `make bench`).
WRITE_PART_BYTES = 4 << 20
# gzip: one compressing thread per core (ISA-L and zlib release the GIL), and two blocks queued per thread so none idles
# while the writer thread hands out the next.
_GZIP_THREADS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_GZIP_BLOCKS_IN_FLIGHT = 2 * _GZIP_THREADS


def shard_compression(data: DataConfig) -> str:
    """The manifest's name of the shards' compression: "gzip" or "none"."""
    return "gzip" if data.compression == Compression.GZIP else "none"


@dataclass
class StagedShard:
    """A closed shard in the staging directory, before it is published under its final name."""

    split: str
    local_path: str
    num_records: int
    num_bytes: int
    digest: str  # tfrecord_writer.SHARD_DIGEST


class RollingShards:
    """One split's shards in the staging directory, rolled over once a shard holds target bytes of records.

    The size that counts is the uncompressed record bytes, so shard boundaries depend only on the rows. A full
    shard is closed (and fsynced, when durable) on the `closer` executor while the next one fills.
    """

    def __init__(self, split: str, staging_dir: str, compression: str, target_bytes: int, durable: bool,
                 closer: concurrent.futures.Executor, hasher: concurrent.futures.Executor,
                 compression_level: int = 1, compressor: concurrent.futures.Executor | None = None,
                 device: concurrent.futures.Executor | None = None):
        self.split, self.compression, self.target_bytes = split, compression, max(1, target_bytes)
        self.durable, self._closer, self._hasher = durable, closer, hasher
        self.compression_level, self._compressor, self._device = compression_level, compressor, device
        self.dir = os.path.join(staging_dir, split)
        os.makedirs(self.dir, exist_ok=True)
        self._closing: list[concurrent.futures.Future] = []
        self._writer: TFRecordFileWriter | None = None

    def _open(self) -> TFRecordFileWriter:
        if self._writer is None:
            path = os.path.join(self.dir, f"part-{len(self._closing):05d}")
            self._writer = TFRecordFileWriter(path, self.compression, durable=self.durable, hasher=self._hasher,
                                              compression_level=self.compression_level,
                                              compressor=self._compressor, max_blocks_in_flight=_GZIP_BLOCKS_IN_FLIGHT,
                                              device=self._device)
        return self._writer

    def _finish(self, writer: TFRecordFileWriter) -> StagedShard:
        records, num_bytes, digest = writer.close()
        return StagedShard(self.split, writer.path, records, num_bytes, digest)

    def _roll(self) -> None:
        writer, self._writer = self._writer, None
        self._closing.append(self._closer.submit(self._finish, writer))

    def write(self, batch: EncodedBatch) -> None:
        start, total = 0, len(batch)
        while start < total:
            writer = self._open()
            room = self.target_bytes - writer.num_uncompressed_bytes
            reached = batch.offsets[start + 1 :] - batch.offsets[start]
            cut = int(np.searchsorted(reached, room, side="left"))
            stop = min(total, start + cut + 1)
            writer.write(batch, start, stop)
            if writer.num_uncompressed_bytes >= self.target_bytes:
                self._roll()
            start = stop

    def close(self) -> list[StagedShard]:
        """Every shard closed (and durable), in order."""
        if self._writer is not None and self._writer.num_records:
            self._roll()
        elif self._writer is None and not self._closing:
            # An empty split still gets one (empty, valid) shard so readers find the split.
            self._open()
            self._roll()
        elif self._writer is not None:
            self._writer.abort()
            os.remove(self._writer.path)
            self._writer = None
        return [future.result() for future in self._closing]

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        for future in self._closing:  # let queued closes finish before the staging directory goes
            with contextlib.suppress(BaseException):
                future.result()



class BackgroundWrites:
    """Shard writes (file I/O, gzip and the digest all release the GIL) on one thread, up to WRITES_IN_FLIGHT batches.

    One thread keeps the records in order. Batches queued behind the one being written let encoding run on while
    a write waits on the device; waiting for the oldest once the queue is full bounds memory.
    """

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-write")
        # Closing a full shard (its fsync waits on the disk) runs here, beside the writes of the next one.
        self.closer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-close")
        # The digest of each written block runs here while the write thread copies the block to its file.
        self.hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-hash")
        # Durable shards' full blocks go to the device here while the write thread fills the next (direct_io).
        self.device = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-device")
        # gzip shards: their blocks are deflated here, on every core.
        self.compressor = concurrent.futures.ThreadPoolExecutor(max_workers=_GZIP_THREADS,
                                                                thread_name_prefix="tfdag-gzip")
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()

    def submit(self, shards: dict[str, RollingShards], batch: EncodedBatch, num_eval: int) -> None:
        """Queue `batch`: its first `num_eval` records go to the eval shards, the rest to train."""
        parts = []
        if num_eval:
            parts.append((shards["eval"], batch.rows(0, num_eval)))
        if num_eval < len(batch):
            parts.append((shards["train"], batch.rows(num_eval, len(batch))))
        while len(self._pending) >= WRITES_IN_FLIGHT:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._write, parts, batch))

    @staticmethod
    def _write(parts: list[tuple[RollingShards, EncodedBatch]], batch: EncodedBatch) -> None:
        for split_shards, records in parts:
            split_shards.write(records)
        # Every write copies (into the O_DIRECT buffer, the page cache or a gzip block) before it returns.
        RECORD_BUFFERS.give_back(batch.data)

    def wait(self) -> None:
        """Until every queued batch is written (or failed); then raises the first write error, if any."""
        error: BaseException | None = None
        while self._pending:
            try:
                self._pending.popleft().result()
            except BaseException as failure:  # noqa: BLE001  (re-raised below, once nothing is still writing)
                error = error or failure
        if error is not None:
            raise error

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.closer.shutdown(wait=True)
        self.hasher.shutdown(wait=True)
        self.device.shutdown(wait=True)
        self.compressor.shutdown(wait=True)
