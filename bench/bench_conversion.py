"""Conversion from Parquet, .npz and CSV vs the O_DIRECT write of the same shard bytes, gzip vs none, and peak memory.

Run alone with `python -m bench.bench_conversion [--rows N --width W]`, or through `make bench`. Where the time of
one conversion goes, phase by phase: `python -m bench.profile_conversion`.
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

from bench import case, interleaved

# What bounds conversion's peak memory from Parquet, whatever the input size (this case and bench_scale's).
PARQUET_MEMORY_BOUND = "one decoded row group ahead and four encoded parts of 4 MiB queued, whatever the input size."

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


def raw_direct_write_seconds(payloads: list[bytes], out_dir: str) -> float:
    """Seconds to write the same bytes to as many new files the way conversion writes durable shards: O_DIRECT
    from an aligned buffer in 4 MiB blocks (`direct_io.DirectFile`: one copy into the buffer, the padded tail
    cut off again, fsync). Printed beside the plain write, to show which is the faster way to this disk.
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


def write_csv(path: str, rows: int, width: int, seed: int = 3, batch_rows: int = 100_000) -> None:
    """A CSV of `rows` rows: `width` float columns x0.. with 4 decimals (how a CSV export writes them) and a label."""
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(seed)
    with open(path, "wb") as handle:
        for start in range(0, rows, batch_rows):
            n = min(batch_rows, rows - start)
            x = np.round(rng.normal(size=(n, width)), 4).astype(np.float32)
            table = pa.table({**{f"x{j}": x[:, j] for j in range(width)}, "label": rng.integers(0, 10, size=n)})
            pacsv.write_csv(table, handle, pacsv.WriteOptions(include_header=start == 0))


def write_gzip(path: str, source: str) -> None:
    """`source` compressed as `gzip` does by default (level 6): how CSV exports usually arrive."""
    import gzip

    with open(source, "rb") as plain, gzip.open(path, "wb", compresslevel=6) as packed:
        shutil.copyfileobj(plain, packed, 1 << 20)


def read_csv_seconds(source: str) -> float:
    """Seconds for `pyarrow.csv.read_csv` (multi-threaded, typed columns) to read the file: parsing it at least
    (and decompressing it, for a .gz file)."""
    import pyarrow.csv as pacsv

    start = time.perf_counter()
    pacsv.read_csv(source)
    return time.perf_counter() - start


# Interleaved rounds of every conversion case (why 7 and not 5: `run`'s docstring).
REPEATS = 7


