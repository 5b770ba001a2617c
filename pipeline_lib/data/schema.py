"""Schema inference: the columns to convert, each column's dtype and shape from the first chunk, the Schema."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline_lib.config import DataConfig, DataFormat
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import DType, FeatureSpec, Schema
from pipeline_lib.data.readers.base import RawChunk, is_missing


@dataclass(frozen=True)
class ColumnType:
    """The dtype a column is converted to, and its shape per row: () for scalars, (n,) for vectors."""

    dtype: DType
    shape: tuple[int, ...] = ()

    @property
    def numpy_dtype(self) -> type[np.generic]:
        """The numpy dtype of a numeric column's values (strings are Arrow binary arrays instead)."""
        return np.int64 if self.dtype == DType.INT64 else np.float32

    def describe(self) -> str:
        """`int64`, `float32[3]`, ...: the dtype and, for vectors, the shape."""
        return f"{self.dtype.value}{list(self.shape) if self.shape else ''}"


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


def infer_types(chunk: RawChunk, fmt: DataFormat) -> dict[str, ColumnType]:
    """The type of every column of `chunk` (the first chunk of the first file) from its values.

    Raises:
        ConversionError: naming the column and file when a column has no TFRecord form or no value to infer from.
    """
    types = {}
    for name, raw in chunk.columns.items():
        if fmt == DataFormat.CSV and is_text(raw.type):  # numbers the reader parsed already are typed
            types[name] = _infer_csv(raw)
        else:
            types[name] = _infer_column(chunk.uri, name, raw)
    return types


def _arrow_scalar_dtype(arrow_type: pa.DataType) -> DType | None:
    if pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
        return DType.INT64
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return DType.FLOAT32
    if is_text(arrow_type):
        return DType.STRING
    return None


# Values tried first when inferring a type: a column that fails on them fails as a whole, and Arrow builds an
# error message for every value a cast refuses (20 ms for 65,536 floats tried as int64, 33 columns: 0.6 s).
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
        raise ConversionError(f"{where} has dtype {raw.dtype} and shape {raw.shape[1:]}; use ints, floats or "
                              "strings (vectors of ints or floats)")
    if isinstance(raw, list):  # JSONL values
        return _infer_python(where, raw)
    arrow_type = raw.type
    scalar = _arrow_scalar_dtype(arrow_type)
    if scalar is not None:
        return ColumnType(scalar)
    if is_list(arrow_type):
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
        return ColumnType(inner, (int(length),))
    raise ConversionError(f"{where} has Arrow type {arrow_type}, which has no TFRecord form; use ints, floats, "
                          "strings or fixed-length lists of numbers")


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
                                  "length ≥ 1 of numbers")
        return ColumnType(DType.INT64 if inner == {"int"} else DType.FLOAT32, (length,))
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
        features=tuple(FeatureSpec(name=n, dtype=types[n].dtype, shape=types[n].shape) for n in features),
        label=label,
        num_classes=num_classes,
        label_vocabulary=tuple(vocabulary) if vocabulary is not None else None,
    )
