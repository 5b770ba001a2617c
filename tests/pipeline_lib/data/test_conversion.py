"""Conversion to TFRecords: schema inference, deterministic split, manifest-last atomicity, bad rows, reuse."""

from __future__ import annotations

import json
import logging
import os
import random

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from pipeline_lib.config import DataConfig
from pipeline_lib.core import storage
from pipeline_lib.data import conversion
from pipeline_lib.data.manifest import (
    MANIFEST_NAME,
    SCHEMA_NAME,
    DType,
    FeatureSpec,
    load_manifest,
)
from pipeline_lib.training.input_pipeline import feature_description


def _rows(num_rows: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"id": i, "x": round(rng.uniform(-5, 5), 3), "n": rng.randint(-1000, 1000),
         "color": rng.choice(["red", "grün", "", "blue"]), "y": rng.randint(0, 2)}
        for i in range(num_rows)
    ]


def _write_csv(path, rows: list[dict], header=("id", "x", "n", "color", "y")) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(",".join(header) + "\n")
        handle.writelines(",".join(str(row[c]) for c in header) + "\n" for row in rows)
    return str(path)


def _read_all(manifest, split: str | None = None) -> dict[str, np.ndarray]:
    """Every record of the set (or of one split), parsed with the manifest's schema."""
    splits = [split] if split else ["train", "eval"]
    uris = [manifest.shard_uri(s) for sp in splits for s in manifest.shards_for(sp)]
    compression = "GZIP" if manifest.compression == "gzip" else ""
    if any("://" in u and not u.startswith("file://") for u in uris):
        local = []
        for i, uri in enumerate(uris):
            fs, path = storage.get_fs(uri)
            target = f"/tmp/_tfdag_read_{os.getpid()}_{i}"
            fs.get_file(path, target)
            local.append(target)
        uris = local
    dataset = tf.data.TFRecordDataset(uris, compression_type=compression).batch(100_000)
    parsed = {k: [] for k in feature_description(manifest.feature_schema)}
    for batch in dataset:
        for name, value in tf.io.parse_example(batch, feature_description(manifest.feature_schema)).items():
            parsed[name].append(value.numpy())
    return {k: np.concatenate(v) if v else np.array([]) for k, v in parsed.items()}


def _split_of_ids(manifest) -> dict[int, str]:
    out = {}
    for split in ("train", "eval"):
        for row_id in _read_all(manifest, split)["id"].tolist():
            out[row_id] = split
    return out


# --- schema inference per format ------------------------------------------------------------------------------


def test_csv_schema_inference_and_values(tmp_path):
    rows = _rows(200)
    source = _write_csv(tmp_path / "a.csv", rows)
    manifest = conversion.convert(DataConfig(source=source, label="y"), str(tmp_path / "out"))
    schema = manifest.feature_schema
    assert schema.features == (
        FeatureSpec(name="id", dtype=DType.INT64), FeatureSpec(name="x", dtype=DType.FLOAT32),
        FeatureSpec(name="n", dtype=DType.INT64), FeatureSpec(name="color", dtype=DType.STRING),
    )
    assert schema.label == FeatureSpec(name="y", dtype=DType.INT64)
    assert schema.num_classes == max(r["y"] for r in rows) + 1
    parsed = _read_all(manifest)
    order = np.argsort(parsed["id"])
    assert parsed["id"][order].tolist() == list(range(200))
    np.testing.assert_array_equal(parsed["x"][order], np.array([r["x"] for r in rows], np.float32))
    assert parsed["n"][order].tolist() == [r["n"] for r in rows]
    assert [c.decode() for c in parsed["color"][order]] == [r["color"] for r in rows]  # "" and unicode kept
    assert parsed["y"][order].tolist() == [r["y"] for r in rows]
    saved = json.loads((tmp_path / "out" / "data" / manifest.fingerprint / SCHEMA_NAME).read_text())
    assert saved["label"]["name"] == "y"
    assert manifest.num_records("train") + manifest.num_records("eval") == 200
    assert manifest.dataset_uri == storage.join(str(tmp_path / "out"), "data", manifest.fingerprint)


