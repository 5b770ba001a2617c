"""Schema inference: the columns to convert, each column's dtype and shape from the first chunk, the Schema.

Arrow and Parquet types map to features so: integers and booleans to int64, floats and decimals to float32,
strings and binaries (large ones too) to strings, fixed-length lists of numbers to vectors, a dictionary to
its value type's feature (a dictionary<string> is a string column), timestamps (any unit, any time zone) and
dates to int64 instants (`TimeKind`: microseconds or days since 1970-01-01 UTC). Nested values (structs,
maps, lists of lists, lists of anything but numbers) have no such form: the error names the column and how to
leave it out. `data.parse_dates` reads CSV and JSONL columns of ISO 8601 strings as dates or timestamps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.config import DataConfig, DataFormat
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import DType, FeatureSpec, Schema, TimeKind
from pipeline_lib.data.readers.base import RawChunk, is_missing


@dataclass(frozen=True)
class ColumnType:
    """The dtype a column is converted to, and its shape per row: () for scalars, (n,) for vectors."""

    dtype: DType
    shape: tuple[int, ...] = ()
    time: TimeKind | None = None  # a date or timestamp column: int64 instants (`FeatureSpec.time`)
    source_type: str | None = None  # a time column's type in the source: `timestamp[us, tz=UTC]`, `date32`, `string`

    @property
    def numpy_dtype(self) -> type[np.generic]:
        """The numpy dtype of a numeric column's values (strings are Arrow binary arrays instead)."""
        return np.int64 if self.dtype == DType.INT64 else np.float32

    def describe(self) -> str:
        """`int64`, `float32[3]`, `timestamp`, ...: the dtype (a time column's kind) and, for vectors, the shape."""
        if self.time is not None:
            return self.time.value
        return f"{self.dtype.value}{list(self.shape) if self.shape else ''}"


def time_type(kind: TimeKind, source_type: str) -> ColumnType:
    """The type of a date or timestamp column: int64 instants of `kind`, from a column of `source_type`."""
    return ColumnType(DType.INT64, time=kind, source_type=source_type)


def is_text(arrow_type: pa.DataType) -> bool:
    """Whether an Arrow type holds strings or bytes."""
    return any(check(arrow_type) for check in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                                               pa.types.is_large_binary))


def is_list(arrow_type: pa.DataType) -> bool:
    """Whether an Arrow type is a list of any kind (variable, large or fixed size)."""
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type)


def select_columns(data: DataConfig, uri: str, available: Sequence[str]) -> tuple[list[str], list[str]]:
    """(feature columns, every column to read) for the configured label, features and key columns.

    Raises:
        ConversionError: when the label, a feature or a key column is not among `available` (the columns of `uri`),
            the features include the label, or no feature is left.
    """
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


def check_parse_dates(data: DataConfig, features: Sequence[str], uri: str) -> None:
    """Raises ConversionError when `data.parse_dates` names a column that is not a feature column of `uri`."""
    unknown = [c for c in data.parse_dates if c not in features]
    if unknown:
        raise ConversionError(
            f"data.parse_dates names {unknown}, not feature column(s) of {uri} (features: {list(features)}; the "
            "label cannot be a date); remove them from data.parse_dates or add them to data.features"
        )


def infer_types(chunk: RawChunk, fmt: DataFormat, parse_dates: Sequence[str] = ()) -> dict[str, ColumnType]:
    """The type of every column of `chunk` (the first chunk of the first file) from its values.

    Args:
        chunk: the first chunk of the first file.
        fmt: its format.
        parse_dates: `data.parse_dates`: columns of ISO 8601 strings to read as dates or timestamps (a column
            typed as one already, in Parquet, stays as it is).

    Raises:
        ConversionError: naming the column and file when a column has no TFRecord form or no value to infer from.
    """
    types = {}
    for name, raw in chunk.columns.items():
        if name in parse_dates:
            types[name] = _infer_dates(chunk.uri, name, raw)
        elif fmt == DataFormat.CSV and is_text(raw.type):  # numbers the reader parsed already are typed
            types[name] = _infer_csv(raw)
        else:
            types[name] = _infer_column(chunk.uri, name, raw)
    return types


ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")  # a date without a time: what makes a parse_dates column a date


