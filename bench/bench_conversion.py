"""Conversion: the bulk encoder vs the per-row `tf.train.Example` loop, vs raw write bandwidth, and peak memory.

Run alone with `python -m bench.bench_conversion [--rows N --width W]`, or through `make bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import case

_MEMORY_PROBE = """
import json, sys
from pipeline_lib import conversion
from pipeline_lib.config import DataConfig
data = DataConfig(source=sys.argv[1], label="label", target_shard_mb=64)
manifest = conversion.convert(data, sys.argv[2])
# VmHWM (peak resident set) of this process image; ru_maxrss would include the forking parent's RSS.
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_mb": peak_kb / 1024,
                  "rows": manifest.num_records("train") + manifest.num_records("eval")}))
"""


def write_source(path: str, rows: int, width: int, seed: int = 0, batch_rows: int = 100_000) -> None:
    """A Parquet file of `rows` rows: `x` (width float32 values) and an int `label`, generated in batches."""
    rng = np.random.default_rng(seed)
    schema = pa.schema([("x", pa.list_(pa.float32(), width)), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, batch_rows):
            n = min(batch_rows, rows - start)
            x = rng.normal(size=(n, width)).astype(np.float32)
            values = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width)
            writer.write_table(pa.table({"x": values, "label": rng.integers(0, 10, size=n)}, schema=schema))


def per_row_baseline(x: np.ndarray, label: np.ndarray, out_dir: str, num_shards: int) -> float:
    """Seconds for the naive recipe on in-memory numpy columns: one `tf.train.Example` per row, built in Python,
    serialized and written by `tf.io.TFRecordWriter` (which frames and crc32c's in C++) into num_shards files.
    No source reading, no split, no sha256: every one of those is extra work the fast path does and this does not.
    """
    import tensorflow as tf

    os.makedirs(out_dir, exist_ok=True)
    per_shard = -(-len(x) // num_shards)
    start = time.perf_counter()
    for shard in range(num_shards):
        with tf.io.TFRecordWriter(os.path.join(out_dir, f"part-{shard:05d}.tfrecord")) as writer:
            for row in range(shard * per_shard, min(len(x), (shard + 1) * per_shard)):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[row])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label[row])])),
                }))
                writer.write(example.SerializeToString())
    return time.perf_counter() - start


def fast_write_seconds(x: np.ndarray, label: np.ndarray, out_dir: str, num_shards: int) -> tuple[float, int]:
    """(seconds, bytes) for the bulk writer on the same in-memory columns into the same number of files:
    `encoding.encode_tfrecords` (protobuf + TFRecord framing + crc32c) and `TFRecordFileWriter` (write, sha256,
    fsync: durable, as conversion writes local shards), on one thread, in slices of 65536 rows.
    """
    from pipeline_lib import encoding

    os.makedirs(out_dir, exist_ok=True)
    per_shard = -(-len(x) // num_shards)
    total = 0
    start = time.perf_counter()
    for shard in range(num_shards):
        writer = encoding.TFRecordFileWriter(os.path.join(out_dir, f"part-{shard:05d}.tfrecord"), durable=True)
        rows = slice(shard * per_shard, (shard + 1) * per_shard)
        for offset in range(rows.start, min(rows.stop, len(x)), 65536):
            stop = min(offset + 65536, rows.stop, len(x))
            writer.write(encoding.encode_tfrecords({"x": x[offset:stop], "label": label[offset:stop]}))
        total += writer.close()[1]
    return time.perf_counter() - start, total


def raw_write_seconds(payloads: list[bytes], out_dir: str, durable: bool = True) -> float:
    """Seconds to write the conversion's own shard bytes (already in memory) to as many new files with plain
    `open().write()`, each fsynced (`durable`): the raw write bandwidth of this disk for these bytes, with the
    guarantee conversion gives its local shards. With durable=False it is the page cache's copy rate instead
    (printed for reference: no storage is written at that rate, it is memory bandwidth).
    """
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        with open(os.path.join(out_dir, f"raw-{i:05d}"), "wb") as handle:
            handle.write(payload)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
    return time.perf_counter() - start


def peak_memory_mb(source: str, output_root: str) -> tuple[float, int]:
    """Peak RSS of a fresh process converting `source` (it imports no TensorFlow)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, source, output_root], check=True,
                          capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["peak_rss_mb"], result["rows"]


def _convert_seconds(data, output_root: str):
    from pipeline_lib import conversion

    shutil.rmtree(output_root, ignore_errors=True)  # a fresh output: no reuse of an earlier manifest
    start = time.perf_counter()
    manifest = conversion.convert(data, output_root)
    return time.perf_counter() - start, manifest