def test_parquet_schema_inference_with_vectors(tmp_path):
    n = 50
    vectors = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 7
    table = pa.table({
        "i8": pa.array(np.arange(n) - 25, pa.int8()),
        "f64": pa.array(np.linspace(0, 1, n)),
        "s": pa.array([f"s{i}" for i in range(n)]),
        "vec": pa.array(list(vectors), pa.list_(pa.float32())),
        "ivec": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 2), pa.int64()), 2),
        "flag": pa.array([i % 2 == 0 for i in range(n)]),
        "label": pa.array([float(i) / 10 for i in range(n)]),  # float label: regression
    })
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=16)
    manifest = conversion.convert(DataConfig(source=str(tmp_path / "t.parquet"), label="label", read_chunk_rows=7),
                                  str(tmp_path / "out"))
    specs = {f.name: (f.dtype, f.shape) for f in manifest.feature_schema.features}
    assert specs == {"i8": (DType.INT64, ()), "f64": (DType.FLOAT32, ()), "s": (DType.STRING, ()),
                     "vec": (DType.FLOAT32, (3,)), "ivec": (DType.INT64, (2,)), "flag": (DType.INT64, ())}
    assert manifest.feature_schema.label.dtype == DType.FLOAT32
    assert manifest.feature_schema.num_classes is None
    parsed = _read_all(manifest)
    order = np.argsort(parsed["i8"])
    np.testing.assert_array_equal(parsed["vec"][order], vectors)
    np.testing.assert_array_equal(parsed["ivec"][order], np.arange(n * 2).reshape(n, 2))
    assert parsed["flag"][order].tolist() == [int(i % 2 == 0) for i in range(n)]


def _row_group_parquet(path, group_sizes: list[int], short_at: int | None = None) -> int:
    """A Parquet file with one row group per entry of group_sizes: a vector `v` of 3 float32 (row i holds
    3i, 3i+1, 3i+2), a string `s` and an int label `y`. `v` is a fixed-size list column, or with `short_at` a
    variable list column whose row short_at (0-based) holds 2 values. Returns the number of rows."""
    v_type = pa.list_(pa.float32()) if short_at is not None else pa.list_(pa.float32(), 3)
    schema = pa.schema([("v", v_type), ("s", pa.string()), ("y", pa.int64())])
    start = 0
    with pq.ParquetWriter(path, schema) as writer:
        for size in group_sizes:
            ids = np.arange(start, start + size)
            values = (ids[:, None] * 3 + np.arange(3)).astype(np.float32)
            if short_at is None:
                v = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3)
            else:
                v = pa.array([row[:2] if i == short_at else row for i, row in zip(ids, values.tolist())], v_type)
            writer.write_table(pa.table({"v": v, "s": [f"s{i}" for i in ids], "y": ids % 3}, schema=schema))
            start += size
    return start


