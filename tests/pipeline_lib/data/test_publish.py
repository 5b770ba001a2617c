"""Publishing: manifest last (a crash leaves no manifest), durable directory entries, reuse."""

from __future__ import annotations

import logging
import os

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from pipeline_lib.config import DataConfig
from pipeline_lib.core import storage
from pipeline_lib.core.errors import is_transient
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import MANIFEST_NAME
from tests.pipeline_lib.data.conversion_support import make_rows, read_all, write_csv


class _Injected(RuntimeError):
    pass


def test_crash_after_first_published_shard_leaves_no_manifest_and_rerun_completes(tmp_path, monkeypatch):
    source = write_csv(tmp_path / "a.csv", make_rows(2000))
    data = DataConfig(source=source, label="y", target_shard_mb=0.01)
    real_replace = os.replace
    calls = {"n": 0}

    def crash_after_first(src, dst):
        real_replace(src, dst)
        calls["n"] += 1
        if calls["n"] == 1:
            raise _Injected("killed after the first shard was published")

    monkeypatch.setattr(os, "replace", crash_after_first)
    with pytest.raises(_Injected):
        convert(data, str(tmp_path / "out"))
    monkeypatch.setattr(os, "replace", real_replace)
    data_dir = tmp_path / "out" / "data"
    (dataset,) = [p for p in data_dir.iterdir() if not p.name.startswith(".")]
    published = list(dataset.rglob("*.tfrecord"))
    assert len(published) == 1
    assert not (dataset / MANIFEST_NAME).exists()
    assert not any(p.name.startswith(".staging") for p in data_dir.iterdir())

    manifest = convert(data, str(tmp_path / "out"))
    assert (dataset / MANIFEST_NAME).exists()
    assert len(list(dataset.rglob("*.tfrecord"))) == len(manifest.shards) > 1
    assert sorted(read_all(manifest)["id"].tolist()) == list(range(2000))


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
    source = write_csv(tmp_path / "a.csv", make_rows(300))
    manifest = convert(DataConfig(source=source, label="y"), str(tmp_path / "out"))
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
            convert(data, "memory://crash-test/out")
        assert fs.glob("/crash-test/out/data/*/train/*.tfrecord")  # shards and schema were published
        assert not fs.glob(f"/crash-test/out/data/*/{MANIFEST_NAME}")
        monkeypatch.setattr(storage, "write_bytes_atomic", real_write)
        manifest = convert(data, "memory://crash-test/out")
        assert fs.exists(f"/crash-test/out/data/{manifest.fingerprint}/{MANIFEST_NAME}")
        assert manifest.num_records("train") + manifest.num_records("eval") == 3000
    finally:
        fs.rm("/crash-test", recursive=True)


def test_rerun_on_unchanged_input_reuses_the_set(tmp_path, caplog):
    source = write_csv(tmp_path / "a.csv", make_rows(100))
    data = DataConfig(source=source, label="y")
    first = convert(data, str(tmp_path / "out"))
    manifest_path = tmp_path / "out" / "data" / first.fingerprint / MANIFEST_NAME
    before = manifest_path.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="pipeline_lib.data.convert"):
        second = convert(data, str(tmp_path / "out"))
    assert second == first
    assert manifest_path.stat().st_mtime_ns == before
    assert "reusing" in caplog.text
    # A changed source or a changed setting gets a new fingerprint and a new set.
    assert convert(data.model_copy(update={"target_shard_mb": 1.0}), str(tmp_path / "out")).fingerprint \
        != first.fingerprint
    write_csv(tmp_path / "a.csv", make_rows(101))
    assert convert(data, str(tmp_path / "out")).fingerprint != first.fingerprint


def test_an_outage_while_uploading_shards_is_retryable_and_the_retry_replaces_the_partial_set(tmp_path, monkeypatch):
    """The upload fails after the first shard: a StorageUnavailable (retried by the stage, never a ConversionError)
    with no manifest and no staging left behind; the next attempt removes the partial set and publishes it whole."""
    fs = fsspec.filesystem("memory")
    source = write_csv(tmp_path / "a.csv", make_rows(2000))
    data = DataConfig(source=source, label="y", target_shard_mb=0.01)
    real_put = MemoryFileSystem.put_file
    uploads = {"n": 0}

    def dropping_put(self, lpath, rpath, *args, **kwargs):
        uploads["n"] += 1
        if uploads["n"] == 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        return real_put(self, lpath, rpath, *args, **kwargs)

    try:
        monkeypatch.setattr(MemoryFileSystem, "put_file", dropping_put)
        with pytest.raises(storage.StorageUnavailable, match="publishing the shard set at 'memory://outage-test/out") \
                as caught:
            convert(data, "memory://outage-test/out")
        assert is_transient(caught.value) and not isinstance(caught.value, ConversionError)
        assert len(fs.glob("/outage-test/out/data/*/*/*.tfrecord")) == 1  # the partial set
        assert not fs.glob(f"/outage-test/out/data/*/{MANIFEST_NAME}")
        monkeypatch.setattr(MemoryFileSystem, "put_file", real_put)
        manifest = convert(data, "memory://outage-test/out")
        found = {p.split(f"{manifest.fingerprint}/", 1)[1] for p in fs.glob("/outage-test/out/data/*/*/*.tfrecord")}
        assert found == {s.path for s in manifest.shards} and len(found) > 2
        assert sorted(read_all(manifest)["id"].tolist()) == list(range(2000))
    finally:
        fs.rm("/outage-test", recursive=True)