def _infer_dates(uri: str, name: str, raw: Any) -> ColumnType:
    """A `data.parse_dates` column: a date when every value of the first chunk is a date (YYYY-MM-DD), else a
    timestamp. Values that do not parse become bad values when the column is converted."""
    where = f"column {name!r} of {uri}"
    if not isinstance(raw, list | np.ndarray):
        if isinstance(raw, pa.ChunkedArray):
            raw = raw.combine_chunks()
        if pa.types.is_dictionary(raw.type):
            raw = raw.dictionary_decode()
        if _arrow_time_kind(raw.type) is not None:  # typed already (Parquet): parse_dates changes nothing
            return _infer_column(uri, name, raw)
        if not is_text(raw.type):
            raise ConversionError(f"{where} is named in data.parse_dates but holds {raw.type} values; "
                                  "parse_dates takes columns of ISO 8601 strings (2024-05-01, "
                                  "2024-05-01T13:45:00Z): remove it from data.parse_dates")
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in raw.drop_null().to_pylist()]
    elif isinstance(raw, np.ndarray) and raw.dtype.kind == "M":  # NPZ datetime64: typed already
        return _infer_column(uri, name, raw)
    else:
        values = [v for v in (raw.tolist() if isinstance(raw, np.ndarray) else raw) if not is_missing(v)]
    texts = [v for v in values if isinstance(v, str) and v]
    if not texts:
        raise ConversionError(f"{where} is named in data.parse_dates but holds no ISO 8601 string in the first "
                              "chunk to infer a date or timestamp from; fill it in or remove it from "
                              "data.parse_dates")
    is_date = all(ISO_DATE.fullmatch(text) for text in texts)
    return time_type(TimeKind.DATE if is_date else TimeKind.TIMESTAMP, "string")


def _arrow_time_kind(arrow_type: pa.DataType) -> TimeKind | None:
    if pa.types.is_timestamp(arrow_type):
        return TimeKind.TIMESTAMP
    if pa.types.is_date(arrow_type):
        return TimeKind.DATE
    return None


def _arrow_scalar_dtype(arrow_type: pa.DataType) -> DType | None:
    if pa.types.is_dictionary(arrow_type):
        return _arrow_scalar_dtype(arrow_type.value_type)
    if pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
        return DType.INT64
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return DType.FLOAT32
    if is_text(arrow_type):
        return DType.STRING
    return None


# Values tried first when inferring a type: a column that fails on them fails as a whole, and Arrow builds an
# error message for every value a cast refuses, which costs more than the cast itself on a large column.
_SAMPLE_VALUES = 64


def _castable(values: pa.Array, arrow_type: pa.DataType) -> bool:
    """Whether every one of `values` casts to `arrow_type`: a sample first, the whole array only if it passes."""
    try:
        if len(values) > _SAMPLE_VALUES:
            pc.cast(values.slice(0, _SAMPLE_VALUES), arrow_type)
        pc.cast(values, arrow_type)
        return True
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


def _infer_column(uri: str, name: str, raw: Any) -> ColumnType:
    """The dtype and shape of one column from the values of the first chunk."""
    where = f"column {name!r} of {uri}"
    if isinstance(raw, np.ndarray):
        kind = raw.dtype.kind
        shape = (int(raw.shape[1]),) if raw.ndim == 2 else ()
        if kind in "iub":
            return ColumnType(DType.INT64, shape)
        if kind == "f":
            return ColumnType(DType.FLOAT32, shape)
        if kind in "US" and raw.ndim == 1:
            return ColumnType(DType.STRING)
        if kind == "M" and raw.ndim == 1:  # datetime64: days are dates, finer units timestamps
            return time_type(TimeKind.DATE if raw.dtype == np.dtype("datetime64[D]") else TimeKind.TIMESTAMP,
                             str(raw.dtype))
        raise ConversionError(f"{where} has dtype {raw.dtype} and shape {raw.shape[1:]}; use ints, floats or "
                              "strings (vectors of ints or floats)")
    if isinstance(raw, list):  # JSONL values
        return _infer_python(where, raw)
    arrow_type = raw.type
    value_type = arrow_type.value_type if pa.types.is_dictionary(arrow_type) else arrow_type
    kind = _arrow_time_kind(value_type)
    if kind is not None:
        return time_type(kind, str(value_type))
    scalar = _arrow_scalar_dtype(arrow_type)
    if scalar is not None:
        return ColumnType(scalar)
    leave_out = ("leave it out with data.features (list the other columns), or flatten it into columns of "
                 "numbers or strings in the source")
    if is_list(arrow_type):
        inner = _arrow_scalar_dtype(arrow_type.value_type)
        if inner not in (DType.INT64, DType.FLOAT32):
            raise ConversionError(f"{where} is a nested column of type {arrow_type}, and only lists of numbers "
                                  f"(vectors of a fixed length) have a TFRecord form; {leave_out}")
        lengths = pc.list_value_length(raw).drop_null()
        if len(lengths) == 0:
            raise ConversionError(f"{where} has no non-null value in the first chunk to infer its length from")
        # The most common length: lists of another length become bad rows.
        counts = pc.value_counts(lengths).to_pylist()
        length = max(counts, key=lambda c: c["counts"])["values"]
        if length < 1:
            raise ConversionError(f"{where} holds empty lists; vector columns need a fixed length ≥ 1")
        return ColumnType(inner, (int(length),))
    if pa.types.is_nested(arrow_type):
        raise ConversionError(f"{where} is a nested column of type {arrow_type}, which has no TFRecord form; "
                              f"{leave_out}")
    raise ConversionError(f"{where} has Arrow type {arrow_type}, which has no TFRecord form; use ints, floats, "
                          f"strings, dates, timestamps or fixed-length lists of numbers, or {leave_out}")


