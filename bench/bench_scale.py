"""Scale, not just speed: conversion of 10M rows against 1M (peak RSS and rate), of a 1 GB CSV against a tenth
of it (peak RSS), and the input pipeline and the shard planner at 10,000 shards. Printed by `make bench` (and recorded), never asserted in tests.

Each conversion runs in a fresh process (it imports no TensorFlow), so its peak RSS is its own; the two sizes
alternate (1M, 10M, 1M, 10M ...) for `repeats` rounds, medians recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import budget, case, interleaved
from bench.bench_conversion import PARQUET_MEMORY_BOUND, write_csv, write_source

_PROBE = """
import json, sys, time
from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
start = time.perf_counter()
manifest = convert(DataConfig(source=sys.argv[1], label="label"), sys.argv[2])
seconds = time.perf_counter() - start
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_kb / 1024,
                  "rows": manifest.num_records("train") + manifest.num_records("eval")}))
"""


def _convert_in_fresh_process(source: str, output_root: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    shutil.rmtree(output_root, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", _PROBE, source, output_root], check=True, capture_output=True,
                          text=True, env=env)
    shutil.rmtree(output_root, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _input_at(num_shards: int, rows: int, width: int, directory: str) -> float:
    """Rows/s of `create_dataset` (batch 256) over `rows` rows in `num_shards` files."""
    from bench.bench_input import _manifest, _write_records, drain
    from pipeline_lib.training import input_pipeline

    names = [f"part-{i:05d}.tfrecord" for i in range(num_shards)]
    os.makedirs(directory, exist_ok=True)
    layout = _write_records([os.path.join(directory, n) for n in names], rows, width)
    manifest = _manifest(directory, names, width, rows, layout)
    return drain(input_pipeline.create_dataset(manifest, "train", 256), lambda e: e[1])[0]


def run(rows: int = 10_000_000, width: int = 32, quick: bool = False, repeats: int = 3) -> list[dict]:
    from bench.bench_planning import synthetic_manifest
    from pipeline_lib.planning.sharding import plan_shards

    if quick:
        rows, repeats = min(rows, 200_000), 1
    small_rows = rows // 10
    work = tempfile.mkdtemp(prefix="tfdag-bench-scale-")
    try:
        sources = {"1x": os.path.join(work, "small.parquet"), "10x": os.path.join(work, "big.parquet")}
        write_source(sources["1x"], small_rows, width, seed=1)
        write_source(sources["10x"], rows, width, seed=2)
        results: dict[str, list[dict]] = {"1x": [], "10x": []}

        def converted(size: str):
            def step() -> float:
                results[size].append(_convert_in_fresh_process(sources[size], os.path.join(work, f"out-{size}")))
                return results[size][-1]["rows"] / results[size][-1]["seconds"]
            return step

        rates = interleaved({"1x": converted("1x"), "10x": converted("10x")}, repeats)
        rss = {size: [r["peak_rss_mb"] for r in results[size]] for size in results}
        print(f"scale: conversion of {small_rows:,} and {rows:,} rows x {width} floats in fresh processes, "
              f"{repeats} rounds: {np.median(rates['1x']):,.0f} and {np.median(rates['10x']):,.0f} rows/s, peak RSS "
              f"{np.median(rss['1x']):.0f} and {np.median(rss['10x']):.0f} MB")
        for path in sources.values():
            os.remove(path)
        # A CSV of about 1 GB (233 bytes a line), against a tenth of it: read in blocks of lines, memory stays flat.
        csv_rows = 20_000 if quick else 4_300_000
        csv_sources = {"1x": os.path.join(work, "small.csv"), "10x": os.path.join(work, "big.csv")}
        write_csv(csv_sources["1x"], csv_rows // 10, width, seed=4)
        write_csv(csv_sources["10x"], csv_rows, width, seed=5)
        csv_gb = os.path.getsize(csv_sources["10x"]) / 1e9
        csv_results: dict[str, list[dict]] = {"1x": [], "10x": []}
        for _ in range(repeats):
            for size in ("1x", "10x"):
                csv_results[size].append(_convert_in_fresh_process(csv_sources[size], os.path.join(work, "out-csv")))
        csv_rss = {size: [r["peak_rss_mb"] for r in csv_results[size]] for size in csv_results}
        csv_rate = [r["rows"] / r["seconds"] for r in csv_results["10x"]]
        print(f"scale: conversion of a {csv_gb:.2f} GB CSV ({csv_rows:,} rows) in a fresh process: "
              f"{np.median(csv_rate):,.0f} rows/s, peak RSS {np.median(csv_rss['10x']):.0f} MB (a tenth of it: "
              f"{np.median(csv_rss['1x']):.0f} MB)")
        for path in csv_sources.values():
            os.remove(path)
        input_rows = 20_000 if quick else 1_000_000
        few = _input_at(8, input_rows, width, os.path.join(work, "input-8"))
        many = _input_at(10_000, input_rows, width, os.path.join(work, "input-10000"))
        print(f"scale: create_dataset batch 256 over {input_rows:,} rows in 8 files {few:,.0f} rows/s, in 10,000 "
              f"files {many:,.0f} rows/s")
        manifest = synthetic_manifest(10_000)
        plan_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            plan_shards(manifest, num_workers=64, replicas_per_worker=1, per_replica_batch_size=32, epochs=1)
            plan_s.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [
        case(f"conversion rate at {rows:,} rows vs {small_rows:,} (rows/s)", rates["10x"], rates["1x"], 0.9,
             unit="rows/s", baseline_name=f"the same conversion of {small_rows:,} rows",
             bound="streaming by row group and batch: only the disk's sustained write rate changes with size."),
        case(f"conversion peak RSS at {rows:,} rows vs {small_rows:,} (MB)", rss["10x"], rss["1x"], 1 / 1.1,
             higher_is_better=False, unit="MB", baseline_name=f"peak RSS at {small_rows:,} rows",
             bound=PARQUET_MEMORY_BOUND),
        case(f"conversion peak RSS, {csv_gb:.2f} GB CSV vs a tenth of it (MB)", csv_rss["10x"], csv_rss["1x"], 0.67,
             higher_is_better=False, unit="MB", baseline_name=f"peak RSS at {csv_rows // 10:,} rows",
             bound="blocks of read_chunk_rows lines: one read ahead, one parsed, one converted, four encoded "
                   "parts of 4 MiB queued, whatever the file's size."),
        case("create_dataset over 10,000 shards vs 8, same rows (rows/s)", [many], [few], 0.9, unit="rows/s",
             baseline_name="the same rows in 8 files",
             bound="opening a file per shard, one after the other, in tf.data's reader."),
        budget("plan 10,000 shards over 64 workers (s)", plan_s, 1.0,
               bound="a budget: pure Python over the manifest's shard list."),
    ]