@pytest.mark.parametrize("whole_bytes", ["default", "mixed", "none"])
def test_parquet_row_groups_read_whole_ahead_or_batch_by_batch_give_the_same_shards(tmp_path, monkeypatch,
                                                                                     whole_bytes):
    """Row groups small enough are decoded whole (the next one on a helper thread), larger ones batch by batch:
    either way every row arrives once, in file order, so the shards are byte-identical to a batch-wise read."""
    sizes = [70, 5, 130, 1, 64, 33]
    source = tmp_path / "g.parquet"
    total = _row_group_parquet(source, sizes)
    data = DataConfig(source=str(source), label="y", read_chunk_rows=32, target_shard_mb=0.002)

    default_limit = conversion._WHOLE_ROW_GROUP_BYTES
    monkeypatch.setattr(conversion, "_WHOLE_ROW_GROUP_BYTES", 0)  # the reference: every group batch by batch
    reference = conversion.convert(data, str(tmp_path / "reference"))

    meta = pq.ParquetFile(source).metadata
    group_bytes = [sum(meta.row_group(g).column(c).total_uncompressed_size for c in range(meta.num_columns))
                   for g in range(meta.num_row_groups)]
    limit = {"default": default_limit,
             "mixed": sorted(group_bytes)[len(group_bytes) // 2], "none": 0}[whole_bytes]
    monkeypatch.setattr(conversion, "_WHOLE_ROW_GROUP_BYTES", limit)
    calls = {"whole": 0, "batches": 0}
    real_read, real_iter = pq.ParquetFile.read_row_group, pq.ParquetFile.iter_batches

    def read_row_group(self, *args, **kwargs):
        calls["whole"] += 1
        return real_read(self, *args, **kwargs)

    def iter_batches(self, *args, **kwargs):
        calls["batches"] += 1
        return real_iter(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    manifest = conversion.convert(data, str(tmp_path / whole_bytes))
    whole = sum(size <= limit for size in group_bytes)
    assert calls == {"whole": whole, "batches": len(sizes) - whole}
    if whole_bytes == "mixed":
        assert 0 < whole < len(sizes)
    assert [(s.split, s.num_records, s.sha256) for s in manifest.shards] == \
        [(s.split, s.num_records, s.sha256) for s in reference.shards]
    assert len(manifest.shards) > 2
    parsed = _read_all(manifest)
    ids = parsed["v"][:, 0].astype(np.int64) // 3
    assert sorted(ids.tolist()) == list(range(total))
    np.testing.assert_array_equal(parsed["v"], (ids[:, None] * 3 + np.arange(3)).astype(np.float32))
    assert [s.decode() for s in parsed["s"]] == [f"s{i}" for i in ids]


@pytest.mark.parametrize("whole_bytes", [128 << 20, 0])
def test_a_bad_parquet_row_past_the_first_groups_is_named_by_its_row_and_stops_the_decoder(tmp_path, monkeypatch,
                                                                                          whole_bytes):
    import threading

    monkeypatch.setattr(conversion, "_WHOLE_ROW_GROUP_BYTES", whole_bytes)
    source = tmp_path / "bad.parquet"
    _row_group_parquet(source, [40, 40, 40, 40, 40], short_at=97)  # 0-based row 97 is row 98 of the file
    with pytest.raises(conversion.ConversionError) as error:
        conversion.convert(DataConfig(source=str(source), label="y", read_chunk_rows=16), str(tmp_path / "out"))
    assert "bad.parquet row 98" in str(error.value) and "column 'v'" in str(error.value)
    assert "length 3" in str(error.value)
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("tfdag-parquet", "tfdag-read"))]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob(MANIFEST_NAME))
    skipped = conversion.convert(DataConfig(source=str(source), label="y", read_chunk_rows=16, on_bad_record="skip"),
                                 str(tmp_path / "skip"))
    assert skipped.num_bad_records == 1
    assert skipped.num_records("train") + skipped.num_records("eval") == 199


def test_jsonl_schema_inference_with_vectors_and_string_labels(tmp_path):
    path = tmp_path / "d.jsonl"
    labels = ["cat", "dog", "ant"]
    with open(path, "w") as handle:
        for i in range(60):
            handle.write(json.dumps({"k": i, "v": [i, i + 0.5], "iv": [i, -i, 7], "t": f"é{i}",
                                     "animal": labels[i % 3]}) + "\n")
            if i == 10:
                handle.write("\n")  # blank lines are skipped
    manifest = conversion.convert(DataConfig(source=str(path), label="animal", read_chunk_rows=16),
                                  str(tmp_path / "out"))
    schema = manifest.feature_schema
    assert {f.name: (f.dtype, f.shape) for f in schema.features} == {
        "k": (DType.INT64, ()), "v": (DType.FLOAT32, (2,)), "iv": (DType.INT64, (3,)), "t": (DType.STRING, ())}
    assert schema.label_vocabulary == ("ant", "cat", "dog")
    assert schema.num_classes == 3 and schema.label.dtype == DType.INT64
    parsed = _read_all(manifest)
    order = np.argsort(parsed["k"])
    assert parsed["animal"][order].tolist() == [sorted(labels).index(labels[i % 3]) for i in range(60)]
    np.testing.assert_array_equal(parsed["v"][order][:, 1], np.arange(60) + 0.5)


