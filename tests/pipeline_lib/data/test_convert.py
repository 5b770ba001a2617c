"""The conversion stage end to end: gzip, memory:// sources and outputs, the recorded byte layout."""

from __future__ import annotations

import gzip
from pathlib import Path

import blake3
import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from pipeline_lib.config import DataConfig
from pipeline_lib.data import parallel_gzip
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import MANIFEST_NAME, load_manifest
from tests.pipeline_lib.data.conversion_support import make_rows, read_all, write_csv


def test_gzip_compression(tmp_path):
    source = write_csv(tmp_path / "a.csv", make_rows(300))
    manifest = convert(DataConfig(source=source, label="y", compression="gzip"), str(tmp_path / "out"))
    assert manifest.compression == "gzip"
    assert all(s.path.endswith(".tfrecord.gz") for s in manifest.shards)
    assert sorted(read_all(manifest)["id"].tolist()) == list(range(300))


def test_memory_source_and_output(tmp_path):
    fs = fsspec.filesystem("memory")
    rows = make_rows(120)
    table = pa.table({k: [r[k] for r in rows] for k in rows[0]})
    with fs.open("/conv-test/raw/a.parquet", "wb") as handle:
        pq.write_table(table, handle)
    try:
        manifest = convert(DataConfig(source="memory://conv-test/raw/*.parquet", label="y"),
                           "memory://conv-test/out")
        assert manifest.dataset_uri.startswith("memory://conv-test/out/data/")
        assert fs.exists(f"/conv-test/out/data/{manifest.fingerprint}/{MANIFEST_NAME}")
        assert load_manifest(manifest.dataset_uri) == manifest
        assert sorted(read_all(manifest)["id"].tolist()) == list(range(120))
    finally:
        fs.rm("/conv-test", recursive=True)


def _npz_manifest(tmp_path, name: str, **arrays):
    np.savez(tmp_path / f"{name}.npz", **arrays)
    return convert(DataConfig(source=str(tmp_path / f"{name}.npz"), label="label", read_chunk_rows=50),
                   str(tmp_path / name))


def test_the_manifest_records_the_byte_layout_only_when_every_record_has_it(tmp_path):
    n = 200
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    fixed = _npz_manifest(tmp_path, "fixed", x=x, label=np.arange(n) % 4)
    layout = fixed.record_layout
    assert layout is not None and [(f.name, f.count, f.varint_bytes) for f in layout.fields] == [("x", 3, 0), ("label", 1, 1)]
    for shard in fixed.shards:
        for record in tf.data.TFRecordDataset(fixed.shard_uri(shard)):
            assert len(record.numpy()) == layout.record_bytes
    # Labels up to 127 in the first chunks and up to 199 after: two varint lengths, so no single layout.
    mixed = _npz_manifest(tmp_path, "mixed", x=x, label=np.arange(n))
    assert mixed.record_layout is None
    assert sorted(read_all(mixed)["label"].tolist()) == list(range(n))
    with_strings = _npz_manifest(tmp_path, "strings", x=x, s=np.array([f"s{i}" for i in range(n)]), label=np.arange(n) % 4)
    assert with_strings.record_layout is None



def test_gzip_shards_compressed_in_parallel_read_back_and_match_the_manifest(tmp_path):
    """Shards of several 1 MiB blocks, deflated on the pool: tf.data reads them; sizes and digests match."""
    rng = np.random.default_rng(5)
    num_rows = 30_000
    path = tmp_path / "wide.csv"
    np.savetxt(path, np.column_stack([np.round(rng.normal(size=(num_rows, 16)), 2), np.arange(num_rows) % 3]),
               delimiter=",", fmt="%.2f", header=",".join([*(f"f{i}" for i in range(16)), "y"]), comments="")
    config = DataConfig(source=str(path), label="y", compression="gzip", compression_level=6, target_shard_mb=2.5)
    manifest = convert(config, str(tmp_path / "out"))
    assert len(manifest.shards_for("train")) >= 2 and manifest.shard_digest == "blake3"
    num_records, largest = 0, 0
    for shard in manifest.shards:
        local = Path(manifest.dataset_uri.removeprefix("file://"), shard.path)
        content = local.read_bytes()
        assert (len(content), blake3.blake3(content).hexdigest()) == (shard.num_bytes, shard.digest)
        largest = max(largest, len(gzip.decompress(content)))
        num_records += sum(1 for _ in tf.data.TFRecordDataset(str(local), compression_type="GZIP"))
    assert num_records == num_rows
    assert largest > parallel_gzip.BLOCK_BYTES  # several blocks a shard, so the pool had work side by side
    other = convert(config.model_copy(update={"compression_level": 1}), str(tmp_path / "out"))
    assert other.fingerprint != manifest.fingerprint  # the level changes the bytes, so the fingerprint
