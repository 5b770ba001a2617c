"""The files a `data.source` URI or glob names, their formats, and the fingerprint of a source and its settings."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline_lib.config import Compression, DataConfig, DataEngine, DataFormat
from pipeline_lib.core import storage
from pipeline_lib.data.errors import ConversionError, raise_if_outage
from pipeline_lib.data.manifest import SourceFile, SourceFingerprint

# Bump when the bytes written for the same input and settings change: it is part of the fingerprint.
CONVERSION_VERSION = 3  # 2: statistics.json, missing values; 3: RFC 4180 CSV, dates and times, dictionaries

EXTENSIONS = {
    ".csv": DataFormat.CSV,
    ".parquet": DataFormat.PARQUET,
    ".pq": DataFormat.PARQUET,
    ".jsonl": DataFormat.JSONL,
    ".ndjson": DataFormat.JSONL,
    ".json": DataFormat.JSONL,
    ".npz": DataFormat.NPZ,
}
# Text formats may be compressed; fsspec decompresses them by extension.
TEXT_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class ListedFile:
    """One file of the source: its URI, its path on the source filesystem, its format and its manifest entry."""

    uri: str
    path: str
    format: DataFormat
    info: SourceFile


def _suffix_format(path: str) -> tuple[DataFormat | None, str]:
    """(format by extension, extension) of a path, looking through a compression suffix for text formats."""
    name = posixpath.basename(path).lower()
    for compression in TEXT_COMPRESSIONS:
        if name.endswith(compression):
            stem = name[: -len(compression)]
            ext = os.path.splitext(stem)[1]
            fmt = EXTENSIONS.get(ext)
            return (fmt if fmt in (DataFormat.CSV, DataFormat.JSONL) else None), ext + compression
    ext = os.path.splitext(name)[1]
    return EXTENSIONS.get(ext), ext


def list_source(data: DataConfig) -> tuple[Any, list[ListedFile]]:
    """The files `data.source` names (a file, a directory or a glob), sorted, with their formats.

    Returns:
        (the source's fsspec filesystem, its files).

    Raises:
        ConversionError: when the URI cannot be opened or listed (bad protocol, options or credentials), matches
            no files, or a file's format cannot be told from its extension.
        StorageUnavailable: when the storage does not answer while listing (a retry may succeed).
    """
    try:
        fs, path = storage.get_fs(data.source, data.storage_options)
    except Exception as error:  # noqa: BLE001  (a missing protocol package or bad options: any error type)
        raise_if_outage(error, data.source, "opening data.source")
        raise ConversionError(
            f"data.source {data.source!r} cannot be opened ({type(error).__name__}: {error}); check the URI's "
            "protocol and data.storage_options"
        ) from None
    try:
        if _GLOB_CHARS.search(path):
            paths = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            paths = [p for p in fs.find(path) if not posixpath.basename(p).startswith(("_", "."))]
            if data.format == DataFormat.AUTO:
                paths = [p for p in paths if _suffix_format(p)[0] is not None]
        elif fs.exists(path):
            paths = [path]
        else:
            paths = []
    except Exception as error:  # storage clients raise their own types; only OSErrors become ConversionErrors
        raise_if_outage(error, data.source, "listing data.source")
        if not isinstance(error, OSError):
            raise
        raise ConversionError(
            f"data.source {data.source!r} cannot be listed ({type(error).__name__}: {error}); check the URI, "
            "the bucket and the credentials in data.storage_options"
        ) from None
    if not paths:
        raise ConversionError(
            f"data.source {data.source!r} matches no files; check the path or glob (for example "
            "./raw/*.csv or s3://bucket/raw/) and that the files exist"
        )
    files = []
    for file_path in sorted(paths):
        uri = storage.unstrip(fs, file_path, data.source)
        fmt = data.format
        if fmt == DataFormat.AUTO:
            fmt, ext = _suffix_format(file_path)
            if fmt is None:
                raise ConversionError(
                    f"cannot tell the format of {uri!r} from its extension {ext or '(none)'!r}; set data.format "
                    f"to one of csv, parquet, jsonl, npz (known extensions: {sorted(EXTENSIONS)})"
                )
        try:
            info = fs.info(file_path)
        except Exception as error:  # re-raised: only an outage gets a clearer type
            raise_if_outage(error, uri, "reading the size and version of")
            raise
        files.append(
            ListedFile(uri=uri, path=file_path, format=fmt,
                       info=SourceFile(path=uri, size=int(info.get("size") or 0), mtime=storage.version_marker(info)))
        )
    return fs, files


def _settings(data: DataConfig) -> dict[str, Any]:
    """Every setting that changes the bytes written (not storage options, not the chunk size)."""
    return {
        "conversion_version": CONVERSION_VERSION,
        "format": data.format.value,
        "label": data.label,
        "features": list(data.features) if data.features is not None else None,
        "split": data.split.model_dump(mode="json"),
        "target_shard_mb": data.target_shard_mb,
        "compression": data.compression.value,
        **({"compression_level": data.compression_level} if data.compression == Compression.GZIP else {}),
        "on_bad_record": data.on_bad_record.value,
        "csv": {"delimiter": data.csv_delimiter, "quote_char": data.csv_quote_char,
                "column_names": list(data.csv_column_names) if data.csv_column_names is not None else None,
                "encoding": data.csv_encoding},
        "parse_dates": list(data.parse_dates),
        # Missing values change the rows written (skip) and statistics.json (the fill values it records).
        "missing": {name: data.missing_for(name).model_dump(mode="json")
                    for name in ["", *sorted(data.missing_columns)]},
        # The Ray engine lays the same records out in shards of its own (one set per task): another dataset.
        **({"engine": data.engine.value} if data.engine != DataEngine.LOCAL else {}),
    }


def source_fingerprint(data: DataConfig) -> SourceFingerprint:
    """The source files (path, size, mtime or etag) and a sha256 over them and every conversion setting.

    Raises:
        ConversionError: when the source matches no files or a file's format is unknown.
        StorageUnavailable: when the storage does not answer while listing.
    """
    _fs, files = list_source(data)
    return fingerprint_of(data, files)


def fingerprint_of(data: DataConfig, files: Sequence[ListedFile]) -> SourceFingerprint:
    """The fingerprint of files already listed (see `source_fingerprint`)."""
    infos = tuple(f.info for f in files)
    payload = json.dumps(
        {"files": [i.model_dump(mode="json") for i in infos], "settings": _settings(data)}, sort_keys=True
    ).encode()
    return SourceFingerprint(files=infos, sha256=hashlib.sha256(payload).hexdigest())


def dataset_uri_for(output_root: str, fingerprint: str) -> str:
    """`<output_root>/data/<fingerprint>`: where the shard set of that fingerprint lives."""
    return storage.join(output_root, "data", fingerprint)