def test_npz_schema_inference_streams_each_array(tmp_path):
    n = 40
    images = np.random.default_rng(0).normal(size=(n, 5)).astype(np.float64)
    np.savez_compressed(tmp_path / "d.npz", image=images, count=np.arange(n, dtype=np.int32),
                        name=np.array([f"n{i}" for i in range(n)]), label=np.arange(n) % 4)
    manifest = conversion.convert(DataConfig(source=str(tmp_path / "d.npz"), label="label", read_chunk_rows=9),
                                  str(tmp_path / "out"))
    schema = manifest.feature_schema
    assert {f.name: (f.dtype, f.shape) for f in schema.features} == {
        "image": (DType.FLOAT32, (5,)), "count": (DType.INT64, ()), "name": (DType.STRING, ())}
    assert schema.num_classes == 4
    parsed = _read_all(manifest)
    order = np.argsort(parsed["count"])
    np.testing.assert_array_equal(parsed["image"][order], images.astype(np.float32))
    assert [v.decode() for v in parsed["name"][order]] == [f"n{i}" for i in range(n)]


def test_features_selection_and_unknown_columns(tmp_path):
    source = _write_csv(tmp_path / "a.csv", _rows(20))
    manifest = conversion.convert(DataConfig(source=source, label="y", features=("x", "color")),
                                  str(tmp_path / "out"))
    assert manifest.feature_schema.feature_names == ("x", "color")
    with pytest.raises(conversion.ConversionError) as error:
        conversion.convert(DataConfig(source=source, label="y", features=("x", "colour")), str(tmp_path / "out"))
    assert "colour" in str(error.value) and "['id', 'x', 'n', 'color', 'y']" in str(error.value)
    with pytest.raises(conversion.ConversionError, match="data.label 'target' is not a column"):
        conversion.convert(DataConfig(source=source, label="target"), str(tmp_path / "out"))


def test_source_matching_nothing_names_the_uri(tmp_path):
    uri = str(tmp_path / "raw" / "*.csv")
    with pytest.raises(conversion.ConversionError) as error:
        conversion.convert(DataConfig(source=uri, label="y"), str(tmp_path / "out"))
    assert uri in str(error.value) and "matches no files" in str(error.value)


# --- deterministic split -------------------------------------------------------------------------------------


def test_split_is_deterministic_across_chunk_sizes_and_row_order(tmp_path):
    rows = _rows(600, seed=1)
    first = _write_csv(tmp_path / "ordered.csv", rows)
    shuffled = rows[:]
    random.Random(9).shuffle(shuffled)
    second = _write_csv(tmp_path / "shuffled.csv", shuffled)
    splits = []
    for source, chunk in ((first, 65536), (first, 7), (second, 50)):
        out = tmp_path / f"out-{chunk}-{os.path.basename(source)}"
        manifest = conversion.convert(DataConfig(source=source, label="y", read_chunk_rows=chunk), str(out))
        splits.append(_split_of_ids(manifest))
    assert splits[0] == splits[1] == splits[2]
    num_eval = sum(1 for s in splits[0].values() if s == "eval")
    assert 0.12 < num_eval / 600 < 0.28  # eval_fraction 0.2


def test_split_by_key_columns_keeps_keys_together(tmp_path):
    rows = _rows(300, seed=2)
    for row in rows:
        row["user"] = row["id"] % 30
    source = _write_csv(tmp_path / "a.csv", rows, header=("id", "user", "x", "n", "color", "y"))
    data = DataConfig(source=source, label="y", split={"key_columns": ["user"], "eval_fraction": 0.3, "seed": 4})
    manifest = conversion.convert(data, str(tmp_path / "out"))
    by_id = _split_of_ids(manifest)
    per_user: dict[int, set] = {}
    for row in rows:
        per_user.setdefault(row["user"], set()).add(by_id[row["id"]])
    assert all(len(s) == 1 for s in per_user.values())
    assert {next(iter(s)) for s in per_user.values()} == {"train", "eval"}


def test_split_seed_changes_the_split():
    columns = {"a": np.arange(1000, dtype=np.int64)}
    one = conversion.eval_mask(conversion.split_hash(columns, 0), 0.5)
    two = conversion.eval_mask(conversion.split_hash(columns, 1), 0.5)
    assert (one != two).any()
    np.testing.assert_array_equal(one, conversion.eval_mask(conversion.split_hash(columns, 0), 0.5))
    # Hash of a row does not depend on the other rows of the chunk.
    np.testing.assert_array_equal(conversion.split_hash({"a": columns["a"][500:]}, 0),
                                  conversion.split_hash(columns, 0)[500:])


