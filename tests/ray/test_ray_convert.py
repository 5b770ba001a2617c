"""`data.engine: ray` on the test's Ray cluster (tests/ray/conftest.py): the same records and statistics as the local
engine (CSV with a string label and bad rows skipped; a Parquet file split by row groups, on moto's S3), a bad
record named with its file, line and node, and a node SIGKILLed mid-conversion."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline_lib.config import DataConfig, DataEngine, RayConfig
from pipeline_lib.core import storage
from pipeline_lib.data import ray_engine
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import Manifest, load_manifest
from pipeline_lib.data.statistics import load_statistics
from tests.ray.conftest import RAY_IP
from tests.ray.tables_support import lose_the_node_mid_way, write_csvs
from tests.stores.conftest import BUCKET


def _records(manifest: Manifest, split: str) -> list[bytes]:
    """Every serialized record of a split, in shard order (uncompressed TFRecord framing)."""
    out = []
    for shard in manifest.shards_for(split):
        fs, path = storage.get_fs(manifest.shard_uri(shard))
        payload = fs.cat_file(path)
        offset = 0
        while offset < len(payload):
            (length,) = struct.unpack_from("<Q", payload, offset)
            out.append(payload[offset + 12: offset + 12 + length])
            offset += 12 + length + 4
    return out


def _same_data(local: Manifest, on_ray: Manifest) -> None:
    assert on_ray.engine == "ray" and local.engine == "local"
    for split in ("train", "eval"):
        assert _records(on_ray, split) == _records(local, split), split
    assert on_ray.feature_schema == local.feature_schema
    assert on_ray.num_bad_records == local.num_bad_records
    assert sum(on_ray.nodes.values()) == len(on_ray.shards)
    want, got = load_statistics(local), load_statistics(on_ray)
    assert got.imputation.keys() == want.imputation.keys()
    for name, fill in want.imputation.items():
        assert got.imputation[name].fill_value == pytest.approx(fill.fill_value, rel=1e-9)
    for split, stats in want.splits.items():
        assert got.splits[split].num_rows == stats.num_rows
        for name, feature in stats.features.items():
            mine = got.splits[split].features[name]
            if feature.string is not None:
                assert mine.string == feature.string, name
                continue
            a, b = mine.numeric, feature.numeric
            assert (a.count, a.missing, a.min, a.max, a.sketch) == (b.count, b.missing, b.min, b.max, b.sketch), name
            assert a.mean == pytest.approx(b.mean, rel=1e-9) and a.variance == pytest.approx(b.variance, rel=1e-9)


def _config_file(tmp_path, ray_cluster, data: dict) -> str:
    path = tmp_path / "convert.yaml"
    path.write_text(yaml.safe_dump({
        "name": "ray-convert", "output_root": str(tmp_path / "on_ray"), "data": data,
        "train": {"ray": {"address": ray_cluster.address, "node_ip_address": RAY_IP}},
    }))
    return str(path)


def test_the_ray_engine_writes_the_local_engines_records_and_statistics(ray_cluster, tmp_path, capsys):
    from flows.cli import main

    source = write_csvs(tmp_path / "src", files=4, rows=1500, bad={1: 40, 3: 700})
    data = {"source": source, "label": "species", "on_bad_record": "skip", "read_chunk_rows": 256,
            "target_shard_mb": 0.02}
    local = convert(DataConfig(**data), str(tmp_path / "local"))

    assert main(["convert", _config_file(tmp_path, ray_cluster, {**data, "engine": "ray"})]) == 0
    summary = json.loads(capsys.readouterr().out)
    on_ray = load_manifest(summary["dataset_uri"])
    _same_data(local, on_ray)
    assert local.num_bad_records == 2 and on_ray.fingerprint != local.fingerprint
    assert summary["engine"] == "ray" and summary["nodes"] == on_ray.nodes and len(on_ray.nodes) >= 2, summary
    assert all(name.endswith(f"({RAY_IP})") for name in on_ray.nodes)
    assert len(on_ray.shards_for("train")) > 4  # rolled over within a task, not one shard per file
    left = sorted(os.listdir(tmp_path / "on_ray" / "data"))
    assert left == [on_ray.fingerprint], left  # no task's staging directory is left behind

    # Unchanged source and settings: the finished set is reused, not converted again.
    assert main(["convert", _config_file(tmp_path, ray_cluster, {**data, "engine": "ray"})]) == 0
    assert load_manifest(summary["dataset_uri"]).created_at == on_ray.created_at


def test_a_parquet_file_on_s3_splits_by_row_groups_into_the_same_records(ray_cluster, s3, tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    table = pa.table({"x": rng.normal(0, 1, 6000).astype(np.float32), "k": rng.integers(0, 1000, 6000),
                      "y": rng.integers(0, 4, 6000)})
    local_file = tmp_path / "data.parquet"
    pq.write_table(table, local_file, row_group_size=500)
    s3.fs.put_file(str(local_file), f"{BUCKET}/raw/data.parquet")
    metadata = pq.ParquetFile(local_file).metadata
    smallest = min(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
    monkeypatch.setattr(ray_engine, "UNIT_BYTES", 3 * smallest - 1)  # 3 row groups a task
    data = DataConfig(source=f"s3://{BUCKET}/raw/data.parquet", label="y", read_chunk_rows=400)
    local = convert(data, str(tmp_path / "local"))
    on_ray = convert(data.model_copy(update={"engine": DataEngine.RAY}), f"s3://{BUCKET}/out",
                     ray=RayConfig(address=ray_cluster.address, node_ip_address=RAY_IP))
    _same_data(local, on_ray)
    assert on_ray.dataset_uri.startswith(f"s3://{BUCKET}/out/data/")
    assert {s.path.split("-of-")[0].rsplit("-", 1)[0] for s in on_ray.shards_for("train")} == {
        f"train/part-{unit:05d}" for unit in range(4)}  # 12 row groups, 3 a task


def test_a_bad_record_on_a_node_is_named_with_its_file_line_and_node(ray_cluster, tmp_path):
    source = write_csvs(tmp_path / "src", files=3, rows=200, bad={2: 57})
    data = DataConfig(source=source, label="species", engine=DataEngine.RAY)
    with pytest.raises(ConversionError) as raised:
        convert(data, str(tmp_path / "out"), ray=RayConfig(address=ray_cluster.address, node_ip_address=RAY_IP))
    message = str(raised.value)
    assert f"{tmp_path / 'src' / 'part2.csv'} line 57, column 'x': value 'abc'" in message, message
    assert f"({RAY_IP})" in message and "on Ray node" in message and "data.on_bad_record: skip" in message
    data_dir = tmp_path / "out" / "data"
    assert not data_dir.exists() or os.listdir(data_dir) == [], os.listdir(data_dir)  # nothing half-written


def test_a_node_killed_mid_conversion_loses_nothing(ray_cluster, tmp_path):
    """A raylet SIGKILLed while its node converts a file: Ray reruns the task on a node that joins later, and the
    set ends complete, with the local engine's records."""
    source = write_csvs(tmp_path / "src", files=6, rows=6000)
    data = DataConfig(source=source, label="species", read_chunk_rows=200)
    local = convert(data, str(tmp_path / "local"))
    data_dir = tmp_path / "on_ray" / "data"

    def convert_on_ray(resources: dict[str, float]) -> Manifest:
        return convert(data.model_copy(update={"engine": DataEngine.RAY, "ray_resources": resources}),
                       str(tmp_path / "on_ray"), ray=RayConfig(address=ray_cluster.address, node_ip_address=RAY_IP))

    def converting() -> bool:  # a unit's staging directory: a task is converting on the only node that may run one
        return data_dir.exists() and any(p.startswith(".staging-") for p in os.listdir(data_dir))

    on_ray, new_node = lose_the_node_mid_way(ray_cluster, "tfdag_convert_kill", convert_on_ray, converting)
    _same_data(local, on_ray)
    assert any(name.startswith(new_node[:12]) for name in on_ray.nodes), on_ray.nodes
    assert sorted(os.listdir(tmp_path / "on_ray" / "data")) == [on_ray.fingerprint]  # the lost task's staging too
