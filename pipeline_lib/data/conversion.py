"""Conversion of CSV, Parquet, JSONL and NPZ sources (any fsspec URI or glob) to TFRecord shards plus a manifest.

`convert` streams the source in chunks of `data.read_chunk_rows` rows, infers the schema from the first chunk,
splits rows into train and eval by a hash of their values, encodes them with the bulk encoder of
`pipeline_lib.data.encoding`, and rolls shards over at `data.target_shard_mb`. Shards are staged locally and
published under their final names, then `schema.json`, then `manifest.json` last: a set without a manifest
is never complete, and a rerun replaces it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import csv
import datetime as _dt
import hashlib
import io
import itertools
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pipeline_lib.config import Compression, DataConfig, DataFormat, OnBadRecord
from pipeline_lib.core import native, storage
from pipeline_lib.core.errors import UserError
from pipeline_lib.data import encoding
from pipeline_lib.data.manifest import (
    MANIFEST_NAME,
    SCHEMA_NAME,
    DType,
    FeatureSpec,
    Manifest,
    RecordLayout,
    Schema,
    ShardInfo,
    SourceFile,
    SourceFingerprint,
    load_manifest,
)

logger = logging.getLogger(__name__)

# Bump when the bytes written for the same input and settings change: it is part of the fingerprint.
CONVERSION_VERSION = 1
SPLITS = ("train", "eval")
MAX_BAD_SAMPLES = 5

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
_INT64_RANGE = (-(1 << 63), (1 << 63) - 1)
# Parquet row groups up to this size (uncompressed, the columns read) are decoded whole, one group ahead.
_WHOLE_ROW_GROUP_BYTES = 128 << 20
# Encoded batches queued for the shard writer thread at most (one being written, one waiting).
_WRITES_IN_FLIGHT = 2


class ConversionError(UserError, ValueError):
    """The source cannot be converted; the message names the file (and line or column) and the fix."""


# --- source discovery and fingerprints -----------------------------------------------------------------------


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


@dataclass(frozen=True)
class _SourceFile:
    uri: str
    path: str
    format: DataFormat
    info: SourceFile


def _version_marker(info: dict[str, Any]) -> str | None:
    for key in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is not None:
            return str(value)
    return None


def _list_source(data: DataConfig) -> tuple[Any, list[_SourceFile]]:
    """The files `data.source` names (a file, a directory or a glob), sorted, with their formats."""
    try:
        fs, path = storage.get_fs(data.source, data.storage_options)
    except Exception as error:  # noqa: BLE001  (a missing protocol package or bad options: any error type)
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
    except (PermissionError, OSError) as error:
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
        info = fs.info(file_path)
        files.append(
            _SourceFile(uri=uri, path=file_path, format=fmt,
                        info=SourceFile(path=uri, size=int(info.get("size") or 0), mtime=_version_marker(info)))
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
        "on_bad_record": data.on_bad_record.value,
        "csv_delimiter": data.csv_delimiter,
    }


def source_fingerprint(data: DataConfig) -> SourceFingerprint:
    """The source files (path, size, mtime or etag) and a sha256 over them and every conversion setting.

    Raises:
        ConversionError: when the source matches no files or a file's format is unknown.
    """
    _fs, files = _list_source(data)
    return _fingerprint(data, files)


def _fingerprint(data: DataConfig, files: Sequence[_SourceFile]) -> SourceFingerprint:
    infos = tuple(f.info for f in files)
    payload = json.dumps(
        {"files": [i.model_dump(mode="json") for i in infos], "settings": _settings(data)}, sort_keys=True
    ).encode()
    return SourceFingerprint(files=infos, sha256=hashlib.sha256(payload).hexdigest())


def dataset_uri_for(output_root: str, fingerprint: str) -> str:
    """`<output_root>/data/<fingerprint>`: where the shard set of that fingerprint lives."""
    return storage.join(output_root, "data", fingerprint)


# --- reading: every format yields raw chunks -----------------------------------------------------------------

_MISSING = object()  # a key absent from a JSON object


@dataclass
class _RawChunk:
    """Up to read_chunk_rows rows of one file, before type conversion.

    `columns` holds pyarrow arrays (CSV: all strings; Parquet: typed), Python lists (JSONL) or numpy arrays
    (NPZ). `structural` lists rows the reader could not split into columns at all: (position, reason).
    """

    uri: str
    unit: str  # "line" or "row"
    columns: dict[str, Any]
    num_rows: int
    positions_fn: Callable[[], np.ndarray]
    structural: list[tuple[int, str]] = field(default_factory=list)
    _positions: np.ndarray | None = None

    def position(self, row: int) -> int:
        """The 1-based line (CSV, JSONL) or row (Parquet, NPZ) of a row of this chunk in its file."""
        if self._positions is None:
            self._positions = self.positions_fn()
        return int(self._positions[row])


def _check_columns(uri: str, available: Sequence[str], needed: Sequence[str]) -> None:
    missing = [c for c in needed if c not in available]
    if missing:
        raise ConversionError(
            f"{uri} has no column(s) {missing}; available columns: {list(available)}. Fix data.label, "
            "data.features or data.split.key_columns, or make every source file carry these columns"
        )


class _CsvReader:
    """CSV by lines: chunks of whole lines parsed by pyarrow as strings, so every row keeps its line number.

    One record per line: quoted values with embedded newlines are not supported.
    """

    def __init__(self, fs, source: _SourceFile, data: DataConfig):
        self.fs, self.source, self.data = fs, source, data
        with self._open() as handle:
            header = handle.readline().decode("utf-8-sig").rstrip("\r\n")
        if not header:
            raise ConversionError(f"{source.uri} is empty; a CSV source needs a header line with the column names")
        self.names = next(csv.reader([header], delimiter=data.csv_delimiter))
        duplicates = sorted({n for n in self.names if self.names.count(n) > 1})
        if duplicates:
            raise ConversionError(f"{source.uri} line 1 repeats column name(s) {duplicates}; make them unique")

    def _open(self):
        return self.fs.open(self.source.path, "rb", compression="infer")

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[_RawChunk]:
        _check_columns(self.source.uri, self.names, needed)
        types = {n: pa.string() for n in self.names}
        with self._open() as handle:
            handle.readline()
            line_start = 2
            while True:
                lines = list(itertools.islice(handle, chunk_rows))
                if not lines:
                    return
                invalid: list[str] = []

                def on_invalid(row, invalid=invalid):
                    invalid.append(row.text)
                    return "skip"

                text = b"".join(lines)
                try:
                    table = pacsv.read_csv(
                        io.BytesIO(text if text.endswith(b"\n") else text + b"\n"),
                        read_options=pacsv.ReadOptions(column_names=self.names, use_threads=False),
                        parse_options=pacsv.ParseOptions(delimiter=self.data.csv_delimiter,
                                                         invalid_row_handler=on_invalid),
                        convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(needed)),
                    )
                except pa.ArrowInvalid as error:
                    raise ConversionError(
                        f"{self.source.uri} lines {line_start}-{line_start + len(lines) - 1} cannot be parsed as CSV "
                        f"({error}); CSV sources need UTF-8 text, one record per line, and data.csv_delimiter "
                        f"({self.data.csv_delimiter!r}) between fields"
                    ) from None
                structural, positions_fn = self._locate(lines, line_start, invalid)
                yield _RawChunk(
                    uri=self.source.uri, unit="line",
                    columns={n: table.column(n).combine_chunks() for n in needed},
                    num_rows=table.num_rows, positions_fn=positions_fn, structural=structural,
                )
                line_start += len(lines)

    def _locate(self, lines: list[bytes], line_start: int, invalid: list[str]):
        """Structural bad rows now (they are rare), row → line numbers lazily (needed only for bad values)."""
        blank = [i for i, line in enumerate(lines) if not line.strip(b"\r\n")]
        if not blank and not invalid:
            return [], lambda: line_start + np.arange(len(lines))
        expected = len(self.names)
        structural: list[tuple[int, str]] = []
        rows: list[int] = []
        pending = list(invalid)
        blank_set = set(blank)
        for i, line in enumerate(lines):
            if i in blank_set:
                continue
            text = line.rstrip(b"\r\n").decode("utf-8", "replace")
            if pending and text == pending[0]:
                pending.pop(0)
                fields = len(next(csv.reader([text], delimiter=self.data.csv_delimiter), []))
                structural.append((line_start + i, f"has {fields} field(s) but the header has {expected}"))
            else:
                rows.append(line_start + i)
        positions = np.array(rows, dtype=np.int64)
        return structural, lambda: positions


class _ParquetReader:
    def __init__(self, fs, source: _SourceFile, data: DataConfig):
        self.fs, self.source = fs, source
        self._handle = fs.open(source.path, "rb")
        try:
            self.file = pq.ParquetFile(self._handle)
        except Exception as error:  # noqa: BLE001  (pyarrow raises several types for a non-Parquet file)
            self._handle.close()
            raise ConversionError(f"{source.uri} is not a readable Parquet file ({error}); check data.format") from None
        self.names = list(self.file.schema_arrow.names)

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[_RawChunk]:
        _check_columns(self.source.uri, self.names, needed)
        first_row = 1
        try:
            for batch in self._batches(list(needed), chunk_rows):
                start = first_row
                yield _RawChunk(
                    uri=self.source.uri, unit="row", columns={n: batch.column(n) for n in needed},
                    num_rows=batch.num_rows,
                    positions_fn=lambda start=start, n=batch.num_rows: start + np.arange(n),
                )
                first_row += batch.num_rows
        finally:
            self._handle.close()

    def _batches(self, columns: list[str], chunk_rows: int) -> Iterator[pa.RecordBatch]:
        """Every row group's rows in batches of at most chunk_rows, in file order.

        A row group whose `columns` hold at most _WHOLE_ROW_GROUP_BYTES (uncompressed) is decoded whole, and the
        next such group is decoded on a helper thread while this one's batches are converted: decoding (list
        columns above all) is the slowest step of a Parquet conversion, and whole groups cost less CPU than
        batch-sized reads, which regrow pyarrow's buffers. A larger group is read batch by batch with nothing
        ahead, so memory stays bounded by two groups of that size or by one batch. One ParquetFile is never
        read from two threads at once.
        """
        def whole(group: int) -> bool:
            meta = self.file.metadata.row_group(group)
            size = sum(meta.column(i).total_uncompressed_size for i in range(meta.num_columns)
                       if meta.column(i).path_in_schema.split(".")[0] in columns)
            return size <= _WHOLE_ROW_GROUP_BYTES

        def read(group: int) -> pa.Table:
            return self.file.read_row_group(group, columns=columns, use_threads=False)

        num_groups = self.file.num_row_groups
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-parquet") as decoder:
            ahead: concurrent.futures.Future | None = None
            try:
                for group in range(num_groups):
                    if ahead is not None:
                        table, ahead = ahead.result(), None
                    elif whole(group):
                        table = read(group)
                    else:
                        yield from self.file.iter_batches(batch_size=chunk_rows, columns=columns, row_groups=[group])
                        continue
                    if group + 1 < num_groups and whole(group + 1):
                        ahead = decoder.submit(read, group + 1)
                    yield from table.to_batches(max_chunksize=chunk_rows)
                    del table
            finally:
                if ahead is not None:  # closed early: let the decode finish before the file closes
                    ahead.cancel()
                    with contextlib.suppress(BaseException):
                        ahead.result()


class _JsonlReader:
    """JSON Lines, one object per line, parsed line by line (so every row knows its line)."""

    def __init__(self, fs, source: _SourceFile, data: DataConfig):
        self.fs, self.source = fs, source
        self.names: list[str] | None = None

    def _open(self):
        return self.fs.open(self.source.path, "rb", compression="infer")

    def available(self) -> list[str]:
        """The keys of the first JSON object in the file."""
        with self._open() as handle:
            for line in handle:
                with contextlib.suppress(ValueError):
                    obj = json.loads(line) if line.strip() else None
                    if isinstance(obj, dict):
                        return list(obj)
        return []

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[_RawChunk]:
        loads = json.loads
        with self._open() as handle:
            line_no = 0
            first = True
            while True:
                lines = list(itertools.islice(handle, chunk_rows))
                if not lines:
                    return
                columns: dict[str, list] = {n: [] for n in needed}
                positions: list[int] = []
                structural: list[tuple[int, str]] = []
                for line in lines:
                    line_no += 1
                    if not line.strip():
                        continue
                    try:
                        obj = loads(line)
                    except ValueError as error:
                        structural.append((line_no, f"is not valid JSON ({error})"))
                        continue
                    if not isinstance(obj, dict):
                        structural.append((line_no, f"holds a JSON {type(obj).__name__}, not an object"))
                        continue
                    if first:
                        _check_columns(f"{self.source.uri} line {line_no}", list(obj), needed)
                        first = False
                    for name in needed:
                        columns[name].append(obj.get(name, _MISSING))
                    positions.append(line_no)
                array = np.array(positions, dtype=np.int64)
                yield _RawChunk(uri=self.source.uri, unit="line", columns=columns, num_rows=len(positions),
                                positions_fn=lambda array=array: array, structural=structural)


class _NpzReader:
    """NPZ, streamed: each `.npy` member is read chunk by chunk through its header, one column per array.

    1-D arrays are scalar columns and 2-D arrays vector columns; all must have the same first dimension.
    Fortran-ordered arrays cannot be streamed and are loaded whole; object arrays are refused (they need pickle).
    """

    def __init__(self, fs, source: _SourceFile, data: DataConfig):
        self.fs, self.source = fs, source
        self._handle = fs.open(source.path, "rb")
        try:
            self._zip = zipfile.ZipFile(self._handle)
        except zipfile.BadZipFile:
            self._handle.close()
            raise ConversionError(f"{source.uri} is not an NPZ (zip) file; check data.format") from None
        self.members = {m[:-4]: m for m in self._zip.namelist() if m.endswith(".npy")}
        self.names = list(self.members)

    def _header(self, member: str):
        stream = self._zip.open(member)
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        return stream, shape, fortran, dtype

    def chunks(self, needed: Sequence[str], chunk_rows: int) -> Iterator[_RawChunk]:
        _check_columns(self.source.uri, self.names, needed)
        streams = {}
        try:
            lengths = {}
            for name in needed:
                stream, shape, fortran, dtype = self._header(self.members[name])
                if dtype.hasobject:
                    raise ConversionError(
                        f"{self.source.uri} array {name!r} has dtype object, which needs pickle; save it with a "
                        "numeric or fixed-width string dtype"
                    )
                if len(shape) not in (1, 2):
                    raise ConversionError(
                        f"{self.source.uri} array {name!r} has shape {shape}; columns must be 1-D (scalars) or 2-D "
                        "(fixed-length vectors)"
                    )
                if fortran:
                    stream.close()
                    with self._zip.open(self.members[name]) as whole:
                        streams[name] = ("array", np.ascontiguousarray(np.lib.format.read_array(whole)), shape, dtype)
                else:
                    streams[name] = ("stream", stream, shape, dtype)
                lengths[name] = shape[0]
            if len(set(lengths.values())) > 1:
                raise ConversionError(
                    f"{self.source.uri} arrays have different lengths {lengths}; every array is one column and "
                    "needs one entry per row"
                )
            total = next(iter(lengths.values()))
            for start in range(0, total, chunk_rows):
                rows = min(chunk_rows, total - start)
                columns = {}
                for name, (kind, obj, shape, dtype) in streams.items():
                    if kind == "array":
                        columns[name] = obj[start : start + rows]
                        continue
                    per_row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
                    try:
                        raw = obj.read(rows * per_row * dtype.itemsize)
                    except zipfile.BadZipFile as error:  # the member's CRC-32, checked as np.load does
                        raise ConversionError(
                            f"{self.source.uri} array {name!r} is damaged: {error}; copy or save the file again "
                            "(nothing was written)"
                        ) from None
                    columns[name] = np.frombuffer(raw, dtype=dtype).reshape((rows, *shape[1:]))
                first = start + 1
                yield _RawChunk(uri=self.source.uri, unit="row", columns=columns, num_rows=rows,
                                positions_fn=lambda first=first, rows=rows: first + np.arange(rows))
        finally:
            for kind, obj, _shape, _dtype in streams.values():
                if kind == "stream":
                    obj.close()
            self._zip.close()
            self._handle.close()


_READERS = {
    DataFormat.CSV: _CsvReader,
    DataFormat.PARQUET: _ParquetReader,
    DataFormat.JSONL: _JsonlReader,
    DataFormat.NPZ: _NpzReader,
}


def _open_reader(fs, source: _SourceFile, data: DataConfig):
    try:
        return _READERS[source.format](fs, source, data)
    except ConversionError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise ConversionError(
            f"{source.uri} cannot be read as {source.format.value} ({type(error).__name__}: {error}); "
            "check data.format and the file"
        ) from None


def _available(reader) -> list[str]:
    return reader.available() if isinstance(reader, _JsonlReader) else list(reader.names)


# --- schema inference ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ColumnType:
    dtype: DType
    shape: tuple[int, ...] = ()


def _arrow_scalar_dtype(arrow_type: pa.DataType) -> DType | None:
    if pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
        return DType.INT64
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return DType.FLOAT32
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_binary(arrow_type) \
            or pa.types.is_large_binary(arrow_type):
        return DType.STRING
    return None


def _castable(values: pa.Array, arrow_type: pa.DataType) -> bool:
    try:
        pc.cast(values, arrow_type)
        return True
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


def _infer_column(uri: str, name: str, raw: Any) -> _ColumnType:
    """The dtype and shape of one column from the values of the first chunk."""
    where = f"column {name!r} of {uri}"
    if isinstance(raw, np.ndarray):
        kind = raw.dtype.kind
        shape = (int(raw.shape[1]),) if raw.ndim == 2 else ()
        if kind in "iub":
            return _ColumnType(DType.INT64, shape)
        if kind == "f":
            return _ColumnType(DType.FLOAT32, shape)
        if kind in "US" and raw.ndim == 1:
            return _ColumnType(DType.STRING)
        raise ConversionError(f"{where} has dtype {raw.dtype} and shape {raw.shape[1:]}; use ints, floats or "
                              "strings (vectors of ints or floats)")
    if isinstance(raw, list):  # JSONL values
        return _infer_python(where, raw)
    arrow_type = raw.type
    scalar = _arrow_scalar_dtype(arrow_type)
    if scalar is not None:
        return _ColumnType(scalar)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        inner = _arrow_scalar_dtype(arrow_type.value_type)
        if inner not in (DType.INT64, DType.FLOAT32):
            raise ConversionError(f"{where} is a list of {arrow_type.value_type}; vectors must hold ints or floats")
        lengths = pc.list_value_length(raw).drop_null()
        if len(lengths) == 0:
            raise ConversionError(f"{where} has no non-null value in the first chunk to infer its length from")
        # The most common length: lists of another length become bad rows.
        counts = pc.value_counts(lengths).to_pylist()
        length = max(counts, key=lambda c: c["counts"])["values"]
        if length < 1:
            raise ConversionError(f"{where} holds empty lists; vector columns need a fixed length ≥ 1")
        return _ColumnType(inner, (int(length),))
    raise ConversionError(f"{where} has Arrow type {arrow_type}, which has no TFRecord form; use ints, floats, "
                          "strings or fixed-length lists of numbers")


def _infer_csv(name: str, uri: str, raw: pa.Array) -> _ColumnType:
    values = pc.filter(raw, pc.not_equal(raw, ""))
    if len(values) == 0:
        return _ColumnType(DType.STRING)
    if _castable(values, pa.int64()):
        return _ColumnType(DType.INT64)
    if _castable(values, pa.float64()):
        return _ColumnType(DType.FLOAT32)
    return _ColumnType(DType.STRING)


def _mode(values: Sequence[Any]) -> Any:
    """The most common value; ties go to the one seen first."""
    counts: dict[Any, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return max(counts, key=lambda v: counts[v])


def _infer_python(where: str, values: list) -> _ColumnType:
    """JSON values are typed, so the most common type wins and values of another type become bad rows."""
    present = [v for v in values if v is not _MISSING and v is not None]
    if not present:
        raise ConversionError(f"{where} has no value in the first chunk to infer its type from; fill it in or "
                              "leave the column out of data.features")
    kinds = [_python_kind(v) for v in present]
    grouped = _mode(["number" if k in ("int", "float") else k for k in kinds])
    if grouped == "number":
        return _ColumnType(DType.FLOAT32 if "float" in kinds else DType.INT64)
    if grouped == "str":
        return _ColumnType(DType.STRING)
    if grouped == "list":
        lists = [v for v in present if isinstance(v, list)]
        length = _mode([len(v) for v in lists])
        inner = {_python_kind(x) for v in lists if len(v) == length for x in v}
        if length < 1 or not inner <= {"int", "float"}:
            raise ConversionError(f"{where} holds lists of {sorted(inner) or 'nothing'}; vector columns need a fixed "
                                  "length ≥ 1 of numbers")
        return _ColumnType(DType.INT64 if inner == {"int"} else DType.FLOAT32, (length,))
    raise ConversionError(f"{where} holds JSON {grouped} values; use numbers, strings or lists of numbers")


def _python_kind(value: Any) -> str:
    if isinstance(value, (bool, int)):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _infer(chunk: _RawChunk, fmt: DataFormat) -> dict[str, _ColumnType]:
    types = {}
    for name, raw in chunk.columns.items():
        if fmt == DataFormat.CSV:
            types[name] = _infer_csv(name, chunk.uri, raw)
        else:
            types[name] = _infer_column(chunk.uri, name, raw)
    return types


# --- coercion: raw values to the inferred types, with bad-value masks ----------------------------------------


@dataclass
class _Column:
    """Converted values (numpy for numbers, a pyarrow binary array for strings) and which rows were bad."""

    values: Any
    bad: np.ndarray  # bool per row
    reasons: dict[int, tuple[Any, str]]  # row → (value, why), for the rows in `bad`


def _arrow_target(ctype: _ColumnType) -> pa.DataType:
    return {DType.INT64: pa.int64(), DType.FLOAT32: pa.float32(), DType.STRING: pa.binary()}[ctype.dtype]


def _cast(values: pa.Array, target: pa.DataType) -> pa.Array:
    # float64 → float32 and int → float may round by design; integer targets stay strict (no truncation).
    return pc.cast(values, target, safe=not pa.types.is_floating(target))


def _unconvertible(values: pa.Array, target: pa.DataType) -> list[int]:
    """Indices of the values that do not cast, found by bisection (a few casts per bad value)."""
    try:
        _cast(values, target)
        return []
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        if len(values) == 1:
            return [0]
    half = len(values) // 2
    return _unconvertible(values.slice(0, half), target) + [half + i for i in _unconvertible(values.slice(half), target)]


def _is_text(arrow_type: pa.DataType) -> bool:
    return any(check(arrow_type) for check in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                                               pa.types.is_large_binary))


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type)


class _Marker:
    """Collects bad rows of one column with the first reason each row failed for."""

    def __init__(self, raw: Any, num_rows: int):
        self.raw = raw
        self.bad = np.zeros(num_rows, dtype=bool)
        self.reasons: dict[int, tuple[Any, str]] = {}

    def __call__(self, rows, why: str) -> None:
        for row in np.asarray(rows, dtype=np.int64).tolist():
            if not self.bad[row]:
                self.bad[row] = True
                value = self.raw[row]
                self.reasons[row] = (value.as_py() if hasattr(value, "as_py") else value, why)

    def column(self, values: Any) -> _Column:
        return _Column(values, self.bad, self.reasons)


def _coerce_arrow(raw: pa.Array, ctype: _ColumnType, is_csv: bool) -> _Column:
    """Cast a whole Arrow column at once; only when that fails, bisect for the values that do not convert."""
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks()
    num_rows = len(raw)
    mark = _Marker(raw, num_rows)
    if raw.null_count or (is_csv and ctype.dtype != DType.STRING):
        missing = raw.is_null()
        if is_csv and ctype.dtype != DType.STRING:
            missing = pc.or_(missing, pc.equal(raw, ""))
        mark(np.flatnonzero(missing.to_numpy(zero_copy_only=False)), "is missing")
    if ctype.shape:
        return _coerce_arrow_vector(raw, ctype, mark)
    if ctype.dtype == DType.STRING:
        if not _is_text(raw.type):
            if _is_list(raw.type) or pa.types.is_struct(raw.type):
                mark(np.arange(num_rows), f"is a {raw.type}, not a string")
                return mark.column(pa.nulls(num_rows, pa.binary()))
            raw = pc.cast(raw, pa.string())
        # Bad rows stay in the array (as they are) and are filtered out before encoding.
        return mark.column(pc.cast(raw, pa.large_binary() if pa.types.is_large_string(raw.type) else pa.binary()))
    if _is_list(raw.type) or pa.types.is_struct(raw.type):
        mark(np.arange(num_rows), f"is a {raw.type}, not a {ctype.dtype.value}")
        return mark.column(np.zeros(num_rows, np.int64 if ctype.dtype == DType.INT64 else np.float32))
    target = _arrow_target(ctype)
    dtype = np.int64 if ctype.dtype == DType.INT64 else np.float32
    while True:
        good_rows = np.flatnonzero(~mark.bad)
        if not len(good_rows):
            return mark.column(np.zeros(num_rows, dtype=dtype))
        subset = raw if len(good_rows) == num_rows else raw.filter(pa.array(~mark.bad))
        try:
            converted = _cast(subset, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
            mark(good_rows[_unconvertible(subset, target)],
                 f"cannot be converted to {ctype.dtype.value} (the type inferred from the first chunk)")
            continue
        if len(good_rows) == num_rows:  # the common case: Arrow's buffer, no copy
            return mark.column(converted.to_numpy(zero_copy_only=False).astype(dtype, copy=False))
        out = np.zeros(num_rows, dtype=dtype)  # bad rows stay 0: they are filtered out before encoding
        out[good_rows] = converted.to_numpy(zero_copy_only=False)
        return mark.column(out)


def _coerce_arrow_vector(raw: pa.Array, ctype: _ColumnType, mark: _Marker) -> _Column:
    num_rows = len(raw)
    (width,) = ctype.shape
    dtype = np.int64 if ctype.dtype == DType.INT64 else np.float32

    def zeros() -> np.ndarray:  # only where some row is bad: the common case returns Arrow's own buffer
        return np.zeros((num_rows, width), dtype=dtype)

    if not _is_list(raw.type):
        mark(np.arange(num_rows), f"is a {raw.type}, not a vector of {width} numbers")
        return mark.column(zeros())
    lengths = pc.list_value_length(raw).fill_null(-1).to_numpy(zero_copy_only=False)
    mark(np.flatnonzero(lengths != width), f"is not a vector of length {width}")
    target = _arrow_target(_ColumnType(ctype.dtype))
    while True:
        good_rows = np.flatnonzero(~mark.bad)
        if not len(good_rows):
            return mark.column(zeros())
        all_good = len(good_rows) == num_rows
        flat = pc.list_flatten(raw if all_good else raw.filter(pa.array(~mark.bad)))
        if flat.null_count:
            inner_null = flat.is_null().to_numpy(zero_copy_only=False).reshape(-1, width).any(axis=1)
            mark(good_rows[inner_null], "holds a missing value")
            continue
        try:
            values = _cast(flat, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
            failing = np.unique(np.array(_unconvertible(flat, target), dtype=np.int64) // width)
            mark(good_rows[failing], f"holds a value that cannot be converted to {ctype.dtype.value}")
            continue
        if all_good:  # the common case: the Arrow buffer itself, no copy
            return mark.column(values.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, width))
        out = zeros()
        out[good_rows] = values.to_numpy(zero_copy_only=False).reshape(-1, width)
        return mark.column(out)


def _coerce_numpy(raw: np.ndarray, ctype: _ColumnType) -> _Column:
    num_rows = raw.shape[0]
    mark = _Marker(raw, num_rows)
    expected_ndim = 2 if ctype.shape else 1
    if raw.ndim != expected_ndim or (ctype.shape and raw.shape[1] != ctype.shape[0]):
        want = f"vectors of length {ctype.shape[0]}" if ctype.shape else "scalars"
        mark(np.arange(num_rows), f"has shape {raw.shape[1:]} per row, but the column holds {want}")
        return mark.column(np.zeros((num_rows, *ctype.shape), np.float32) if ctype.dtype != DType.STRING
                           else pa.nulls(num_rows, pa.binary()))
    if ctype.dtype == DType.STRING:
        if raw.dtype.kind not in "US":
            mark(np.arange(num_rows), f"is not a string (dtype {raw.dtype})")
            return mark.column(pa.nulls(num_rows, pa.binary()))
        items = raw.tolist()
        return mark.column(pa.array(items, pa.binary() if raw.dtype.kind == "S" else pa.string()).cast(pa.binary()))
    if raw.dtype.kind not in "iubf":
        mark(np.arange(num_rows), f"cannot be converted to {ctype.dtype.value} (dtype {raw.dtype})")
        return mark.column(np.zeros((num_rows, *ctype.shape), np.float32))
    if ctype.dtype == DType.FLOAT32:
        return mark.column(raw.astype(np.float32, copy=False))
    if raw.dtype.kind == "f":
        axes = tuple(range(1, raw.ndim))
        integral = np.isfinite(raw) & (raw == np.round(raw)) & (np.abs(raw) < 2.0**63)
        mark(np.flatnonzero(~np.all(integral, axis=axes) if axes else ~integral), "cannot be converted to int64")
        safe = np.where(integral, raw, 0)
        return mark.column(safe.astype(np.int64))
    return mark.column(raw.astype(np.int64))


def _coerce_python(values: list, ctype: _ColumnType) -> _Column:
    num_rows = len(values)
    bad = np.zeros(num_rows, dtype=bool)
    reasons: dict[int, tuple[Any, str]] = {}
    if ctype.dtype == DType.STRING:
        try:
            return _Column(pa.array(values, pa.string()).cast(pa.binary()), bad, reasons)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            pass
        out = []
        for i, value in enumerate(values):
            if isinstance(value, str):
                out.append(value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append(json.dumps(value))
            else:
                bad[i] = True
                reasons[i] = (None if value is _MISSING else value,
                              "is missing" if value is _MISSING or value is None else "is not a string")
                out.append("")
        return _Column(pa.array(out, pa.string()).cast(pa.binary()), bad, reasons)
    dtype = np.int64 if ctype.dtype == DType.INT64 else np.float32
    shape = (num_rows, *ctype.shape)
    fast = _python_fast(values, ctype, shape)
    if fast is not None:
        return _Column(fast.astype(dtype, copy=False), bad, reasons)
    out = np.zeros(shape, dtype=dtype)
    for i, value in enumerate(values):
        why = _python_problem(value, ctype)
        if why:
            bad[i] = True
            reasons[i] = (None if value is _MISSING else value, why)
        else:
            out[i] = value
    return _Column(out, bad, reasons)


def _python_fast(values: list, ctype: _ColumnType, shape: tuple[int, ...]) -> np.ndarray | None:
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):
        return None
    if array.shape != shape:
        return None
    if ctype.dtype == DType.INT64:
        return array if array.dtype.kind in "iub" else None
    return array if array.dtype.kind in "iubf" else None


def _python_problem(value: Any, ctype: _ColumnType) -> str | None:
    if value is _MISSING or value is None:
        return "is missing"
    items = value
    if ctype.shape:
        if not isinstance(value, list) or len(value) != ctype.shape[0]:
            return f"is not a vector of length {ctype.shape[0]}"
    else:
        items = [value]
    for item in items:
        if item is None:
            return "holds a missing value"
        if ctype.dtype == DType.INT64:
            if not isinstance(item, int) or not (_INT64_RANGE[0] <= item <= _INT64_RANGE[1]):
                return "cannot be converted to int64"
        elif isinstance(item, bool) or not isinstance(item, (int, float)):
            return "cannot be converted to float32"
    return None


def _coerce(raw: Any, ctype: _ColumnType, fmt: DataFormat) -> _Column:
    if isinstance(raw, np.ndarray):
        return _coerce_numpy(raw, ctype)
    if isinstance(raw, list):
        return _coerce_python(raw, ctype)
    return _coerce_arrow(raw, ctype, is_csv=fmt == DataFormat.CSV)


# --- deterministic split -------------------------------------------------------------------------------------

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(h: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finalizer, in place on `h`: a bijective avalanche on uint64 (wrapping arithmetic is intended)."""
    scratch = np.empty_like(h) if scratch is None else scratch
    for shift, multiplier in ((_S30, _M1), (_S27, _M2)):
        np.right_shift(h, shift, out=scratch)
        h ^= scratch
        h *= multiplier
    np.right_shift(h, _S31, out=scratch)
    h ^= scratch
    return h