# --- shards, gzip, globs, memory://, atomicity, reuse ---------------------------------------------------------


def test_shards_roll_over_at_target_size_and_glob_of_several_files(tmp_path):
    (tmp_path / "raw").mkdir()
    all_rows = _rows(3000, seed=3)
    for k in range(3):
        _write_csv(tmp_path / "raw" / f"part{k}.csv", all_rows[k * 1000 : (k + 1) * 1000])
    (tmp_path / "raw" / "notes.txt").write_text("ignored: not matched by the glob")
    data = DataConfig(source=str(tmp_path / "raw" / "*.csv"), label="y", target_shard_mb=0.02)
    manifest = conversion.convert(data, str(tmp_path / "out"))
    assert len(manifest.source.files) == 3
    train = manifest.shards_for("train")
    assert len(train) > 2
    assert [s.path for s in train] == [f"train/part-{i:05d}-of-{len(train):05d}.tfrecord" for i in range(len(train))]
    target = 0.02 * 1024 * 1024
    for shard in train[:-1]:
        assert target <= shard.num_bytes < target + 200  # rolled after the record that reached the target
    root = tmp_path / "out" / "data" / manifest.fingerprint
    for shard in manifest.shards:
        assert storage.sha256_local(str(root / shard.path)) == shard.sha256
        assert os.path.getsize(root / shard.path) == shard.num_bytes
    assert sorted(_read_all(manifest)["id"].tolist()) == list(range(3000))


def test_gzip_compression(tmp_path):
    source = _write_csv(tmp_path / "a.csv", _rows(300))
    manifest = conversion.convert(DataConfig(source=source, label="y", compression="gzip"), str(tmp_path / "out"))
    assert manifest.compression == "gzip"
    assert all(s.path.endswith(".tfrecord.gz") for s in manifest.shards)
    assert sorted(_read_all(manifest)["id"].tolist()) == list(range(300))


def test_memory_source_and_output(tmp_path):
    fs = fsspec.filesystem("memory")
    rows = _rows(120)
    table = pa.table({k: [r[k] for r in rows] for k in rows[0]})
    with fs.open("/conv-test/raw/a.parquet", "wb") as handle:
        pq.write_table(table, handle)
    try:
        manifest = conversion.convert(DataConfig(source="memory://conv-test/raw/*.parquet", label="y"),
                                      "memory://conv-test/out")
        assert manifest.dataset_uri.startswith("memory://conv-test/out/data/")
        assert fs.exists(f"/conv-test/out/data/{manifest.fingerprint}/{MANIFEST_NAME}")
        assert load_manifest(manifest.dataset_uri) == manifest
        assert sorted(_read_all(manifest)["id"].tolist()) == list(range(120))
    finally:
        fs.rm("/conv-test", recursive=True)


class _Injected(RuntimeError):
    pass


def test_crash_after_first_published_shard_leaves_no_manifest_and_rerun_completes(tmp_path, monkeypatch):
    source = _write_csv(tmp_path / "a.csv", _rows(2000))
    data = DataConfig(source=source, label="y", target_shard_mb=0.01)
    real_replace = os.replace
    calls = {"n": 0}

    def crash_after_first(src, dst):
        real_replace(src, dst)
        calls["n"] += 1
        if calls["n"] == 1:
            raise _Injected("killed after the first shard was published")

    monkeypatch.setattr(conversion.os, "replace", crash_after_first)
    with pytest.raises(_Injected):
        conversion.convert(data, str(tmp_path / "out"))
    monkeypatch.setattr(conversion.os, "replace", real_replace)
    data_dir = tmp_path / "out" / "data"
    (dataset,) = [p for p in data_dir.iterdir() if not p.name.startswith(".")]
    published = list(dataset.rglob("*.tfrecord"))
    assert len(published) == 1
    assert not (dataset / MANIFEST_NAME).exists()
    assert not any(p.name.startswith(".staging") for p in data_dir.iterdir())

    manifest = conversion.convert(data, str(tmp_path / "out"))
    assert (dataset / MANIFEST_NAME).exists()
    assert len(list(dataset.rglob("*.tfrecord"))) == len(manifest.shards) > 1
    assert sorted(_read_all(manifest)["id"].tolist()) == list(range(2000))


