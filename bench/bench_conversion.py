"""Conversion: the bulk encoder vs the per-row `tf.train.Example` loop, vs raw write bandwidth, and peak memory.

Run alone with `python -m bench.bench_conversion [--rows N --width W]`, or through `make bench`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
from pipeline_lib.data.convert import convert
from pipeline_lib.config import DataConfig
data = DataConfig(source=sys.argv[1], label="label", target_shard_mb=64)
manifest = convert(data, sys.argv[2])
# VmHWM (peak resident set) of this process image; ru_maxrss would include the forking parent's RSS.
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_mb": peak_kb / 1024,
                  "rows": manifest.num_records("train") + manifest.num_records("eval")}))
"""


def write_source(path: str, rows: int, width: int, seed: int = 0, batch_rows: int = 100_000,
                 wide: bool = False) -> None:
    """A Parquet file of `rows` rows and an int `label`, generated in batches: `x` one fixed-size list column of
    `width` float32 values, or with `wide` the same values as `width` float32 columns `x0`..`x{width-1}`.
    """
    rng = np.random.default_rng(seed)
    if wide:
        schema = pa.schema([(f"x{j}", pa.float32()) for j in range(width)] + [("label", pa.int64())])
    else:
        schema = pa.schema([("x", pa.list_(pa.float32(), width)), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, batch_rows):
            n = min(batch_rows, rows - start)
            x = rng.normal(size=(n, width)).astype(np.float32)
            label = rng.integers(0, 10, size=n)
            if wide:
                columns = {f"x{j}": x[:, j] for j in range(width)}
            else:
                columns = {"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width)}
            writer.write_table(pa.table({**columns, "label": label}, schema=schema))


def write_npz(path: str, parquet_source: str) -> None:
    """The same rows as `parquet_source`, as a NumPy .npz of `x` (rows, width) float32 and `label` int64."""
    table = pq.read_table(parquet_source)
    width = table.schema.field("x").type.list_size
    np.savez(path, x=table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, width),
             label=table.column("label").to_numpy())


def read_seconds(source: str) -> float:
    """Seconds to read every row of `source` into memory the way conversion does, and do nothing else."""
    start = time.perf_counter()
    if source.endswith(".npz"):
        with np.load(source) as arrays:
            for name in arrays.files:
                arrays[name]
    else:
        handle = pq.ParquetFile(source)  # whole row groups, as conversion reads groups of up to 128 MiB
        for row_group in range(handle.num_row_groups):
            handle.read_row_group(row_group, use_threads=False)
    return time.perf_counter() - start


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
    `framing.encode_tfrecords` (protobuf + TFRecord framing + crc32c) and `TFRecordFileWriter` (O_DIRECT write,
    sha256, fsync: durable, as conversion writes local shards), in slices of 65536 rows, one after the other: one thread,
    with each block's sha256 beside its file write as in conversion, and no overlap of encoding and writing.
    """
    from pipeline_lib.data.framing import encode_tfrecords
    from pipeline_lib.data.tfrecord_writer import TFRecordFileWriter

    os.makedirs(out_dir, exist_ok=True)
    per_shard = -(-len(x) // num_shards)
    total = 0
    hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    start = time.perf_counter()
    for shard in range(num_shards):
        writer = TFRecordFileWriter(os.path.join(out_dir, f"part-{shard:05d}.tfrecord"), durable=True, hasher=hasher)
        rows = slice(shard * per_shard, (shard + 1) * per_shard)
        for offset in range(rows.start, min(rows.stop, len(x)), 65536):
            stop = min(offset + 65536, rows.stop, len(x))
            writer.write(encode_tfrecords({"x": x[offset:stop], "label": label[offset:stop]}))
        total += writer.close()[1]
    seconds = time.perf_counter() - start
    hasher.shutdown()
    return seconds, total


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


def raw_direct_write_seconds(payloads: list[bytes], out_dir: str) -> float:
    """Seconds to write the same bytes to as many new files the way conversion writes durable shards: O_DIRECT
    from an aligned buffer in 4 MiB blocks (`direct_io.DirectFile`: one copy into the buffer, the padded tail
    cut off again, fsync). Printed beside the plain write: on this machine it is the faster way to the disk.
    """
    from pipeline_lib.data.direct_io import DirectFile

    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        target = DirectFile(os.path.join(out_dir, f"direct-{i:05d}"))
        target.write(payload)
        target.close()
    return time.perf_counter() - start


def peak_memory_mb(source: str, output_root: str) -> tuple[float, int]:
    """Peak RSS of a fresh process converting `source` (it imports no TensorFlow)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, source, output_root], check=True,
                          capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["peak_rss_mb"], result["rows"]