def run(rows: int = 200_000, width: int = 32, quick: bool = False, repeats: int = 3) -> list[dict]:
    """Every case timed `repeats` times, interleaved (fast, baseline, writer, raw, fast, ...) so that load from
    other processes hits them alike; the best time of each counts. One warm-up of each path first, so imports
    and one-time initialisation (pyarrow's lazy modules, TensorFlow's writer) are timed for neither side.
    """
    from pipeline_lib import native
    from pipeline_lib.config import DataConfig

    if quick:
        rows, repeats = min(rows, 20_000), 1
    work = tempfile.mkdtemp(prefix="tfdag-bench-conversion-")
    try:
        source = os.path.join(work, "rows.parquet")
        write_source(source, rows, width)
        data = DataConfig(source=source, label="label", target_shard_mb=8.0)

        warm = os.path.join(work, "warm.parquet")
        write_source(warm, 2_000, width, seed=2)
        _convert_seconds(DataConfig(source=warm, label="label", target_shard_mb=8.0), os.path.join(work, "warm"))
        table = pq.read_table(source)
        x = table.column("x").combine_chunks().flatten().to_numpy().reshape(rows, width)
        label = table.column("label").to_numpy()
        del table
        per_row_baseline(x[:2_000], label[:2_000], os.path.join(work, "warm-baseline"), 1)
        fast_write_seconds(x[:2_000], label[:2_000], os.path.join(work, "warm-writer"), 1)

        fast_s = baseline_s = writer_s = raw_s = cache_s = float("inf")
        for attempt in range(repeats):
            seconds, manifest = _convert_seconds(data, os.path.join(work, "fast"))
            fast_s = min(fast_s, seconds)
            num_shards = len(manifest.shards)
            dataset_dir = os.path.join(work, "fast", "data", manifest.fingerprint)
            shard_bytes = []
            for shard in manifest.shards:
                with open(os.path.join(dataset_dir, shard.path), "rb") as handle:
                    shard_bytes.append(handle.read())
            total_bytes = sum(len(b) for b in shard_bytes)
            baseline_s = min(baseline_s, per_row_baseline(x, label, os.path.join(work, f"baseline{attempt}"),
                                                          num_shards))
            shutil.rmtree(os.path.join(work, f"baseline{attempt}"), ignore_errors=True)
            seconds, writer_bytes = fast_write_seconds(x, label, os.path.join(work, f"writer{attempt}"), num_shards)
            writer_s = min(writer_s, seconds)
            shutil.rmtree(os.path.join(work, f"writer{attempt}"), ignore_errors=True)
            raw_s = min(raw_s, raw_write_seconds(shard_bytes, os.path.join(work, f"raw{attempt}")))
            shutil.rmtree(os.path.join(work, f"raw{attempt}"), ignore_errors=True)
            cache_s = min(cache_s, raw_write_seconds(shard_bytes, os.path.join(work, f"cache{attempt}"), False))
            shutil.rmtree(os.path.join(work, f"cache{attempt}"), ignore_errors=True)
            del shard_bytes
        del x, label

        fast_rows, base_rows, writer_rows = rows / fast_s, rows / baseline_s, rows / writer_s
        fast_mb, raw_mb, cache_mb = total_bytes / fast_s / 1e6, total_bytes / raw_s / 1e6, total_bytes / cache_s / 1e6
        writer_mb = writer_bytes / writer_s / 1e6
        print(f"conversion: {rows} rows x ({width} float32 + 1 int64 label) -> {num_shards} shards, "
              f"{total_bytes / 1e6:.1f} MB of TFRecords; best of {repeats} interleaved runs, after a warm-up; "
              f"loops: {native.describe()}")
        print(f"  fast convert() {fast_s:.3f}s = {fast_rows:,.0f} rows/s = {fast_mb:.1f} MB/s  [Parquet file -> "
              "read, coerce, split hash, encode, frame + crc32c, write, sha256, fsync, publish, manifest]")
        print(f"  per-row tf.train.Example loop {baseline_s:.3f}s = {base_rows:,.0f} rows/s  [in-memory numpy "
              "columns -> Example per row, SerializeToString, tf.io.TFRecordWriter; no read, split or sha256]")
        print(f"  bulk writer alone {writer_s:.3f}s = {writer_rows:,.0f} rows/s = {writer_mb:.1f} MB/s  [the same "
              "in-memory columns -> encode_tfrecords, write, sha256, fsync; one thread]")
        print(f"  raw write of the same bytes {raw_s:.3f}s = {raw_mb:.1f} MB/s  [the shard bytes, already in "
              "memory -> open().write() + fsync to new files]")
        print(f"  (page-cache copy of the same bytes, no fsync: {cache_s:.3f}s = {cache_mb:.0f} MB/s; that is memory "
              f"bandwidth, not storage: convert() is {fast_mb / cache_mb:.2f}x of it)")

        big_rows = rows * 10
        big = os.path.join(work, "rows10.parquet")
        write_source(big, big_rows, width, seed=1)
        small_rss, _ = peak_memory_mb(source, os.path.join(work, "mem1"))
        shutil.rmtree(os.path.join(work, "mem1"), ignore_errors=True)
        big_rss, converted = peak_memory_mb(big, os.path.join(work, "mem10"))
        assert converted == big_rows
        print(f"  peak RSS of a fresh convert() process: {small_rss:.0f} MB for {rows} rows, {big_rss:.0f} MB for "
              f"{big_rows} rows (input {os.path.getsize(source) / 1e6:.0f} MB vs {os.path.getsize(big) / 1e6:.0f} MB)")
        return [
            case("conversion vs per-row tf.train.Example loop (rows/s)", fast_rows, base_rows, 10.0),
            case("conversion bulk writer vs per-row loop (rows/s)", writer_rows, base_rows, 10.0),
            case("conversion bulk writer vs raw durable write bandwidth (MB/s)", writer_mb, raw_mb, 0.5),
            case("conversion end to end vs raw durable write bandwidth (MB/s)", fast_mb, raw_mb, 0.5),
            # Lower is better: ratio = RSS at 1x / RSS at 10x; ≥ 0.67 means under 1.5x growth for 10x the input.
            case("conversion peak RSS at 10x input vs 1x (MB)", big_rss, small_rss, 0.67, higher_is_better=False),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_conversion", description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of every case (best counts)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from bench.__main__ import print_table

    print_table(run(rows=args.rows, width=args.width, quick=args.quick, repeats=args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