@pytest.mark.parametrize("then_bad_row", [False, True])
def test_a_failed_shard_write_with_a_batch_queued_behind_it_publishes_nothing(tmp_path, monkeypatch, then_bad_row):
    """Two encoded batches may wait for the writer thread. The queue never holds more; when a write fails, the
    one queued behind it finishes before the shards are aborted and the staging directory removed. With
    `then_bad_row` the failure is found only after a bad row two chunks later stopped the conversion, with both
    writes still queued: that error is raised, and both writes are still waited for."""
    import threading
    import time

    rows = _rows(3000)
    if then_bad_row:
        rows[750]["x"] = "oops"  # chunk 8 of 100 rows: writes 6 (failing) and 7 are queued when it is read
    source = _write_csv(tmp_path / "a.csv", rows)
    data = DataConfig(source=source, label="y", read_chunk_rows=100, target_shard_mb=0.01)
    state = {"writes": 0, "queued_max": 0, "after_failure": 0, "failed": False}
    events: list[str] = []
    lock = threading.Lock()
    real_write, real_submit = conversion._BackgroundWrites._write, conversion._BackgroundWrites.submit

    def slow_write(parts):
        with lock:
            state["writes"] += 1
            number = state["writes"]
            if state["failed"]:
                state["after_failure"] += 1
        time.sleep(0.01)  # a write slower than encoding: the queue fills
        if number == 6:
            state["failed"] = True
            raise OSError(28, "No space left on device")
        real_write(parts)
        if state["failed"]:
            events.append("queued write done")

    def submit(self, *args):
        real_submit(self, *args)
        state["queued_max"] = max(state["queued_max"], len(self._pending))

    real_abort = conversion._RollingShards.abort

    def abort(self):
        events.append("abort")
        real_abort(self)

    monkeypatch.setattr(conversion._BackgroundWrites, "_write", staticmethod(slow_write))
    monkeypatch.setattr(conversion._BackgroundWrites, "submit", submit)
    monkeypatch.setattr(conversion._RollingShards, "abort", abort)
    expected = (conversion.ConversionError, "a.csv line 752") if then_bad_row else (OSError, "No space left")
    with pytest.raises(expected[0], match=expected[1]):
        conversion.convert(data, str(tmp_path / "out"))
    assert state["queued_max"] == conversion._WRITES_IN_FLIGHT == 2
    assert state["after_failure"] == 1  # the batch queued behind the failed one ran to its end first
    assert events == ["queued write done", "abort", "abort"]
    data_dir = tmp_path / "out" / "data"
    assert not list(data_dir.rglob(MANIFEST_NAME)) and not list(data_dir.rglob("*.tfrecord"))
    assert not any(p.name.startswith(".staging") for p in data_dir.iterdir())

    monkeypatch.setattr(conversion._BackgroundWrites, "_write", staticmethod(real_write))
    manifest = conversion.convert(DataConfig(source=source, label="y", read_chunk_rows=100, target_shard_mb=0.01,
                                             on_bad_record="skip"), str(tmp_path / "out"))
    assert sorted(_read_all(manifest)["id"].tolist()) == [i for i in range(3000) if not (then_bad_row and i == 750)]


def test_local_publish_makes_every_new_directory_entry_durable_before_the_manifest(tmp_path, monkeypatch):
    """The shards' renames, the dataset directory's entry in data/ and data/'s entry in the output root are all
    fsynced before manifest.json is written: a crash after the manifest cannot lose a directory it names."""
    events: list[str] = []
    real_fsync_dir, real_write = storage.fsync_dir, storage.write_bytes_atomic

    def fsync_dir(path):
        events.append(os.path.relpath(path, tmp_path))
        real_fsync_dir(path)

    def write_bytes_atomic(fs, path, payload):
        events.append("write " + os.path.basename(path))
        real_write(fs, path, payload)

    monkeypatch.setattr(storage, "fsync_dir", fsync_dir)
    monkeypatch.setattr(storage, "write_bytes_atomic", write_bytes_atomic)
    source = _write_csv(tmp_path / "a.csv", _rows(300))
    manifest = conversion.convert(DataConfig(source=source, label="y"), str(tmp_path / "out"))
    dataset = os.path.join("out", "data", manifest.fingerprint)
    before_manifest = events[:events.index(f"write {MANIFEST_NAME}")]
    for directory in (os.path.join(dataset, "train"), os.path.join(dataset, "eval"), os.path.join("out", "data"),
                      "out"):
        assert directory in before_manifest, (directory, events)