def run(rows: int = 2_000_000, width: int = 32, quick: bool = False, repeats: int = REPEATS) -> list[dict]:
    """Every case timed `repeats` times, interleaved (each conversion, then its baselines, in turn) so that load
    from other processes hits every side alike; medians and min-max are recorded. The statistics case's two sides,
    a few percent apart, run back to back: on this VM one conversion's time varies by 10-35 % between runs, and the
    same code measured 0.84 and 1.02 in two sittings (five and seven rounds) with the direct write between the
    sides. One warm-up of each path first, so imports and one-time initialisation (pyarrow's lazy modules) are
    timed for neither side. Every timed step starts after `os.sync()`, so none pays for the dirty pages of the one
    before.

    Conversion runs from four sources: Parquet with `x` a fixed-size list column and NumPy .npz (`x` a 2-D
    array), which give the same shard bytes; a wide Parquet table (`x0`..`x31` float32 columns, 33 scalar
    features a row, about three times the bytes); and a CSV of a quarter of the rows (4-decimal values), converted
    plain and with `data.compression: gzip`. The baseline of each is the O_DIRECT write of its own shard bytes
    (the device's bound for what conversion must write), and for CSV also `pyarrow.csv.read_csv` alone.
    """
    from pipeline_lib.config import DataConfig
    from pipeline_lib.core import native

    if quick:
        rows, repeats = min(rows, 20_000), min(repeats, 2)
    csv_rows = max(1, rows // 4)
    work = tempfile.mkdtemp(prefix="tfdag-bench-conversion-")
    try:
        sources = {"parquet": os.path.join(work, "rows.parquet"), "npz": os.path.join(work, "rows.npz"),
                   "wide": os.path.join(work, "wide.parquet"), "csv": os.path.join(work, "rows.csv"),
                   "csv_gz": os.path.join(work, "rows.csv.gz")}
        write_source(sources["parquet"], rows, width)
        write_npz(sources["npz"], sources["parquet"])
        write_source(sources["wide"], rows, width, wide=True)
        write_csv(sources["csv"], csv_rows, width)
        write_gzip(sources["csv_gz"], sources["csv"])
        configs = {name: DataConfig(source=path, label="label", target_shard_mb=8.0) for name, path in sources.items()}
        configs["csv_gzip"] = DataConfig(source=sources["csv"], label="label", target_shard_mb=8.0, compression="gzip")

        warm = os.path.join(work, "warm.parquet")
        write_source(warm, 2_000, width, seed=2)
        write_npz(os.path.join(work, "warm.npz"), warm)
        write_source(os.path.join(work, "warm-wide.parquet"), 2_000, width, seed=2, wide=True)
        write_csv(os.path.join(work, "warm.csv"), 2_000, width)
        write_gzip(os.path.join(work, "warm.csv.gz"), os.path.join(work, "warm.csv"))
        for warm_source in (warm, os.path.join(work, "warm.npz"), os.path.join(work, "warm-wide.parquet"),
                            os.path.join(work, "warm.csv"), os.path.join(work, "warm.csv.gz")):
            for compression in ("none", "gzip"):
                _convert_seconds(DataConfig(source=warm_source, label="label", compression=compression),
                                 os.path.join(work, "warm"))
        read_csv_seconds(os.path.join(work, "warm.csv"))
        read_csv_seconds(os.path.join(work, "warm.csv.gz"))

        manifests: dict = {}

        def converted(name: str, step=_convert_seconds):
            def timed() -> float:
                seconds, manifests[name] = step(configs[name.removesuffix("_no_statistics")],
                                                os.path.join(work, name))
                return seconds
            return timed

        def direct_write(name: str):
            def timed() -> float:
                payloads = _shard_bytes(os.path.join(work, name), manifests[name])
                out = os.path.join(work, f"direct-{name}")
                _settled()
                seconds = raw_direct_write_seconds(payloads, out)
                shutil.rmtree(out, ignore_errors=True)
                return seconds
            return timed

        steps = {
            "parquet": converted("parquet"), "direct_parquet": direct_write("parquet"),
            "npz": converted("npz"),
            "wide": converted("wide"),
            "wide_no_statistics": converted("wide_no_statistics", _convert_without_statistics_seconds),
            "direct_wide": direct_write("wide"),
            "csv": converted("csv"), "read_csv": lambda: read_csv_seconds(sources["csv"]),
            "direct_csv": direct_write("csv"), "csv_gzip": converted("csv_gzip"),
            "csv_gz": converted("csv_gz"), "read_csv_gz": lambda: read_csv_seconds(sources["csv_gz"]),
            "read_parquet": lambda: read_seconds(sources["parquet"]),
        }
        samples = interleaved(steps, repeats, before=_settled)
        assert _shard_bytes(os.path.join(work, "parquet"), manifests["parquet"]) == \
            _shard_bytes(os.path.join(work, "npz"), manifests["npz"]), "sources disagree"
        size = {name: sum(s.num_bytes for s in manifests[name].shards) for name in manifests}

        def mb_s(name: str, bytes_of: str) -> list[float]:
            return [size[bytes_of] / seconds / 1e6 for seconds in samples[name]]

        def median(name: str) -> float:
            return float(np.median(samples[name]))

        print(f"conversion: {rows} rows x ({width} float32 + 1 int64 label) -> {len(manifests['parquet'].shards)} "
              f"shards, {size['parquet'] / 1e6:.1f} MB; CSV {csv_rows} rows; medians of {repeats} interleaved runs "
              f"after a warm-up; loops: {native.describe()}")
        for name, what in (("parquet", "Parquet list column"), ("npz", ".npz"), ("wide", "wide Parquet"),
                           ("csv", "CSV"), ("csv_gzip", "CSV, gzip"), ("csv_gz", "CSV read from .csv.gz")):
            print(f"  convert() from {what}: {median(name):.3f}s (min {min(samples[name]):.3f}, max "
                  f"{max(samples[name]):.3f}) = {float(np.median(mb_s(name, name))):.1f} MB/s of shards")
        for name in ("direct_parquet", "direct_wide", "direct_csv", "read_csv", "read_csv_gz", "read_parquet",
                     "wide_no_statistics"):
            print(f"  {name}: {median(name):.3f}s (min {min(samples[name]):.3f}, max {max(samples[name]):.3f})")
        print(f"  gzip shards {size['csv_gzip'] / 1e6:.1f} MB vs {size['csv'] / 1e6:.1f} MB uncompressed")

        # The O_DIRECT write is the disk's ceiling, reported with no target: a shared virtual disk moves it from run
        # to run.
        direct = "O_DIRECT write of the same shard bytes"
        disk_bound = ("CPU on a small machine (decode, split hash, statistics, encode, digest) against the disk's "
                      "direct write rate of the same bytes")
        cases = [
            case("conversion from Parquet vs O_DIRECT write of its shards (MB/s)", mb_s("parquet", "parquet"),
                 mb_s("direct_parquet", "parquet"), None, unit="MB/s", baseline_name=direct,
                 bound="Parquet's fixed-size-list decoding, encoding and the shards' digest on the CPU; the disk's "
                       "direct write rate is the ceiling."),
            case("conversion from .npz vs O_DIRECT write of its shards (MB/s)", mb_s("npz", "parquet"),
                 mb_s("direct_parquet", "parquet"), None, unit="MB/s", baseline_name=direct,
                 bound="the .npz member's zip CRC-32, encoding and the shards' digest on the CPU; the disk's direct "
                       "write rate is the ceiling."),
            case("conversion from wide Parquet vs O_DIRECT write of its shards (MB/s)", mb_s("wide", "wide"),
                 mb_s("direct_wide", "wide"), None, unit="MB/s", baseline_name=direct, bound=disk_bound + "."),
            case("conversion from CSV vs pyarrow.csv.read_csv alone (rows/s)",
                 [csv_rows / t for t in samples["csv"]], [csv_rows / t for t in samples["read_csv"]], 0.7,
                 unit="rows/s", baseline_name="pyarrow.csv.read_csv of the file",
                 bound="the C parse of the plain numbers (about 0.4 of the CPU of Arrow's, on one core), beside what "
                       "the baseline does not do: encoding, the shards' digest and their writes."),
            case("conversion from gzip CSV vs pyarrow.csv.read_csv of the .csv.gz (rows/s)",
                 [csv_rows / t for t in samples["csv_gz"]], [csv_rows / t for t in samples["read_csv_gz"]], 0.7,
                 unit="rows/s", baseline_name="pyarrow.csv.read_csv of the .csv.gz file",
                 bound="one gzip stream inflated on one core (conversion: ISA-L's inflate, read_csv: zlib's), beside "
                       "the parse (conversion: the C parse) and, in conversion, encoding, the digest and writes."),
            case("conversion from CSV vs O_DIRECT write of its shards (MB/s)", mb_s("csv", "csv"),
                 mb_s("direct_csv", "csv"), None, unit="MB/s", baseline_name=direct,
                 bound="reading the blocks of lines and their C parse, encoding and the digest on the CPU; the disk "
                       "is far from the limit."),
            case("conversion from CSV, gzip vs uncompressed (rows/s)", [csv_rows / t for t in samples["csv_gzip"]],
                 [csv_rows / t for t in samples["csv"]], 0.5, unit="rows/s",
                 baseline_name="the same conversion uncompressed",
                 bound="the deflate (level 1: ISA-L's) on every core: floats' random low bits compress slowly, so "
                       "the number of cores decides it."),
            case("conversion with statistics vs without, wide Parquet (rows/s)", [rows / t for t in samples["wide"]],
                 [rows / t for t in samples["wide_no_statistics"]], 0.9, unit="rows/s",
                 baseline_name="the same conversion without the statistics pass",
                 bound="the statistics' C loop (a sketch key counted and each value summed per split) on its own "
                       "thread, which hides behind encoding only when a core is idle."),
        ]

        # Peak memory as the input grows 10x: a tenth of the rows, then the whole source above.
        small_rows = rows // 10
        small = os.path.join(work, "rows-tenth.parquet")
        write_source(small, small_rows, width, seed=1)
        small_rss, _ = peak_memory_mb(small, os.path.join(work, "mem1"))
        shutil.rmtree(os.path.join(work, "mem1"), ignore_errors=True)
        big_rss, converted_rows = peak_memory_mb(sources["parquet"], os.path.join(work, "mem10"))
        assert converted_rows == rows
        print(f"  peak RSS of a fresh convert() process: {small_rss:.0f} MB for {small_rows} rows, {big_rss:.0f} MB "
              f"for {rows} rows")
        # Lower is better: ratio = RSS at 1x / RSS at 10x; ≥ 0.67 means under 1.5x growth for 10x the input.
        cases.append(case("conversion peak RSS at 10x input vs 1x (MB)", big_rss, small_rss, 0.67,
                          higher_is_better=False, unit="MB", baseline_name=f"peak RSS at {small_rows} rows",
                          bound=PARQUET_MEMORY_BOUND))
        return cases
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_conversion", description=__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="interleaved timed runs of every case (the median counts)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from bench.__main__ import print_table

    print_table(run(rows=args.rows, width=args.width, quick=args.quick, repeats=args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
