"""bench.profile_conversion: every phase of a small conversion is timed, and the wrapped functions are restored."""

from __future__ import annotations

import time

import pyarrow.parquet as pq

from bench import profile_conversion
from pipeline_lib.data import chunk_conversion, tfrecord_writer


def test_a_parquet_profile_times_every_phase_and_restores_the_library(capsys):
    originals = (pq.ParquetFile.read_row_group, chunk_conversion.encode_tfrecord_parts, tfrecord_writer.new_digest)
    times = profile_conversion.profile("wide", rows=3000, width=4)
    called = {phase for phase, calls in times.calls.items() if calls}
    assert {"read+decode (Parquet row groups)", "split hash", "statistics", "encode+frame+CRC32C", "digest",
            "write: copy to the aligned buffer (writer thread)",
            "O_DIRECT write() calls (device thread, shards' tails)", "shard close (fsync)"} <= called
    assert all(times.cpu[phase] >= 0 and times.wall[phase] > 0 for phase in called)
    assert (pq.ParquetFile.read_row_group, chunk_conversion.encode_tfrecord_parts, tfrecord_writer.new_digest) == originals
    printed = capsys.readouterr().out
    assert "conversion profile: wide, 3000 rows" in printed and "digest blake3" in printed
    assert "digest alone: sha256" in printed and "digest alone: blake3" in printed


def test_a_gzip_csv_profile_times_the_inflating_read_and_the_parse(capsys):
    times = profile_conversion.profile("csv_gz", rows=2000, width=4)
    assert times.calls["read (records; inflate for .gz)"] and times.calls["parse (C loop, or Arrow CSV: this thread; Arrow's pool in the rest)"]


def test_a_phase_timed_inside_another_counts_once():
    times = profile_conversion.PhaseTimes()
    inner = times.timed("write", lambda: time.sleep(0.2))

    def close():
        time.sleep(0.02)
        inner()

    start = time.perf_counter()
    times.timed("close", close)()
    total = time.perf_counter() - start
    assert times.wall["write"] >= 0.2 and times.wall["close"] < 0.1
    assert times.wall["write"] + times.wall["close"] <= total