def test_crash_on_object_store_leaves_no_manifest(monkeypatch):
    fs = fsspec.filesystem("memory")
    with fs.open("/crash-test/raw.csv", "wb") as handle:
        handle.write(b"a,y\n" + b"".join(f"{i},{i % 2}\n".encode() for i in range(3000)))
    data = DataConfig(source="memory://crash-test/raw.csv", label="y", target_shard_mb=0.01)
    real_write = storage.write_bytes_atomic

    def fail_on_manifest(target_fs, path, payload):
        if path.endswith(MANIFEST_NAME):
            raise _Injected("storage went away before the manifest")
        real_write(target_fs, path, payload)

    try:
        monkeypatch.setattr(storage, "write_bytes_atomic", fail_on_manifest)
        with pytest.raises(_Injected):
            conversion.convert(data, "memory://crash-test/out")
        assert fs.glob("/crash-test/out/data/*/train/*.tfrecord")  # shards and schema were published
        assert not fs.glob(f"/crash-test/out/data/*/{MANIFEST_NAME}")
        monkeypatch.setattr(storage, "write_bytes_atomic", real_write)
        manifest = conversion.convert(data, "memory://crash-test/out")
        assert fs.exists(f"/crash-test/out/data/{manifest.fingerprint}/{MANIFEST_NAME}")
        assert manifest.num_records("train") + manifest.num_records("eval") == 3000
    finally:
        fs.rm("/crash-test", recursive=True)


def test_rerun_on_unchanged_input_reuses_the_set(tmp_path, caplog):
    source = _write_csv(tmp_path / "a.csv", _rows(100))
    data = DataConfig(source=source, label="y")
    first = conversion.convert(data, str(tmp_path / "out"))
    manifest_path = tmp_path / "out" / "data" / first.fingerprint / MANIFEST_NAME
    before = manifest_path.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="pipeline_lib.data.conversion"):
        second = conversion.convert(data, str(tmp_path / "out"))
    assert second == first
    assert manifest_path.stat().st_mtime_ns == before
    assert "reusing" in caplog.text
    # A changed source or a changed setting gets a new fingerprint and a new set.
    assert conversion.convert(data.model_copy(update={"target_shard_mb": 1.0}), str(tmp_path / "out")).fingerprint \
        != first.fingerprint
    _write_csv(tmp_path / "a.csv", _rows(101))
    assert conversion.convert(data, str(tmp_path / "out")).fingerprint != first.fingerprint


# --- bad records ---------------------------------------------------------------------------------------------


def _csv_with_bad_rows(path) -> str:
    lines = ["id,size,color,y"] + [f"{i},{i % 5},red,{i % 2}" for i in range(1, 9)]
    lines[5] = "5,abc,red,1"  # line 6: not an int
    lines.insert(8, "")  # a blank line (line 9) is skipped, not counted
    lines[9] = "8,,blue,0"  # line 10: missing value
    lines.append("9,4,green")  # line 11: too few fields
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bad_value_fails_naming_file_line_column_and_value(tmp_path):
    source = _csv_with_bad_rows(tmp_path / "bad.csv")
    for chunk in (4, 3):  # the first chunk (lines 2-4 or 2-5) is clean, so 'size' is inferred as int64
        with pytest.raises(conversion.ConversionError) as error:
            conversion.convert(DataConfig(source=source, label="y", read_chunk_rows=chunk), str(tmp_path / "out"))
        message = str(error.value)
        assert "bad.csv line 6" in message and "column 'size'" in message and "'abc'" in message
        assert "on_bad_record: skip" in message
    assert not list((tmp_path / "out").rglob(MANIFEST_NAME))


