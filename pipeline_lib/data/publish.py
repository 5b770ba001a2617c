"""Publishing a shard set: local staging, shards under their final names, schema.json and statistics.json,
manifest.json last; reuse."""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import posixpath
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from pipeline_lib.core import storage
from pipeline_lib.data.errors import raise_if_outage
from pipeline_lib.data.manifest import (
    MANIFEST_NAME,
    SCHEMA_NAME,
    Manifest,
    RecordLayout,
    Schema,
    ShardInfo,
    SourceFingerprint,
    load_manifest,
)
from pipeline_lib.data.shard_writer import SPLITS, StagedShard
from pipeline_lib.data.statistics import (
    STATISTICS_NAME,
    DatasetStatistics,
    statistics_bytes,
)
from pipeline_lib.data.tfrecord_writer import SHARD_DIGEST

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Destination:
    """Where a shard set goes: the output filesystem, the dataset's path on it, and its URI."""

    fs: Any
    path: str
    uri: str


def is_local_fs(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def path_join(fs):
    """os.path.join on the local filesystem (its paths are OS paths), posixpath.join on every other one."""
    return os.path.join if is_local_fs(fs) else posixpath.join


def create_staging_dir(out_fs, dataset_path: str, fingerprint: str) -> tuple[str, bool]:
    """A fresh local staging directory: next to the dataset for local output (publishing is a rename)."""
    if is_local_fs(out_fs):
        parent = os.path.dirname(dataset_path)
        os.makedirs(parent, exist_ok=True)
        for stale in os.listdir(parent):
            if stale.startswith(f".staging-{fingerprint}-"):
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        return tempfile.mkdtemp(prefix=f".staging-{fingerprint}-", dir=parent), True
    return tempfile.mkdtemp(prefix=f"tfdag-staging-{fingerprint}-"), False


def _shard_name(split: str, index: int, count: int, compression: str) -> str:
    suffix = ".tfrecord.gz" if compression == "gzip" else ".tfrecord"
    return f"{split}/part-{index:05d}-of-{count:05d}{suffix}"


def publish(out_fs, dataset_path: str, dataset_uri: str, staged: list[StagedShard], schema: Schema,
            source: SourceFingerprint, compression: str, num_bad_records: int,
            record_layout: RecordLayout | None, statistics: DatasetStatistics | None = None) -> Manifest:
    """Shards under their final names, then schema.json and statistics.json, then manifest.json last.

    A shard set without a manifest is incomplete: one left by an earlier failed attempt is removed first.

    Raises:
        StorageUnavailable: when the output storage does not answer (a retry may succeed; the next attempt
            removes the partial set).
    """
    try:
        return _write_shard_set(out_fs, dataset_path, dataset_uri, staged, schema, source, compression,
                                num_bad_records, record_layout, statistics)
    except Exception as error:  # re-raised: only an outage gets a clearer type
        raise_if_outage(error, dataset_uri, "publishing the shard set at")
        raise


def _write_shard_set(out_fs, dataset_path: str, dataset_uri: str, staged: list[StagedShard], schema: Schema,
                     source: SourceFingerprint, compression: str, num_bad_records: int,
                     record_layout: RecordLayout | None, statistics: DatasetStatistics | None) -> Manifest:
    local_out = is_local_fs(out_fs)
    join = path_join(out_fs)
    if out_fs.exists(dataset_path):
        logger.info("convert | removing the incomplete shard set at %s (no manifest) before writing", dataset_uri)
        out_fs.rm(dataset_path, recursive=True)
    infos = []
    for split in SPLITS:
        split_shards = [s for s in staged if s.split == split]
        for index, shard in enumerate(split_shards):
            relative = _shard_name(split, index, len(split_shards), compression)
            place_shard(out_fs, shard.local_path, join(dataset_path, relative))
            infos.append(ShardInfo(split=split, path=relative, num_records=shard.num_records,
                                   num_bytes=shard.num_bytes, digest=shard.digest))
    if local_out:  # the renames reach the disk before the manifest names them (the dataset directory itself is
        # fsynced by write_bytes_atomic with schema.json, next), and so do the entries of the new dataset
        # directory in data/ and of data/ in the output root
        for split in SPLITS:
            storage.fsync_dir(os.path.join(dataset_path, split))
        data_dir = os.path.dirname(dataset_path)
        storage.fsync_dir(data_dir)
        storage.fsync_dir(os.path.dirname(data_dir))
    return write_metadata(Destination(out_fs, dataset_path, dataset_uri), infos, schema, source, compression,
                          num_bad_records, record_layout, statistics)


def place_shard(out_fs, local_path: str, target: str) -> None:
    """A staged shard under its final path: renamed on the local filesystem (staged beside it), uploaded elsewhere."""
    if is_local_fs(out_fs):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(local_path, target)
        except OSError:  # staged on another filesystem: copied whole, durable, then renamed
            partial = f"{target}.tmp-{os.getpid()}"
            shutil.copyfile(local_path, partial)
            with open(partial, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(partial, target)
    else:
        out_fs.makedirs(posixpath.dirname(target), exist_ok=True)
        out_fs.put_file(local_path, target)


def write_metadata(out: Destination, shards: list[ShardInfo], schema: Schema, source: SourceFingerprint,
                   compression: str, num_bad_records: int, record_layout: RecordLayout | None,
                   statistics: DatasetStatistics | None, *, engine: str = "local",
                   nodes: dict[str, int] | None = None) -> Manifest:
    """schema.json and statistics.json beside shards already in place, then manifest.json last."""
    join = path_join(out.fs)
    storage.write_bytes_atomic(out.fs, join(out.path, SCHEMA_NAME), schema.model_dump_json(indent=2).encode())
    statistics_sha256 = None
    if statistics is not None:
        payload, statistics_sha256 = statistics_bytes(statistics)
        storage.write_bytes_atomic(out.fs, join(out.path, STATISTICS_NAME), payload)
    manifest = Manifest(
        fingerprint=source.sha256[:16],
        dataset_uri=out.uri,
        feature_schema=schema,
        shards=tuple(shards),
        source=source,
        compression=compression,
        num_bad_records=num_bad_records,
        created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        record_layout=record_layout,
        statistics_sha256=statistics_sha256,
        shard_digest=SHARD_DIGEST,
        engine=engine,
        nodes=nodes or {},
    )
    storage.write_bytes_atomic(out.fs, join(out.path, MANIFEST_NAME), manifest.to_json().encode())
    return manifest


def reusable_manifest(out_fs, dataset_path: str, dataset_uri: str, storage_options,
                      source: SourceFingerprint) -> Manifest | None:
    """The existing manifest when it matches the source and every shard is present with its size.

    Raises:
        StorageUnavailable: when the output storage does not answer.
    """
    try:
        return _reusable_manifest(out_fs, dataset_path, dataset_uri, storage_options, source)
    except Exception as error:  # re-raised: only an outage gets a clearer type
        raise_if_outage(error, dataset_uri, "looking for a finished shard set at")
        raise


def _reusable_manifest(out_fs, dataset_path: str, dataset_uri: str, storage_options,
                       source: SourceFingerprint) -> Manifest | None:
    join = path_join(out_fs)
    with contextlib.suppress(FileNotFoundError):
        if not out_fs.exists(join(dataset_path, MANIFEST_NAME)):
            return None
        manifest = load_manifest(dataset_uri, storage_options)
        if manifest.source.sha256 != source.sha256:
            logger.warning("convert | %s holds a manifest for another source; converting again", dataset_uri)
            return None
        sizes = {join(dataset_path, s.path): s.num_bytes for s in manifest.shards}
        listing = out_fs.find(dataset_path, detail=True)
        found = {_normal(p): int(info.get("size") or 0) for p, info in listing.items()}
        broken = [p for p, size in sizes.items() if found.get(_normal(p)) != size]
        if broken:
            logger.warning("convert | %s: %d shard(s) are missing or changed size (e.g. %s); converting again",
                           dataset_uri, len(broken), broken[0])
            return None
        return manifest
    return None


def _normal(path: str) -> str:
    return path.split("://", 1)[-1].lstrip("/")

