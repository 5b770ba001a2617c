"""Where conversion's time goes: one convert() with its phases timed (read, parse, coerce, split hash,
statistics, encode with framing and CRC32C, digest, gzip, write), CPU-seconds and wall seconds per phase.

Run with `python -m bench.profile_conversion [--case wide] [--rows N]`. Not a benchmark (nothing is compared):
an account of the time of one conversion, for the README's explanation of a missed target. Each phase is timed
by wrapping the function that does it: CPU-s is `time.thread_time()` of the thread that ran the call, wall-s the
time inside the call, each less the phases timed inside that call (a shard's close writes its tail: the write
counts once, as a write). Phases run on several threads at once (main, read-ahead, Parquet decoder, statistics,
shard writer, device writes, digest, gzip, shard closer), so their wall times overlap and do not add up to the
conversion's. The wrappers cost a few microseconds a call (a few thousand calls a conversion). CRC32C is fused
into the C framing loop, so its share is measured apart: the CRC32C of the same shard bytes in one call, on one
thread.
A CSV block the C loop does not read is parsed on Arrow's own thread pool, which no wrapper sees: that CPU is in
"the rest" (the process's CPU-s less every phase's). The digest of the same bytes by each algorithm is timed last, alone.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

CASES = ("wide", "parquet", "npz", "csv", "csv_gz", "csv_gzip")


class PhaseTimes:
    """CPU-s and wall-s accumulated per phase name, from any thread."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._local = threading.local()

    def add(self, phase: str, cpu: float, wall: float) -> None:
        with self._lock:
            self.cpu[phase] += cpu
            self.wall[phase] += wall
            self.calls[phase] += 1

    def register(self, phase: str) -> None:
        """Phases print in the order they were wrapped in, whichever thread ran first."""
        self.cpu.setdefault(phase, 0.0)
        self.wall.setdefault(phase, 0.0)
        self.calls.setdefault(phase, 0)

    def measured(self, phase: str, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` timed as `phase`, less the phases timed inside it on the same thread, so that each
        moment counts once (a shard's close writes its tail: that write counts as a write, not as the close)."""
        nested = self._local.__dict__.setdefault("nested", [])
        nested.append([0.0, 0.0])  # CPU-s and wall-s of the phases timed inside this call
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            inner_cpu, inner_wall = nested.pop()
            if nested:
                nested[-1][0] += cpu
                nested[-1][1] += wall
            self.add(phase, cpu - inner_cpu, wall - inner_wall)

    def timed(self, phase: str, fn: Callable) -> Callable:
        self.register(phase)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return self.measured(phase, fn, *args, **kwargs)
        return call

    def timed_generator(self, phase: str, fn: Callable[..., Iterator]) -> Callable[..., Iterator]:
        """`fn` returns an iterator: the time of each `next` on it counts (the time between them does not)."""
        self.register(phase)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            items = fn(*args, **kwargs)
            try:
                while True:
                    try:
                        item = self.measured(phase, next, items)
                    except StopIteration:
                        return
                    yield item
            finally:
                items.close()
        return call


class _TimedDigest:
    """A digest object whose `update` is timed as the phase "digest"."""

    def __init__(self, digest, times: PhaseTimes):
        self._digest, self._times = digest, times

    def update(self, data) -> None:  # timed here: hash objects' methods cannot be replaced
        self._times.measured("digest", self._digest.update, data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _timed_digests(times: PhaseTimes, new_digest: Callable) -> Callable:
    times.register("digest")
    return lambda algorithm: _TimedDigest(new_digest(algorithm), times)


@contextlib.contextmanager
def instrumented(times: PhaseTimes) -> Iterator[None]:
    """Every phase's function wrapped for the duration (module attributes restored after)."""
    import pyarrow.parquet as pq

    from pipeline_lib.data import (
        chunk_conversion,
        direct_io,
        parallel_gzip,
        tfrecord_writer,
    )
    from pipeline_lib.data.accumulators import StatisticsBuilder
    from pipeline_lib.data.readers import csv, npz

    patches = [
        (pq.ParquetFile, "read_row_group", times.timed("read+decode (Parquet row groups)", pq.ParquetFile.read_row_group)),
        (pq.ParquetFile, "iter_batches",
         times.timed_generator("read+decode (Parquet row groups)", pq.ParquetFile.iter_batches)),
        (npz.NpzReader, "chunks", times.timed_generator("read (.npz member, zip CRC-32)", npz.NpzReader.chunks)),
        (csv, "record_blocks", times.timed_generator("read (records; inflate for .gz)", csv.record_blocks)),
        (csv.CsvReader, "_parse", times.timed("parse (C loop, or Arrow CSV: this thread; Arrow's pool in the rest)",
                                               csv.CsvReader._parse)),
        (chunk_conversion, "coerce", times.timed("coerce", chunk_conversion.coerce)),
        (chunk_conversion, "split_hash", times.timed("split hash", chunk_conversion.split_hash)),
        (StatisticsBuilder, "add_chunk", times.timed("statistics", StatisticsBuilder.add_chunk)),
        (chunk_conversion, "encode_tfrecord_parts",
         times.timed_generator("encode+frame+CRC32C", chunk_conversion.encode_tfrecord_parts)),
        (tfrecord_writer, "new_digest", _timed_digests(times, tfrecord_writer.new_digest)),
        (parallel_gzip, "_deflate", times.timed("gzip deflate", parallel_gzip._deflate)),
        (direct_io.DirectFile, "write", times.timed("write: copy to the aligned buffer (writer thread)",
                                                    direct_io.DirectFile.write)),
        (direct_io.DirectFile, "_write_out", times.timed("O_DIRECT write() calls (device thread, shards' tails)",
                                                         direct_io.DirectFile._write_out)),
        (direct_io.DirectFile, "close", times.timed("shard close (fsync)", direct_io.DirectFile.close)),
    ]
    saved = [(owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
             for owner, name, _ in patches]
    for owner, name, wrapped in patches:
        setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _source(case: str, work: str, rows: int, width: int) -> tuple[str, dict]:
    from bench.bench_conversion import write_csv, write_gzip, write_npz, write_source

    if case in ("wide", "parquet", "npz"):
        path = os.path.join(work, "wide.parquet" if case == "wide" else "rows.parquet")
        write_source(path, rows, width, wide=case == "wide")
        if case == "npz":
            write_npz(os.path.join(work, "rows.npz"), path)
            path = os.path.join(work, "rows.npz")
        return path, {}
    path = os.path.join(work, "rows.csv")
    write_csv(path, rows, width)
    if case == "csv_gz":
        write_gzip(path + ".gz", path)
        return path + ".gz", {}
    return path, {"compression": "gzip"} if case == "csv_gzip" else {}


def profile(case: str = "wide", rows: int = 2_000_000, width: int = 32) -> PhaseTimes:
    """Convert one source of `case` (bench_conversion's sources) once warm, with every phase timed; prints the account."""
    from pipeline_lib.config import DataConfig
    from pipeline_lib.data.convert import convert

    work = tempfile.mkdtemp(prefix="tfdag-profile-conversion-")
    try:
        source, options = _source(case, work, rows, width)
        data = DataConfig(source=source, label="label", target_shard_mb=8.0, **options)
        convert(data.model_copy(update={"read_chunk_rows": 1000}), os.path.join(work, "warm"))  # imports, pools
        shutil.rmtree(os.path.join(work, "warm"))
        times = PhaseTimes()
        os.sync()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.perf_counter()
        with instrumented(times):
            manifest = convert(data, os.path.join(work, "out"))
        wall = time.perf_counter() - wall
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
        shard_bytes = sum(s.num_bytes for s in manifest.shards)
        crc_seconds = _crc32c_seconds(os.path.join(work, "out", "data", manifest.fingerprint), manifest)
        print(f"conversion profile: {case}, {rows} rows, {len(manifest.shards)} shards, {shard_bytes / 1e6:.1f} MB, "
              f"digest {manifest.shard_digest.value}; wall {wall:.3f} s, process CPU {cpu:.3f} s "
              f"({cpu / wall:.2f} cores busy on average of {len(os.sched_getaffinity(0))}), "
              f"{shard_bytes / wall / 1e6:.0f} MB/s of shards")
        print(f"  {'phase':<58} {'CPU-s':>7} {'wall-s':>7} {'calls':>6}")
        for phase in [p for p in times.cpu if times.calls[p]]:
            print(f"  {phase:<58} {times.cpu[phase]:>7.3f} {times.wall[phase]:>7.3f} {times.calls[phase]:>6}")
        print(f"  {'  CRC32C of the shard bytes alone (in the encode)':<58} {crc_seconds:>7.3f}")
        accounted = sum(v for k, v in times.cpu.items() if not k.startswith(" "))
        rest = "the rest (Arrow's pools, Python between phases, queues)"
        print(f"  {rest:<58} {cpu - accounted:>7.3f}")
        _digest_speeds(os.path.join(work, "out", "data", manifest.fingerprint), manifest)
        return times
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _shard_payloads(dataset_dir: str, manifest) -> list[bytes]:
    payloads = []
    for shard in manifest.shards:
        with open(os.path.join(dataset_dir, shard.path), "rb") as handle:
            payloads.append(handle.read())
    return payloads


def _crc32c_seconds(dataset_dir: str, manifest) -> float:
    import crc32c

    payloads = _shard_payloads(dataset_dir, manifest)
    start = time.thread_time()
    for payload in payloads:
        crc32c.crc32c(payload)
    return time.thread_time() - start


def _digest_speeds(dataset_dir: str, manifest) -> None:
    from pipeline_lib.core import digests

    payloads = _shard_payloads(dataset_dir, manifest)
    total = sum(len(p) for p in payloads)
    for algorithm in digests.DigestAlgorithm:
        start = time.thread_time()
        for payload in payloads:
            digest = digests.new_digest(algorithm)
            view = memoryview(payload)
            for offset in range(0, len(payload), 4 << 20):
                digest.update(view[offset:offset + (4 << 20)])
            digest.hexdigest()
        seconds = time.thread_time() - start
        print(f"  digest alone: {algorithm.value} of the same bytes in 4 MiB updates, one thread: {seconds:.3f} CPU-s "
              f"({total / seconds / 1e9:.2f} GB/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_conversion", description=__doc__)
    parser.add_argument("--case", choices=CASES, default="wide", help="which of bench_conversion's sources")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows (default: 2,000,000, or 500,000 for the CSV cases, as in the bench)")
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args(argv)
    rows = args.rows or (500_000 if args.case.startswith("csv") else 2_000_000)
    profile(args.case, rows, args.width)
    return 0


if __name__ == "__main__":
    sys.exit(main())
