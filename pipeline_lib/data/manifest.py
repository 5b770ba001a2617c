"""The TFRecord dataset manifest: schema, shards with counts, sizes and checksums, source fingerprint."""

from __future__ import annotations

import enum
import json
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from pipeline_lib.core import storage
from pipeline_lib.core.digests import DigestAlgorithm

MANIFEST_NAME = "manifest.json"
SCHEMA_NAME = "schema.json"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DType(str, enum.Enum):
    INT64 = "int64"
    FLOAT32 = "float32"
    STRING = "string"


class TimeKind(str, enum.Enum):
    """What an int64 time feature counts: microseconds (timestamps) or days (dates) since 1970-01-01 UTC."""

    TIMESTAMP = "timestamp"
    DATE = "date"


def _none(value: Any) -> bool:
    return value is None


class FeatureSpec(_Frozen):
    """One column of a tf.train.Example: its dtype and fixed shape (() for a scalar, (n,) for a vector).

    A date or timestamp column is an int64 scalar with `time` set (the model derives its calendar parts) and
    `source_type`, the type it came from (`timestamp[ns, tz=UTC]`, `date32`, `string` under data.parse_dates).
    Both are left out of the JSON when unset, so the schema, and the manifest's content hash, of a dataset
    without time columns are what they were before these fields existed.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...] = ()
    time: TimeKind | None = Field(None, exclude_if=_none)
    source_type: str | None = Field(None, exclude_if=_none)


class Schema(_Frozen):
    features: tuple[FeatureSpec, ...]
    label: FeatureSpec
    num_classes: int | None = None  # classification: label values are 0..num_classes-1
    label_vocabulary: tuple[str, ...] | None = None  # string labels, mapped to their index

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)


class SourceFile(_Frozen):
    path: str
    size: int
    mtime: str | None = None  # mtime, etag or similar version marker


class SourceFingerprint(_Frozen):
    files: tuple[SourceFile, ...]
    sha256: str  # over the file list and conversion-relevant settings


class ShardInfo(_Frozen):
    split: str  # "train" or "eval"
    path: str  # relative to the dataset directory, e.g. train/part-00000-of-00004.tfrecord
    num_records: int
    num_bytes: int
    # The shard file's hex digest, of the manifest's `shard_digest` algorithm. Manifests written before the
    # algorithm was recorded call it "sha256" (and are sha256): they still load.
    digest: str = Field(validation_alias=AliasChoices("digest", "sha256"))


class FieldLayout(_Frozen):
    """Where one feature's values sit inside every serialized Example of a fixed-layout dataset."""

    name: str
    offset: int  # first byte of the packed values, from the start of the Example
    count: int  # values per record (1 for a scalar)
    varint_bytes: int = 0  # int64: bytes of each value's varint (all the same); 0 for float32 (4-byte floats)


class RecordLayout(_Frozen):
    """The one byte layout every record of the dataset has, when conversion wrote only fixed-width rows
    (numbers only, each int64 column's varints the same length on every row): readers may take the values
    at these offsets instead of parsing each Example. Absent when any record differs.
    """

    record_bytes: int
    fields: tuple[FieldLayout, ...]


class Manifest(_Frozen):
    """Written last, after every shard: its presence means the shard set is complete."""

    fingerprint: str
    dataset_uri: str  # <output_root>/data/<fingerprint>
    feature_schema: Schema
    shards: tuple[ShardInfo, ...]
    source: SourceFingerprint
    compression: str = "none"  # "none" or "gzip"
    num_bad_records: int = 0
    created_at: str = ""
    record_layout: RecordLayout | None = None
    statistics_sha256: str | None = None  # of statistics.json beside this manifest (None: converted without one)
    # The algorithm of every shard's `digest`; absent in manifests written before BLAKE3, which are sha256.
    shard_digest: DigestAlgorithm = DigestAlgorithm.SHA256
    engine: str = "local"  # data.engine that wrote the shards
    nodes: dict[str, int] = {}  # engine ray: the shards each Ray node wrote

    def shards_for(self, split: str) -> tuple[ShardInfo, ...]:
        return tuple(s for s in self.shards if s.split == split)

    def num_records(self, split: str) -> int:
        return sum(s.num_records for s in self.shards_for(split))

    def shard_uri(self, shard: ShardInfo) -> str:
        return storage.join(self.dataset_uri, shard.path)

    def content_hash(self) -> str:
        """sha256 over the shard digests and schema: what every worker must agree on."""
        import hashlib

        payload = json.dumps(
            {"schema": self.feature_schema.model_dump(mode="json"), "shards": [s.digest for s in self.shards]},
            sort_keys=True,
        ).encode()
        return hashlib.sha256(payload).hexdigest()

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def load_manifest(dataset_uri: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read <dataset_uri>/manifest.json."""
    fs, path = storage.get_fs(storage.join(dataset_uri, MANIFEST_NAME), storage_options)
    with fs.open(path, "rb") as handle:
        return Manifest.model_validate_json(handle.read())


def dataset_intact(manifest: Manifest, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the dataset `manifest` describes is still complete on storage: its manifest.json has the same content
    hash and every shard file is there with its size (one listing; the digests themselves are read by training)."""
    try:
        stored = load_manifest(manifest.dataset_uri, storage_options)
        fs, root = storage.get_fs(manifest.dataset_uri, storage_options)
        sizes = {path: info.get("size") for path, info in fs.find(root, detail=True).items()}
    except (OSError, ValueError):
        return False
    if stored.content_hash() != manifest.content_hash():
        return False
    return all(sizes.get(storage.join(root, shard.path).rstrip("/")) == shard.num_bytes for shard in manifest.shards)