def _infer_csv(raw: pa.Array) -> ColumnType:
    """CSV values are all strings: int64 if every non-empty one parses as an integer, else float32, else string."""
    values = pc.filter(raw, pc.not_equal(raw, ""))
    if len(values) == 0:
        return ColumnType(DType.STRING)
    if _castable(values, pa.int64()):
        return ColumnType(DType.INT64)
    if _castable(values, pa.float64()):
        return ColumnType(DType.FLOAT32)
    return ColumnType(DType.STRING)


def _mode(values: Sequence[Any]) -> Any:
    """The most common value; ties go to the one seen first."""
    counts: dict[Any, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return max(counts, key=lambda v: counts[v])


def _infer_python(where: str, values: list) -> ColumnType:
    """JSON values are typed, so the most common type wins and values of another type become bad rows."""
    present = [v for v in values if not is_missing(v)]
    if not present:
        raise ConversionError(f"{where} has no value in the first chunk to infer its type from; fill it in or "
                              "leave the column out of data.features")
    kinds = [_python_kind(v) for v in present]
    grouped = _mode(["number" if k in ("int", "float") else k for k in kinds])
    if grouped == "number":
        return ColumnType(DType.FLOAT32 if "float" in kinds else DType.INT64)
    if grouped == "str":
        return ColumnType(DType.STRING)
    if grouped == "list":
        lists = [v for v in present if isinstance(v, list)]
        length = _mode([len(v) for v in lists])
        inner = {_python_kind(x) for v in lists if len(v) == length for x in v}
        if length < 1 or not inner <= {"int", "float"}:
            raise ConversionError(f"{where} holds lists of {sorted(inner) or 'nothing'}; vector columns need a fixed "
                                  "length ≥ 1 of numbers: leave it out with data.features (list the other "
                                  "columns), or flatten it into columns of numbers or strings in the source")
        return ColumnType(DType.INT64 if inner == {"int"} else DType.FLOAT32, (length,))
    raise ConversionError(f"{where} holds JSON {grouped} values; use numbers, strings or lists of numbers (dates "
                          "and timestamps as ISO 8601 strings named in data.parse_dates), or leave it out with "
                          "data.features (list the other columns)")


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


def build_schema(data: DataConfig, features: list[str], types: dict[str, ColumnType], vocabulary: list[str] | None,
                 label_max: int | None) -> Schema:
    """The dataset's Schema: features with their types, and the label (class indices for string labels).

    Args:
        data: the data config (its label).
        features: the feature columns, in order.
        types: every column's inferred type.
        vocabulary: the sorted distinct string labels, when the label is a string column.
        label_max: the largest integer label written, when the label is an int64 column.
    """
    label_type = types[data.label]
    num_classes = None
    if vocabulary is not None:
        num_classes = len(vocabulary)
        label = FeatureSpec(name=data.label, dtype=DType.INT64)
    elif label_type.dtype == DType.INT64:
        num_classes = (label_max or 0) + 1
        label = FeatureSpec(name=data.label, dtype=DType.INT64)
    else:
        label = FeatureSpec(name=data.label, dtype=DType.FLOAT32)
    return Schema(
        features=tuple(FeatureSpec(name=n, dtype=types[n].dtype, shape=types[n].shape, time=types[n].time,
                                   source_type=types[n].source_type) for n in features),
        label=label,
        num_classes=num_classes,
        label_vocabulary=tuple(vocabulary) if vocabulary is not None else None,
    )