def _words(values: Any) -> np.ndarray:
    """A (rows, k) uint64 view of a column's values for hashing: number bits, or crc32c and length of strings."""
    if isinstance(values, np.ndarray):
        if values.dtype == np.float32:
            bits = values.reshape(len(values), -1).view(np.uint32)
            if bits.shape[1] % 2 == 0:
                return np.ascontiguousarray(bits).view(np.uint64)
            return bits.astype(np.uint64)
        return values.reshape(len(values), -1).astype(np.int64, copy=False).view(np.uint64)
    data, starts, lengths = encoding._string_column(values)
    view = memoryview(data)
    crc = _crc32c.crc32c
    digests = np.fromiter((crc(view[s : s + n]) for s, n in zip(starts.tolist(), lengths.tolist())),
                          dtype=np.uint64, count=len(starts))
    return (digests | (lengths.astype(np.uint64) << np.uint64(32))).reshape(-1, 1)


def _name_word(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def split_hash(columns: dict[str, Any], seed: int) -> np.ndarray:
    """A uint64 hash of each row from the given columns (in order) and the seed; depends on nothing else.

    Args:
        columns: name → converted values (numpy numbers, or an Arrow string/binary array).
        seed: data.split.seed.

    Returns:
        One uint64 per row.
    """
    num_rows = len(next(iter(columns.values())))
    scratch = np.empty(num_rows, dtype=np.uint64)
    h = _mix(np.full(num_rows, np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ np.uint64(0x9E3779B97F4A7C15)), scratch)
    for name, values in columns.items():
        h ^= _name_word(name)
        _mix(h, scratch)
        words = _words(values)
        if native.module is not None:  # the same fold in one C loop, row by row
            native.module.split_hash(h, np.ascontiguousarray(words), words.shape[1])
            continue
        # Word-major: each step reads one contiguous row of words instead of a strided column.
        for word in words.T.copy():
            h ^= word
            _mix(h, scratch)
    return h


def eval_mask(hashes: np.ndarray, eval_fraction: float) -> np.ndarray:
    """Rows whose top 32 hash bits fall below eval_fraction · 2^32 go to eval."""
    threshold = np.uint64(round(eval_fraction * (1 << 32)))
    return (hashes >> np.uint64(32)) < threshold


# --- shard writing -------------------------------------------------------------------------------------------


@dataclass
class _StagedShard:
    split: str
    local_path: str
    num_records: int
    num_bytes: int
    sha256: str


class _RollingShards:
    """One split's shards in the staging directory, rolled over once a shard holds target bytes of records.

    The size that counts is the uncompressed record bytes, so shard boundaries depend only on the rows. A full
    shard is closed (and fsynced, when durable) on the `closer` executor while the next one fills.
    """

    def __init__(self, split: str, staging_dir: str, compression: str, target_bytes: int, durable: bool,
                 closer: concurrent.futures.Executor, hasher: concurrent.futures.Executor):
        self.split, self.compression, self.target_bytes = split, compression, max(1, target_bytes)
        self.durable, self._closer, self._hasher = durable, closer, hasher
        self.dir = os.path.join(staging_dir, split)
        os.makedirs(self.dir, exist_ok=True)
        self._closing: list[concurrent.futures.Future] = []
        self._writer: encoding.TFRecordFileWriter | None = None

    def _open(self) -> encoding.TFRecordFileWriter:
        if self._writer is None:
            path = os.path.join(self.dir, f"part-{len(self._closing):05d}")
            self._writer = encoding.TFRecordFileWriter(path, self.compression, durable=self.durable,
                                                       hasher=self._hasher)
        return self._writer

    def _finish(self, writer: encoding.TFRecordFileWriter) -> _StagedShard:
        records, num_bytes, digest = writer.close()
        return _StagedShard(self.split, writer.path, records, num_bytes, digest)

    def _roll(self) -> None:
        writer, self._writer = self._writer, None
        self._closing.append(self._closer.submit(self._finish, writer))

    def write(self, batch: encoding.EncodedBatch) -> None:
        start, total = 0, len(batch)
        while start < total:
            writer = self._open()
            room = self.target_bytes - writer.num_uncompressed_bytes
            reached = batch.offsets[start + 1 :] - batch.offsets[start]
            cut = int(np.searchsorted(reached, room, side="left"))
            stop = min(total, start + cut + 1)
            writer.write(batch, start, stop)
            if writer.num_uncompressed_bytes >= self.target_bytes:
                self._roll()
            start = stop

    def close(self) -> list[_StagedShard]:
        """Every shard closed (and durable), in order."""
        if self._writer is not None and self._writer.num_records:
            self._roll()
        elif self._writer is None and not self._closing:
            # An empty split still gets one (empty, valid) shard so readers find the split.
            self._open()
            self._roll()
        elif self._writer is not None:
            self._writer.abort()
            os.remove(self._writer.path)
            self._writer = None
        return [future.result() for future in self._closing]

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        for future in self._closing:  # let queued closes finish before the staging directory goes
            with contextlib.suppress(BaseException):
                future.result()


# --- the conversion ------------------------------------------------------------------------------------------


@dataclass
class _Stats:
    num_rows: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    num_bad: int = 0
    samples: list[str] = field(default_factory=list)
    label_max: int | None = None  # integer labels: the largest seen
    layouts: set[RecordLayout | None] = field(default_factory=set)  # each chunk's encoding.record_layout (None: rows of varying shape)

    @property
    def record_layout(self) -> RecordLayout | None:
        """The byte layout of every record written, if all chunks had the same one."""
        return next(iter(self.layouts)) if len(self.layouts) == 1 else None


def _select_columns(data: DataConfig, uri: str, available: Sequence[str]) -> tuple[list[str], list[str]]:
    """(feature columns, every column to read) for the configured label, features and key columns."""
    if data.label not in available:
        raise ConversionError(
            f"data.label {data.label!r} is not a column of {uri}; available columns: {list(available)}"
        )
    if data.features is None:
        features = [c for c in available if c != data.label]
    else:
        unknown = [c for c in data.features if c not in available]
        if unknown:
            raise ConversionError(
                f"data.features names unknown column(s) {unknown} (in {uri}); available columns: {list(available)}"
            )
        if data.label in data.features:
            raise ConversionError(f"data.features includes the label {data.label!r}; leave it out of data.features")
        features = list(data.features)
    if not features:
        raise ConversionError(f"{uri} has no feature column besides the label {data.label!r}; add feature columns")
    keys = list(data.split.key_columns or ())
    unknown = [c for c in keys if c not in available]
    if unknown:
        raise ConversionError(
            f"data.split.key_columns names unknown column(s) {unknown} (in {uri}); available columns: {list(available)}"
        )
    needed = list(dict.fromkeys([*features, data.label, *keys]))
    return features, needed


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad_message(chunk: _RawChunk, position: int, column: str | None, value: Any, why: str) -> str:
    where = f"{chunk.uri} {chunk.unit} {position}"
    if column is None:
        return f"{where} {why}"
    return f"{where}, column {column!r}: value {_describe(value)} {why}"


def _scan_vocabulary(fs, files: Sequence[_SourceFile], data: DataConfig, label_type: _ColumnType) -> list[str]:
    """A first pass over the label column only: the sorted distinct string labels."""
    values: set[str] = set()
    for source in files:
        reader = _open_reader(fs, source, data)
        for chunk in reader.chunks([data.label], data.read_chunk_rows):
            column = _coerce(chunk.columns[data.label], label_type, source.format)
            good = column.values.filter(pa.array(~column.bad)) if column.bad.any() else column.values
            values.update(v.decode("utf-8", "surrogateescape") for v in pc.unique(good).to_pylist())
    return sorted(values)


def convert(data: DataConfig, output_root: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Convert `data.source` to TFRecord shards under `<output_root>/data/<fingerprint>/` and return the Manifest.

    The source is read in chunks of `data.read_chunk_rows` rows (CSV and JSONL by lines, Parquet by record
    batches, NPZ by rows of each array), so memory stays bounded by the chunk, not the input. A rerun on an
    unchanged source with the same settings finds the manifest and returns it without writing anything.

    Args:
        data: the data section of the pipeline config; `data.storage_options` are for the source.
        output_root: fsspec URI under which `data/<fingerprint>/` is written.
        storage_options: fsspec options for output_root.

    Returns:
        The manifest: shards with records, bytes and sha256, the schema and the source fingerprint.

    Raises:
        ConversionError: when the source matches no files, a column is unknown, a type cannot be inferred, or
            (with `on_bad_record: fail`) a row holds a bad value: the message names file, line, column and value.
    """
    fs, files = _list_source(data)
    source = _fingerprint(data, files)
    fingerprint = source.sha256[:16]
    dataset_uri = dataset_uri_for(output_root, fingerprint)
    out_fs, dataset_path = storage.get_fs(dataset_uri, storage_options)
    existing = _reusable(out_fs, dataset_path, dataset_uri, storage_options, source)
    if existing is not None:
        logger.info("convert | reusing %s: the source and settings are unchanged (fingerprint %s)", dataset_uri,
                    fingerprint)
        return existing

    first_reader = _open_reader(fs, files[0], data)
    features, needed = _select_columns(data, files[0].uri, _available(first_reader))
    first_chunks = first_reader.chunks(needed, data.read_chunk_rows)
    first_chunk = next(first_chunks, None)
    if first_chunk is None or first_chunk.num_rows == 0:
        first_chunks.close()
        raise ConversionError(
            f"{files[0].uri} has no data rows in its first {data.read_chunk_rows} lines or rows; the schema is "
            "inferred from the first chunk, so the first file needs data"
        )
    types = _infer(first_chunk, files[0].format)
    label_type = types[data.label]
    if label_type.shape:
        raise ConversionError(f"data.label {data.label!r} holds vectors of shape {label_type.shape}; the label "
                              "must be one number or string per row")
    vocabulary = None
    if label_type.dtype == DType.STRING:
        vocabulary = _scan_vocabulary(fs, files, data, label_type)
    logger.info("convert | %d file(s) from %s | columns: %s", len(files), data.source,
                ", ".join(f"{n}:{types[n].dtype.value}{list(types[n].shape) if types[n].shape else ''}" for n in needed))

    staging_dir, local_out = _staging_dir(out_fs, dataset_path, fingerprint)
    compression = "gzip" if data.compression == Compression.GZIP else "none"
    target_bytes = int(data.target_shard_mb * 1024 * 1024)
    # Local output is published by renaming the staged files, so they are fsynced as each shard closes (on the
    # closer thread, beside the next shard's writes); remote output is uploaded from staging, which is durable.
    stats = _Stats()
    writes = _BackgroundWrites()
    shards = {s: _RollingShards(s, staging_dir, compression, target_bytes, durable=local_out, closer=writes.closer,
                                hasher=writes.hasher)
              for s in SPLITS}
    try:
        for index, source_file in enumerate(files):
            logger.info("convert | reading %s (%s, %d bytes)", source_file.uri, source_file.format.value,
                        source_file.info.size)
            if index == 0:  # the chunk the schema came from is converted, not read a second time
                chunks = _prepend(first_chunk, first_chunks)
            else:
                chunks = _open_reader(fs, source_file, data).chunks(needed, data.read_chunk_rows)
            for chunk in _read_ahead(chunks):
                _convert_chunk(chunk, source_file.format, data, features, types, vocabulary, shards, writes,
                               stats)
        writes.wait()
        staged = [shard for s in SPLITS for shard in shards[s].close()]
        if stats.num_rows["train"] + stats.num_rows["eval"] == 0:
            raise ConversionError(
                f"data.source {data.source!r} produced no rows ({stats.num_bad} bad); check the files"
                + (" and on_bad_record" if stats.num_bad else "")
            )
        schema = _schema(data, features, types, vocabulary, stats)
        manifest = _publish(out_fs, dataset_path, dataset_uri, staged, schema, source, compression, stats, local_out)
    except BaseException:
        with contextlib.suppress(BaseException):
            writes.wait()
        for writer in shards.values():
            writer.abort()
        raise
    finally:
        first_chunks.close()
        writes.close()
        shutil.rmtree(staging_dir, ignore_errors=True)
    logger.info(
        "convert | rows: train %d, eval %d | shards: train %d, eval %d | bad rows: %d | %s",
        stats.num_rows["train"], stats.num_rows["eval"], len(manifest.shards_for("train")),
        len(manifest.shards_for("eval")), stats.num_bad, dataset_uri,
    )
    return manifest


class _BackgroundWrites:
    """Shard writes (file I/O, gzip and sha256 all release the GIL) on one thread, up to _WRITES_IN_FLIGHT batches.

    One thread keeps the records in order. A second batch queued behind the one being written lets encoding
    run on while a write waits on the device; waiting for the oldest once the queue is full bounds memory.
    """

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-write")
        # Closing a full shard (its fsync waits on the disk) runs here, beside the writes of the next one.
        self.closer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-close")
        # The sha256 of each written block runs here while the write thread copies the block to its file.
        self.hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-hash")
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()

    def submit(self, shards: dict[str, _RollingShards], batch: encoding.EncodedBatch, num_eval: int) -> None:
        """Queue `batch`: its first `num_eval` records go to the eval shards, the rest to train."""
        parts = []
        if num_eval:
            parts.append((shards["eval"], batch.rows(0, num_eval)))
        if num_eval < len(batch):
            parts.append((shards["train"], batch.rows(num_eval, len(batch))))
        while len(self._pending) >= _WRITES_IN_FLIGHT:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._write, parts))

    @staticmethod
    def _write(parts: list[tuple[_RollingShards, encoding.EncodedBatch]]) -> None:
        for split_shards, records in parts:
            split_shards.write(records)

    def wait(self) -> None:
        """Until every queued batch is written (or failed); then raises the first write error, if any."""
        error: BaseException | None = None
        while self._pending:
            try:
                self._pending.popleft().result()
            except BaseException as failure:  # noqa: BLE001  (re-raised below, once nothing is still writing)
                error = error or failure
        if error is not None:
            raise error

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.closer.shutdown(wait=True)
        self.hasher.shutdown(wait=True)


def _prepend(first: _RawChunk, rest: Iterator[_RawChunk]) -> Iterator[_RawChunk]:
    """`first`, then the chunks of `rest`; closing this closes `rest` (and its file)."""
    try:
        yield first
        yield from rest
    finally:
        rest.close()


def _read_ahead(chunks: Iterator[_RawChunk]) -> Iterator[_RawChunk]:
    """Read the next chunk on a helper thread while this one is encoded (Arrow and zlib release the GIL).

    At most two chunks are in memory: the one being converted and the one being read.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfdag-read") as pool:
        pending = pool.submit(next, chunks, None)
        try:
            while True:
                chunk = pending.result()
                if chunk is None:
                    return
                pending = pool.submit(next, chunks, None)
                yield chunk
        finally:
            pending.cancel()
            with contextlib.suppress(BaseException):
                pending.result()
            chunks.close()


def _convert_chunk(chunk: _RawChunk, fmt: DataFormat, data: DataConfig, features: list[str],
                   types: dict[str, _ColumnType], vocabulary: list[str] | None,
                   shards: dict[str, _RollingShards], writes: _BackgroundWrites, stats: _Stats) -> None:
    columns = {name: _coerce(chunk.columns[name], types[name], fmt) for name in chunk.columns}
    label = columns[data.label]
    if types[data.label].dtype == DType.INT64:
        negative = np.flatnonzero((label.values < 0) & ~label.bad)
        for row in negative.tolist():
            label.bad[row] = True
            label.reasons[row] = (int(label.values[row]), "is a negative class label; classification labels are 0..n-1")
    bad = np.zeros(chunk.num_rows, dtype=bool)
    for column in columns.values():
        bad |= column.bad
    if bad.any() or chunk.structural:
        _handle_bad(chunk, columns, bad, data, stats)
    keep = ~bad
    if not keep.all():
        mask = pa.array(keep)
        columns = {
            name: _Column(c.values[keep] if isinstance(c.values, np.ndarray) else c.values.filter(mask), c.bad[keep], {})
            for name, c in columns.items()
        }
    num_rows = int(keep.sum())
    if num_rows == 0:
        return
    values = {name: c.values for name, c in columns.items()}
    label_values = values[data.label]
    if vocabulary is not None:
        index = pc.index_in(label_values, value_set=pa.array([v.encode() for v in vocabulary], pa.binary()))
        if index.null_count:
            unknown = pc.filter(label_values, index.is_null())[0].as_py()
            raise ConversionError(
                f"{chunk.uri}: label {unknown!r} was not seen when the label vocabulary was collected; the source "
                "changed during conversion, rerun it"
            )
        encoded_label = index.to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        encoded_label = label_values
    if types[data.label].dtype == DType.INT64:
        high = int(label_values.max())
        stats.label_max = high if stats.label_max is None else max(stats.label_max, high)

    hash_names = list(data.split.key_columns) if data.split.key_columns else sorted([*features, data.label])
    hashes = split_hash({name: values[name] for name in hash_names}, data.split.seed)
    to_eval = eval_mask(hashes, data.split.eval_fraction)
    # Encoded eval rows first, then train rows (each in source order): the split costs no copy of the records.
    eval_rows = np.flatnonzero(to_eval)
    order = np.concatenate([eval_rows, np.flatnonzero(~to_eval)])
    encoded = {**{name: values[name] for name in features}, data.label: encoded_label}
    stats.layouts.add(encoding.record_layout(encoded))
    batch = encoding.encode_tfrecords(encoded, order=order)
    num_eval = len(eval_rows)
    writes.submit(shards, batch, num_eval)
    stats.num_rows["eval"] += num_eval
    stats.num_rows["train"] += num_rows - num_eval


def _handle_bad(chunk: _RawChunk, columns: dict[str, _Column], bad: np.ndarray, data: DataConfig,
                stats: _Stats) -> None:
    """Fail on the first bad row in file order, or count and sample the bad rows of this chunk."""
    problems: list[tuple[int, str]] = []
    for position, why in chunk.structural:
        problems.append((position, _bad_message(chunk, position, None, None, why)))
    rows = np.flatnonzero(bad)
    limit = 1 if data.on_bad_record == OnBadRecord.FAIL else max(0, MAX_BAD_SAMPLES - len(stats.samples))
    for row in rows[: max(limit, 1)].tolist():
        name = next(n for n, c in columns.items() if c.bad[row])
        value, why = columns[name].reasons[row]
        position = chunk.position(row)
        problems.append((position, _bad_message(chunk, position, name, value, why)))
    problems.sort(key=lambda p: p[0])
    if data.on_bad_record == OnBadRecord.FAIL:
        position, message = problems[0]
        raise ConversionError(
            f"bad record: {message}; fix the source or set data.on_bad_record: skip to drop such rows "
            "(they are counted in the manifest)"
        )
    count = len(chunk.structural) + len(rows)
    stats.num_bad += count
    for _position, message in problems:
        if len(stats.samples) < MAX_BAD_SAMPLES:
            stats.samples.append(message)
            logger.warning("convert | skipping bad record: %s", message)
    logger.info("convert | skipped %d bad record(s) in %s (%d so far)", count, chunk.uri, stats.num_bad)


def _schema(data: DataConfig, features: list[str], types: dict[str, _ColumnType], vocabulary: list[str] | None,
            stats: _Stats) -> Schema:
    label_type = types[data.label]
    num_classes = None
    if vocabulary is not None:
        num_classes = len(vocabulary)
        label = FeatureSpec(name=data.label, dtype=DType.INT64)
    elif label_type.dtype == DType.INT64:
        num_classes = (stats.label_max or 0) + 1
        label = FeatureSpec(name=data.label, dtype=DType.INT64)
    else:
        label = FeatureSpec(name=data.label, dtype=DType.FLOAT32)
    return Schema(
        features=tuple(FeatureSpec(name=n, dtype=types[n].dtype, shape=types[n].shape) for n in features),
        label=label,
        num_classes=num_classes,
        label_vocabulary=tuple(vocabulary) if vocabulary is not None else None,
    )


# --- staging, publishing, reuse ------------------------------------------------------------------------------


def _is_local_fs(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _staging_dir(out_fs, dataset_path: str, fingerprint: str) -> tuple[str, bool]:
    """A fresh local staging directory: next to the dataset for local output (publishing is a rename)."""
    if _is_local_fs(out_fs):
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


def _publish(out_fs, dataset_path: str, dataset_uri: str, staged: list[_StagedShard], schema: Schema,
             source: SourceFingerprint, compression: str, stats: _Stats, local_out: bool) -> Manifest:
    """Shards under their final names, then schema.json, then manifest.json last."""
    if out_fs.exists(dataset_path):
        logger.info("convert | removing the incomplete shard set at %s (no manifest) before writing", dataset_uri)
        out_fs.rm(dataset_path, recursive=True)
    infos = []
    for split in SPLITS:
        split_shards = [s for s in staged if s.split == split]
        for index, shard in enumerate(split_shards):
            relative = _shard_name(split, index, len(split_shards), compression)
            target = posixpath.join(dataset_path, relative) if not local_out else os.path.join(dataset_path, relative)
            if local_out:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(shard.local_path, target)
            else:
                out_fs.makedirs(posixpath.dirname(target), exist_ok=True)
                out_fs.put_file(shard.local_path, target)
            infos.append(ShardInfo(split=split, path=relative, num_records=shard.num_records,
                                   num_bytes=shard.num_bytes, sha256=shard.sha256))
    if local_out:  # the renames reach the disk before the manifest names them (the dataset directory itself is
        # fsynced by write_bytes_atomic with schema.json, next), and so do the entries of the new dataset
        # directory in data/ and of data/ in the output root
        for split in SPLITS:
            storage.fsync_dir(os.path.join(dataset_path, split))
        data_dir = os.path.dirname(dataset_path)
        storage.fsync_dir(data_dir)
        storage.fsync_dir(os.path.dirname(data_dir))
    join = os.path.join if local_out else posixpath.join
    storage.write_bytes_atomic(out_fs, join(dataset_path, SCHEMA_NAME), schema.model_dump_json(indent=2).encode())
    manifest = Manifest(
        fingerprint=source.sha256[:16],
        dataset_uri=dataset_uri,
        feature_schema=schema,
        shards=tuple(infos),
        source=source,
        compression=compression,
        num_bad_records=stats.num_bad,
        created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        record_layout=stats.record_layout,
    )
    storage.write_bytes_atomic(out_fs, join(dataset_path, MANIFEST_NAME), manifest.to_json().encode())
    return manifest


def _reusable(out_fs, dataset_path: str, dataset_uri: str, storage_options, source: SourceFingerprint) -> Manifest | None:
    """The existing manifest when it matches the source and every shard is present with its size."""
    join = os.path.join if _is_local_fs(out_fs) else posixpath.join
    with contextlib.suppress(FileNotFoundError):
        if not out_fs.exists(join(dataset_path, MANIFEST_NAME)):
            return None
        manifest = load_manifest(dataset_uri, storage_options)
        if manifest.source.sha256 != source.sha256:
            logger.warning("convert | %s holds a manifest for another source; converting again", dataset_uri)
            return None
        sizes = {
            join(dataset_path, s.path): s.num_bytes for s in manifest.shards
        }
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