def test_a_non_numeric_value_in_the_first_chunk_makes_the_column_a_string(tmp_path):
    source = _csv_with_bad_rows(tmp_path / "bad.csv")
    manifest = conversion.convert(DataConfig(source=source, label="y", on_bad_record="skip", read_chunk_rows=100),
                                  str(tmp_path / "out"))
    assert {f.name: f.dtype for f in manifest.feature_schema.features}["size"] == DType.STRING
    assert manifest.num_bad_records == 1  # only the row with too few fields


def test_bad_rows_skip_counts_them(tmp_path, caplog):
    source = _csv_with_bad_rows(tmp_path / "bad.csv")
    with caplog.at_level(logging.WARNING, logger="pipeline_lib.data.conversion"):
        manifest = conversion.convert(DataConfig(source=source, label="y", on_bad_record="skip", read_chunk_rows=4),
                                      str(tmp_path / "out"))
    assert manifest.num_bad_records == 3
    assert sorted(_read_all(manifest)["id"].tolist()) == [1, 2, 3, 4, 6, 7]
    assert "line 6" in caplog.text and "line 10" in caplog.text and "line 11" in caplog.text


def test_bad_rows_in_jsonl_and_parquet(tmp_path):
    path = tmp_path / "d.jsonl"
    records = [{"v": [1.0, 2.0], "y": 0}, {"v": [1.0, 2.0], "y": 1}, {"v": [3.0], "y": 0}, {"y": 1},
               {"v": [1.0, 2.0], "y": 2}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n{not json\n")
    with pytest.raises(conversion.ConversionError) as error:
        conversion.convert(DataConfig(source=str(path), label="y"), str(tmp_path / "out"))
    assert "d.jsonl line 3" in str(error.value) and "column 'v'" in str(error.value)
    assert "[3.0]" in str(error.value) and "length 2" in str(error.value)
    manifest = conversion.convert(DataConfig(source=str(path), label="y", on_bad_record="skip"), str(tmp_path / "o"))
    assert manifest.num_bad_records == 3 and manifest.feature_schema.num_classes == 3

    pq.write_table(pa.table({"a": pa.array([1.0, None, 3.0]), "y": pa.array([0, 1, -1])}), tmp_path / "p.parquet")
    with pytest.raises(conversion.ConversionError) as error:
        conversion.convert(DataConfig(source=str(tmp_path / "p.parquet"), label="y"), str(tmp_path / "out"))
    assert "p.parquet row 2" in str(error.value) and "column 'a'" in str(error.value) and "missing" in str(error.value)
    manifest = conversion.convert(DataConfig(source=str(tmp_path / "p.parquet"), label="y", on_bad_record="skip"),
                                  str(tmp_path / "o"))
    assert manifest.num_bad_records == 2  # the null and the negative class label


def _npz_manifest(tmp_path, name: str, **arrays):
    np.savez(tmp_path / f"{name}.npz", **arrays)
    return conversion.convert(DataConfig(source=str(tmp_path / f"{name}.npz"), label="label", read_chunk_rows=50),
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
    assert sorted(_read_all(mixed)["label"].tolist()) == list(range(n))
    with_strings = _npz_manifest(tmp_path, "strings", x=x, s=np.array([f"s{i}" for i in range(n)]), label=np.arange(n) % 4)
    assert with_strings.record_layout is None


def test_a_damaged_npz_member_fails_its_crc_and_writes_nothing(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.arange(4000, dtype=np.float32).reshape(1000, 4), label=np.arange(1000) % 3)
    damaged = bytearray(path.read_bytes())
    damaged[2000] ^= 0xFF  # inside the values of x.npy, past its header
    path.write_bytes(bytes(damaged))
    out = tmp_path / "out"
    with pytest.raises(conversion.ConversionError, match=r"d\.npz array 'x' is damaged: Bad CRC-32.*save the file again"):
        conversion.convert(DataConfig(source=str(path), label="label", read_chunk_rows=100), str(out))
    assert not (out / "data").exists() or not any((out / "data").rglob("*.tfrecord*"))