def _convert_seconds(data, output_root: str):
    from pipeline_lib.data.convert import convert

    shutil.rmtree(output_root, ignore_errors=True)  # a fresh output: no reuse of an earlier manifest
    start = time.perf_counter()
    manifest = convert(data, output_root)
    return time.perf_counter() - start, manifest


def _convert_without_statistics_seconds(data, output_root: str):
    """`_convert_seconds` with the statistics of the conversion pass switched off: what conversion cost before
    them (statistics.json is still written, from no rows)."""
    from pipeline_lib.data.accumulators import StatisticsBuilder

    submit = StatisticsBuilder.submit
    StatisticsBuilder.submit = lambda *args, **kwargs: None
    try:
        return _convert_seconds(data, output_root)
    finally:
        StatisticsBuilder.submit = submit


def _shard_bytes(output_root: str, manifest) -> list[bytes]:
    dataset_dir = os.path.join(output_root, "data", manifest.fingerprint)
    shard_bytes = []
    for shard in manifest.shards:
        with open(os.path.join(dataset_dir, shard.path), "rb") as handle:
            shard_bytes.append(handle.read())
    return shard_bytes


def _settled() -> None:
    """Flush every dirty page before a timed step, so the step does not pay for writeback an earlier one left."""
    os.sync()


def run(rows: int = 2_000_000, width: int = 32, quick: bool = False, repeats: int = 5) -> list[dict]:
    """Every case timed `repeats` times, interleaved (Parquet, NPZ, writer, raw, ...) so that load from other
    processes hits them alike; the best time of each counts. One warm-up of each path first, so imports and
    one-time initialisation (pyarrow's lazy modules, TensorFlow's writer) are timed for neither side. Every
    timed step starts after `os.sync()`, so none pays for the dirty pages of the one before. The per-row
    baseline runs once (it takes about 50 s for 2M rows and is tens of times slower than every fast path).

    Conversion runs from three sources of the same values: Parquet with `x` a fixed-size list column, NumPy
    .npz (`x` a 2-D array), which both give the same shard bytes, and a wide Parquet table (`x0`..`x31`
    float32 columns, the usual shape of a raw table), whose shards hold 33 scalar features a row and so
    other (about three times as many) bytes. Reading each source alone, with no conversion, is timed too: it
    is the part of convert() that depends on the source format, and Parquet's list decoding alone can take
    longer than the raw write of the output.
    """
    from pipeline_lib.config import DataConfig
    from pipeline_lib.core import native

    if quick:
        rows, repeats = min(rows, 20_000), 1
    work = tempfile.mkdtemp(prefix="tfdag-bench-conversion-")
    try:
        source = os.path.join(work, "rows.parquet")
        write_source(source, rows, width)
        npz_source = os.path.join(work, "rows.npz")
        write_npz(npz_source, source)
        wide_source = os.path.join(work, "wide.parquet")
        write_source(wide_source, rows, width, wide=True)
        sources = {"parquet": source, "npz": npz_source, "wide": wide_source}
        configs = {name: DataConfig(source=path, label="label", target_shard_mb=8.0) for name, path in sources.items()}

        warm = os.path.join(work, "warm.parquet")
        write_source(warm, 2_000, width, seed=2)
        write_npz(os.path.join(work, "warm.npz"), warm)
        write_source(os.path.join(work, "warm-wide.parquet"), 2_000, width, seed=2, wide=True)
        for warm_source in (warm, os.path.join(work, "warm.npz"), os.path.join(work, "warm-wide.parquet")):
            _convert_seconds(DataConfig(source=warm_source, label="label", target_shard_mb=8.0),
                             os.path.join(work, "warm"))
        table = pq.read_table(source)
        x = table.column("x").combine_chunks().flatten().to_numpy().reshape(rows, width)
        label = table.column("label").to_numpy()
        del table
        per_row_baseline(x[:2_000], label[:2_000], os.path.join(work, "warm-baseline"), 1)
        fast_write_seconds(x[:2_000], label[:2_000], os.path.join(work, "warm-writer"), 1)

        best: dict[str, float] = {}

        def keep(name: str, seconds: float) -> None:
            best[name] = min(best.get(name, float("inf")), seconds)

        def timed(name: str, step, *args):
            _settled()
            result = step(*args)
            keep(name, result[0] if isinstance(result, tuple) else result)
            return result

        def durable_raw(name: str, payloads: list[bytes], attempt: int, durable: bool = True) -> None:
            out = os.path.join(work, f"{name}{attempt}")
            timed(name, raw_write_seconds, payloads, out, durable)
            shutil.rmtree(out, ignore_errors=True)

        manifests = {}
        for attempt in range(repeats):
            for name in ("parquet", "npz", "wide"):
                manifests[name] = timed(name, _convert_seconds, configs[name], os.path.join(work, name))[1]
            timed("wide_no_statistics", _convert_without_statistics_seconds, configs["wide"],
                  os.path.join(work, "wide-no-statistics"))
            num_shards = len(manifests["parquet"].shards)
            shard_bytes = _shard_bytes(os.path.join(work, "parquet"), manifests["parquet"])
            assert shard_bytes == _shard_bytes(os.path.join(work, "npz"), manifests["npz"]), "sources disagree"
            total_bytes = sum(len(b) for b in shard_bytes)
            for name, path in sources.items():
                timed(f"read_{name}", read_seconds, path)
            if attempt == 0:
                out = os.path.join(work, "baseline")
                timed("baseline", per_row_baseline, x, label, out, num_shards)
                shutil.rmtree(out, ignore_errors=True)
            out = os.path.join(work, f"writer{attempt}")
            writer_bytes = timed("writer", fast_write_seconds, x, label, out, num_shards)[1]
            shutil.rmtree(out, ignore_errors=True)
            durable_raw("raw", shard_bytes, attempt)
            durable_raw("cache", shard_bytes, attempt, durable=False)
            out = os.path.join(work, f"direct{attempt}")
            timed("direct", raw_direct_write_seconds, shard_bytes, out)
            shutil.rmtree(out, ignore_errors=True)
            del shard_bytes
            wide_bytes = _shard_bytes(os.path.join(work, "wide"), manifests["wide"])
            wide_total = sum(len(b) for b in wide_bytes)
            durable_raw("raw_wide", wide_bytes, attempt)
            del wide_bytes
        del x, label
        _settled()

        def mb_s(name: str, size: int = total_bytes) -> float:
            return size / best[name] / 1e6

        fast_rows, npz_rows, base_rows, writer_rows = (rows / best[k] for k in ("parquet", "npz", "baseline", "writer"))
        raw_s = best["raw"]
        print(f"conversion: {rows} rows x ({width} float32 + 1 int64 label) -> {num_shards} shards, "
              f"{total_bytes / 1e6:.1f} MB of TFRecords; best of {repeats} interleaved runs, after a warm-up; "
              f"loops: {native.describe()}")
        print(f"  convert() from Parquet {best['parquet']:.3f}s = {fast_rows:,.0f} rows/s = {mb_s('parquet'):.1f} MB/s  "
              "[read, coerce, split hash, encode, frame + crc32c, write, sha256, fsync, publish, manifest]")
        print(f"  convert() from NumPy .npz {best['npz']:.3f}s = {npz_rows:,.0f} rows/s = {mb_s('npz'):.1f} MB/s  "
              "[the same steps and the same shard bytes]")
        print(f"  reading the source alone, no conversion: Parquet {best['read_parquet']:.3f}s "
              f"({best['read_parquet'] / raw_s:.1f}x the raw write below), .npz {best['read_npz']:.3f}s "
              f"({best['read_npz'] / raw_s:.1f}x)")
        print(f"  per-row tf.train.Example loop {best['baseline']:.3f}s = {base_rows:,.0f} rows/s  [in-memory numpy "
              "columns -> Example per row, SerializeToString, tf.io.TFRecordWriter; no read, split or sha256]")
        print(f"  bulk writer alone {best['writer']:.3f}s = {writer_rows:,.0f} rows/s = "
              f"{mb_s('writer', writer_bytes):.1f} MB/s  [the same in-memory columns -> encode_tfrecords, write, "
              "sha256, fsync; no overlap of encoding and writing]")
        print(f"  raw write of the same bytes {raw_s:.3f}s = {mb_s('raw'):.1f} MB/s  [the shard bytes, already in "
              "memory -> open().write() + fsync to new files]")
        print(f"  raw O_DIRECT write of the same bytes {best['direct']:.3f}s = {mb_s('direct'):.1f} MB/s  [aligned "
              f"4 MiB blocks + fsync, as convert() writes local shards; convert() from Parquet is "
              f"{mb_s('parquet') / mb_s('direct'):.2f}x of it, from .npz {mb_s('npz') / mb_s('direct'):.2f}x]")
        print(f"  (page-cache copy of the same bytes, no fsync: {best['cache']:.3f}s = {mb_s('cache'):.0f} MB/s; that "
              f"is memory bandwidth, not storage: convert() from .npz is {mb_s('npz') / mb_s('cache'):.2f}x of it)")
        print(f"  wide Parquet table ({width} float32 columns + label -> {len(manifests['wide'].shards)} shards, "
              f"{wide_total / 1e6:.1f} MB): convert() {best['wide']:.3f}s = {mb_s('wide', wide_total):.1f} MB/s, "
              f"reading it alone {best['read_wide']:.3f}s, raw write of its shard bytes {best['raw_wide']:.3f}s = "
              f"{mb_s('raw_wide', wide_total):.1f} MB/s")
        print(f"  the same wide conversion without the statistics of the conversion pass: "
              f"{best['wide_no_statistics']:.3f}s (with them {best['wide']:.3f}s, "
              f"{best['wide_no_statistics'] / best['wide']:.2f}x the throughput)")

        # Peak memory as the input grows 10x: a tenth of the rows, then the whole source above.
        small_rows = rows // 10
        small = os.path.join(work, "rows-tenth.parquet")
        write_source(small, small_rows, width, seed=1)
        small_rss, _ = peak_memory_mb(small, os.path.join(work, "mem1"))
        shutil.rmtree(os.path.join(work, "mem1"), ignore_errors=True)
        big_rss, converted = peak_memory_mb(source, os.path.join(work, "mem10"))
        assert converted == rows
        print(f"  peak RSS of a fresh convert() process: {small_rss:.0f} MB for {small_rows} rows, {big_rss:.0f} MB "
              f"for {rows} rows (input {os.path.getsize(small) / 1e6:.0f} MB vs {os.path.getsize(source) / 1e6:.0f} MB)")
        return [
            case("conversion vs per-row tf.train.Example loop (rows/s)", fast_rows, base_rows, 10.0),
            case("conversion bulk writer vs per-row loop (rows/s)", writer_rows, base_rows, 10.0),
            case("conversion bulk writer vs raw durable write bandwidth (MB/s)", mb_s("writer", writer_bytes),
                 mb_s("raw"), 0.5),
            case("conversion end to end vs raw durable write bandwidth (MB/s)", mb_s("parquet"), mb_s("raw"), 0.5),
            case("conversion end to end from .npz vs raw durable write (MB/s)", mb_s("npz"), mb_s("raw"), 0.5),
            case("conversion from wide Parquet vs raw durable write (MB/s)", mb_s("wide", wide_total),
                 mb_s("raw_wide", wide_total), 0.5),
            case("conversion with statistics vs without, wide Parquet (rows/s)", rows / best["wide"],
                 rows / best["wide_no_statistics"], 0.9),
            # Lower is better: ratio = RSS at 1x / RSS at 10x; ≥ 0.67 means under 1.5x growth for 10x the input.
            case("conversion peak RSS at 10x input vs 1x (MB)", big_rss, small_rss, 0.67, higher_is_better=False),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_conversion", description=__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of every case (best counts)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from bench.__main__ import print_table

    print_table(run(rows=args.rows, width=args.width, quick=args.quick, repeats=args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
